"""Unmounting that never pulls a model from under a process.

The kernel itself refuses a plain (non-lazy) unmount while any process has a file of the mount
open, mapped, or as its working directory: umount(8)'s "target is busy". That refusal is atomic,
so it is the check; /proc only names who is using the mount, for the message.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from colifs.kernel import MountEntry, mount_at

SHOWN_USERS = 3  # named in the one-line message; the rest are counted


@dataclass(frozen=True)
class User:
    """A process that holds the mount busy, and how."""

    pid: int
    name: str  # its command name (/proc/PID/comm)
    how: str  # "maps", "has open", "works in"
    path: str  # relative to the mount point

    def use(self) -> str:
        if self.how == "has open":
            return f"has {self.path} open"
        return f"{self.how} {'the mount' if self.path == '.' else self.path}"


class Busy(Exception):
    """The kernel refused the unmount: a process still uses the mount."""

    def __init__(self, mountpoint: str, users: list[User]) -> None:
        self.mountpoint = mountpoint
        self.users = users
        super().__init__(f"{mountpoint} is busy: {describe(users)}")


class UnmountFailed(Exception):
    """fusermount3 failed for another reason (its last line of output)."""


def describe(users: list[User]) -> str:
    """One line: the first few processes and what each holds, and how many more."""
    if not users:
        return "in use (by a process this user cannot see, or a mount inside it)"
    by_pid: dict[tuple[int, str], list[str]] = {}
    for u in users:
        by_pid.setdefault((u.pid, u.name), []).append(u.use())
    shown = [
        f"pid {pid} ({name}) {', '.join(uses)}" for (pid, name), uses in list(by_pid.items())[:SHOWN_USERS]
    ]
    more = len(by_pid) - SHOWN_USERS
    return "; ".join(shown) + (f"; and {more} more processes" if more > 0 else "")


def unmount(mountpoint: str, lazy: bool = False) -> None:
    """Unmount the resolved path `mountpoint`; a plain unmount raises Busy (naming the users)
    rather than detaching a mount in use.

    lazy: detach it from the tree now; the processes still using it keep their files, and the
    daemon keeps serving them until the last one closes (then the kernel ends the session)."""
    cmd = ["fusermount3", "-u", *(["-z"] if lazy else []), mountpoint]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    if done.returncode == 0:
        return
    msg = (done.stderr.strip().splitlines() or ["failed"])[-1]
    if "busy" in msg:
        entry = mount_at(mountpoint)
        raise Busy(mountpoint, users(mountpoint, entry) if entry else [])
    raise UnmountFailed(msg.removeprefix("fusermount3: "))


def users(mountpoint: str, entry: MountEntry) -> list[User]:
    """Every process (that this user may inspect) using the mount: mapped, open or working in it."""
    root = mountpoint
    dev = f"{os.major(entry.dev):02x}:{os.minor(entry.dev):02x}"
    found: list[User] = []
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        if pid == os.getpid():
            continue
        try:
            found.extend(_process_users(pid, root, entry.mount_id, dev))
        except OSError:  # gone meanwhile, or not ours to look at
            continue
    return found


def _process_users(pid: int, root: str, mount_id: int, dev: str) -> list[User]:
    proc = f"/proc/{pid}"
    with open(f"{proc}/comm") as f:
        name = f.read().strip()
    out: dict[tuple[str, str], User] = {}

    def add(how: str, path: str) -> None:
        rel = os.path.relpath(path, root) if path.startswith(root) else path
        out.setdefault((how, rel), User(pid, name, how, rel))

    with open(f"{proc}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[3] == dev:
                add("maps", fields[5].rstrip("\n").removesuffix(" (deleted)"))
    for fd in os.listdir(f"{proc}/fd"):
        try:
            with open(f"{proc}/fdinfo/{fd}") as f:
                info = f.read()
            target = os.readlink(f"{proc}/fd/{fd}")
        except OSError:
            continue
        if f"\nmnt_id:\t{mount_id}\n" in info:
            add("has open", target)
    for link in ("cwd", "root"):
        target = os.readlink(f"{proc}/{link}")
        if target == root or target.startswith(root + "/"):
            add("works in", target if target != root else ".")
    return list(out.values())
