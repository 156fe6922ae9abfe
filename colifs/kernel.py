"""Kernel knobs of one FUSE mount: the bdi's readahead and the connection's background queue.

Buffered and mmap reads reach a FUSE daemon as 128 KiB requests, 2 in flight, with the default
readahead: too few to keep two drives busy. A larger `read_ahead_kb` on the mount's bdi makes the
kernel send 1 MiB requests, more of them in flight, bounded by the connection's `max_background`.
Both live in sysfs and need root; without it the defaults stay and this says so once.

The readahead also decides how much an mmap fault reads around itself (llama.cpp advises its file
sequential, which doubles it): on slow drives a small one wins (less read that is not used, the
fault's read done sooner), on fast ones the daemon's CPU per request decides and a larger one wins.
The daemon's CPU grows with the bytes it serves, all drives added: unless given, the native
engine's mount takes a smaller readahead when its probe measured the drives slow together (BY_SPEED;
docs/benchmarks.md runs 68c-68i). Unprobed (weights given) it starts at its default; while serving,
the speed the drives deliver saturated moves it for the files opened from then on (`Tuning.follow`).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

log = logging.getLogger("colifs")

CONNECTIONS = "/sys/fs/fuse/connections"


# (the drives' probed MB/s added, below which: readahead KiB). llama.cpp's mmap decode against the
# fast drive read directly, 128 / 64 / 32 KiB: 150 + 50 0.92 / 1.14 / 1.25, 300 + 100 0.96 / 1.19 /
# 1.21, 600 + 200 1.01 / 1.18 / 1.11, 900 + 300 1.10 / 1.09 / 0.92 (the daemon's CPU decides there).
BY_SPEED = ((600.0, 32), (1000.0, 64))
DEFAULT_KB = 128  # the native engine's readahead above them (and when their speed is not known)
# While serving: the speed the drives deliver saturated moves the readahead of later opens once it
# is MARGIN past a threshold, in HOLD measurements in a row (an open file keeps the one it was opened
# with).
MARGIN = 0.10
HOLD = 3


@dataclass(frozen=True)
class Knobs:
    read_ahead_kb: int  # 0: leave the kernel's default
    max_background: int  # 0: leave the kernel's default; congestion_threshold follows at 3/4
    by_speed: bool = False  # the readahead is the default: the drives' speed (probed, measured) moves it
    why: str = "the default"  # what chose the readahead (stats.json kernel.read_ahead_chosen)

    def for_drives(self, mb_per_s: float | None, how: str = "probed") -> Knobs:
        """These knobs for drives that read `mb_per_s` together (None or 0: not measured), `how`
        they were measured."""
        if not self.by_speed:
            return self
        if not mb_per_s:
            return replace(self, why="the default (the drives' speed is not known)")
        for below, kb in BY_SPEED:
            if mb_per_s < below:
                why = f"the drives {how} at {mb_per_s:.4g} MB/s together, below {below:.0f}"
                return replace(self, read_ahead_kb=kb, why=why)
        return replace(self, read_ahead_kb=DEFAULT_KB, why=f"the default (the drives {how} at {mb_per_s:.0f} "
                       "MB/s together)")  # fmt: skip


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo: what is mounted on a path."""

    mount_id: int
    dev: int  # st_dev of the files on it
    fstype: str  # `fuse.colifs`, `ext4`, ...
    user_id: int | None = None  # a FUSE mount's `user_id=`: whose daemon serves it, as the kernel says


def _unescape(field: str) -> str:
    """The kernel writes spaces, tabs, newlines and backslashes in paths as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _mounts() -> Iterator[tuple[str, MountEntry]]:
    """Every line of /proc/self/mountinfo: (the mount point, what is mounted there), in order."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            try:
                sep = fields.index("-", 6)
            except ValueError:
                continue
            major, minor = fields[2].split(":")
            dev = os.makedev(int(major), int(minor))
            entry = MountEntry(int(fields[0]), dev, fields[sep + 1], _user_id(fields[sep + 3 :]))
            yield _unescape(fields[4]), entry


def _user_id(super_options: list[str]) -> int | None:
    """The `user_id=` of a FUSE mount's super options (the uid that mounted it: its daemon's)."""
    for opt in (super_options[0] if super_options else "").split(","):
        key, _, value = opt.partition("=")
        if key == "user_id" and value.isdigit():
            return int(value)
    return None


def mount_at(real: str) -> MountEntry | None:
    """The mount on the resolved path `real` (of mounts stacked on one path, the last: the one seen
    there). It resolves nothing itself: a daemon must not stat its own mount before serving it."""
    found = None
    for path, entry in _mounts():
        if path == real:
            found = entry
    return found


def colifs_mounts() -> list[tuple[str, MountEntry]]:
    """Every colifs mount this process can see: (its mount point, as the kernel writes it; what
    is mounted there). Read from /proc alone: no mount is touched."""
    return [(path, entry) for path, entry in _mounts() if entry.fstype == "fuse.colifs"]


def resolved(path: str) -> str:
    """`path` resolved (realpath), except that a path naming a mount point as written, or once its
    parent directory is resolved, is taken as it is: resolving stats the last component too, and
    the root of a hung mount never answers (`colifs umount` of a mount whose daemon hangs)."""
    plain = os.path.abspath(path)
    points = {p for p, _ in _mounts()}
    if plain in points:
        return plain
    joined = os.path.join(os.path.realpath(os.path.dirname(plain)), os.path.basename(plain))
    return joined if joined in points else os.path.realpath(plain)


def held_under(root: str) -> list[str]:
    """The paths of this process's open descriptors inside directory `root`, a resolved path (never
    resolved again here: the drive may hang, and is taken away for that): what keeps its file
    system from being unmounted."""
    inside = os.path.join(root, "")
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (this listing's own descriptor too)
            continue
        if target.removesuffix(" (deleted)").startswith(inside):
            out.append(target)
    return out


def mount_type(path: str) -> str | None:
    """The filesystem type mounted at `path`, None when nothing is."""
    entry = mount_at(resolved(path))
    return entry.fstype if entry else None


def _write(path: str, value: int) -> None:
    with open(path, "w") as f:
        f.write(f"{value}\n")


def _read(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _connections_dir() -> str | None:
    if os.path.isdir(CONNECTIONS) and os.listdir(CONNECTIONS):
        return CONNECTIONS
    if os.path.isdir(CONNECTIONS) and os.geteuid() == 0:  # fusectl not mounted yet
        subprocess.run(["mount", "-t", "fusectl", "none", CONNECTIONS], capture_output=True)
        if os.listdir(CONNECTIONS):
            return CONNECTIONS
    return None


def bdi_read_ahead(mountpoint: str) -> str:
    """The sysfs file of the readahead of the mount at `mountpoint` (it stats the mount)."""
    return _bdi_file(os.stat(mountpoint).st_dev)


def _bdi_file(dev: int) -> str:
    return f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"


def tune(mountpoint: str, knobs: Knobs) -> dict[str, int | None]:
    """Apply the knobs to the mount at `mountpoint` (call it once the mount serves: it stats it).

    Returns the values in force afterwards, as read back from sysfs (None: not readable).
    """
    dev = os.stat(mountpoint).st_dev
    bdi = _bdi_file(dev)
    conn = _connections_dir()
    conn_dir = os.path.join(conn, str(os.minor(dev))) if conn else None
    wanted = []
    if knobs.read_ahead_kb:
        wanted.append((bdi, knobs.read_ahead_kb))
    if knobs.max_background and conn_dir:
        # max_background first: the kernel refuses a congestion_threshold above it.
        wanted.append((os.path.join(conn_dir, "max_background"), knobs.max_background))
        wanted.append((os.path.join(conn_dir, "congestion_threshold"), knobs.max_background * 3 // 4))
    elif knobs.max_background:
        log.warning("cannot find %s/<connection>: max_background left at the kernel's default", CONNECTIONS)
    for path, value in wanted:
        try:
            _write(path, value)
        except OSError as e:
            log.warning("cannot set %s to %d (%s); kernel default kept", path, value, e.strerror)
    return {
        "read_ahead_kb": _read(bdi),
        "max_background": _read(os.path.join(conn_dir, "max_background")) if conn_dir else None,
        "congestion_threshold": _read(os.path.join(conn_dir, "congestion_threshold")) if conn_dir else None,
    }


class Tuning:
    """The knobs wanted for one mount, and the values in force once applied (for stats.json).

    A readahead chosen by speed follows the drives while serving (`follow`): a mount with weights
    given, which probed nothing, and drives that slow down or recover get the readahead of their
    speed for the files opened from then on (the kernel copies it into each open file)."""

    def __init__(self, knobs: Knobs) -> None:
        self.knobs = knobs
        self._applied: dict[str, int | None] = {}
        self._bdi: str | None = None  # once applied, if the mount's readahead took the value wanted
        self._seen = -1  # the last measurement looked at
        self._asked = (0, 0)  # (the readahead the drives' speed asks for, measurements in a row)

    def apply(self, mountpoint: str) -> dict[str, int | None]:
        applied = tune(mountpoint, self.knobs)
        if self.knobs.by_speed and applied["read_ahead_kb"] == self.knobs.read_ahead_kb:
            self._bdi = bdi_read_ahead(mountpoint)  # not root: nothing to follow with
        self._applied = applied
        return dict(applied)

    def follow(self, mb_per_s: float | None, measurement: int) -> None:
        """The drives' speed measured saturated while serving (None: not yet), and the number of
        that measurement: once it asks for another readahead, MARGIN past the threshold and in HOLD
        measurements in a row, that one."""
        if self._bdi is None or not mb_per_s or measurement == self._seen:
            return
        self._seen = measurement
        wanted = self.knobs.for_drives(mb_per_s, "measured saturated")
        near = {self.knobs.for_drives(mb_per_s * f).read_ahead_kb for f in (1 - MARGIN, 1 + MARGIN)}
        if wanted.read_ahead_kb == self.knobs.read_ahead_kb or len(near) > 1:
            self._asked = (0, 0)
            return
        kb, times = self._asked
        self._asked = (wanted.read_ahead_kb, times + 1 if kb == wanted.read_ahead_kb else 1)
        if self._asked[1] >= HOLD:
            self._asked = (0, 0)
            self._set(wanted)

    def _set(self, wanted: Knobs) -> None:
        assert self._bdi is not None
        try:
            _write(self._bdi, wanted.read_ahead_kb)
        except OSError as e:
            log.warning("cannot set %s to %d (%s); it stays", self._bdi, wanted.read_ahead_kb, e.strerror)
            self._bdi = None  # one warning, not one per measurement
            return
        log.info("readahead %d -> %d KiB for files opened from now on: %s", self.knobs.read_ahead_kb,
                 wanted.read_ahead_kb, wanted.why)  # fmt: skip
        applied = {**self._applied, "read_ahead_kb": _read(self._bdi)}
        self.knobs = replace(wanted, why=f"{wanted.why}, for files opened since {time.strftime('%H:%M:%S')}")
        self._applied = applied

    def applied(self) -> dict[str, int | str | None]:
        """Readahead and FUSE queue as read back from sysfs ({} until applied), and what chose the
        readahead."""
        if not self._applied:
            return {}
        why, wanted = self.knobs.why, self.knobs.read_ahead_kb
        if wanted and self._applied["read_ahead_kb"] != wanted:
            why += f" ({wanted} KiB not applied)"
        return {**self._applied, "read_ahead_chosen": why}
