"""Talking to a running mount from another process: its stats.json, unmounting it and waiting for
its daemon, reloading it, taking a mirror away or bringing it back (its control socket), the route
of a byte (an extended attribute). Errors are one line (QuietError)."""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
import time

from colifs.checks import judge_mirror
from colifs.control import NoAnswer, NotAsked, ask, ask_everyone
from colifs.errors import BusyError, NotMountedError, NotReloadedError, QuietError, UsageError
from colifs.kernel import colifs_mounts, mount_at, resolved
from colifs.namespace import CONTROL_DIR, ROUTE_XATTR
from colifs.progress import Progress
from colifs.unmount import Busy, UnmountFailed, describe, unmount


def read_stats(mountpoint: str) -> dict:
    """The mount's stats.json; NotMountedError when it is not a (live) colifs mount."""
    path = os.path.join(mountpoint, CONTROL_DIR.decode(), "stats.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise NotMountedError(f"{mountpoint} is not a colifs mount") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise NotMountedError(f"{mountpoint}: stale mount, its daemon is gone") from None
        raise NotMountedError(f"{mountpoint}: {e.strerror}") from None


def umount(mountpoint: str, lazy: bool, timeout: float) -> str | None:
    """Unmount and wait for the daemon to exit (it saves its usage first); what to tell the user,
    if anything. Busy without `lazy`: BusyError naming who uses it (nothing is pulled)."""
    mnt = _colifs_mount(mountpoint)
    try:
        pid = int(read_stats(mnt)["pid"])
    except NotMountedError:  # stale: the daemon died; only the kernel's mount is left
        _unmount_or_fail(mnt, lazy=True)
        return f"cleared stale mount {mnt}"
    try:
        unmount(mnt)  # the kernel refuses while any process uses the mount
    except Busy as e:
        if not lazy:
            raise BusyError(f"{e} (it keeps serving; --lazy detaches it now)") from None
        _unmount_or_fail(mnt, lazy=True)
        return (
            f"detached {mnt}; daemon {pid} serves what is still open or mapped and exits once "
            f"the last process lets go ({describe(e.users)})"
        )
    except UnmountFailed as e:
        raise QuietError(f"cannot unmount {mnt}: {e}") from None
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            raise QuietError(f"daemon {pid} of {mnt} did not exit within {timeout:g} s")
        time.sleep(0.02)
    return None


def _unmount_or_fail(mnt: str, lazy: bool) -> None:
    try:
        unmount(mnt, lazy)
    except UnmountFailed as e:
        raise QuietError(f"cannot unmount {mnt}: {e}") from None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


POLL = 0.2  # s between looks at a reloading mount's stats


def reload(mountpoint: str, timeout: float) -> dict:
    """Ask the mount's daemon to check its mirrors again (SIGHUP) and wait until a reload that
    started after the signal has ended: what stats.json says of it."""
    mnt = _colifs_mount(mountpoint)
    deadline = time.monotonic() + timeout
    before = _answer(mnt, deadline, timeout)
    try:
        pid, started = int(before["pid"]), int(before["reload"]["started"])
    except (KeyError, TypeError, ValueError):
        raise NotReloadedError(f"the daemon of {mnt} cannot reload (an older colifs: remount it)") from None
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        raise NotMountedError(f"{mnt}: stale mount, its daemon is gone") from None
    except PermissionError:
        raise NotReloadedError(
            f"not allowed to signal the daemon of {mnt} (pid {pid}): run as its user"
        ) from None
    # A reload in progress when the signal came ends first: wait for one that started after it.
    # Each look builds the daemon a stats snapshot (of every file): looking often slows the reload.
    while (now := _answer(mnt, deadline, timeout)["reload"])["count"] <= started:
        time.sleep(POLL)
    if "error" in now["last"]:
        raise NotReloadedError(f"{mnt}: reload failed ({now['last']['error']}); it serves as before")
    return now["last"]


def _answer(mnt: str, deadline: float, timeout: float) -> dict:
    """The mount's stats.json, before the deadline."""
    st = _stats_within(mnt, deadline - time.monotonic())
    if st is None or time.monotonic() > deadline:
        raise NotReloadedError(
            f"the daemon of {mnt} did not reload within {timeout:g} s; it serves as before"
        )
    if not st:
        raise NotMountedError(f"{mnt}: no longer a live colifs mount")
    return st


ASK_SLACK = 5.0  # s the client waits past the daemon's own deadline, for its answer
PROOF_POLL = 1.0  # s between looks at the progress of a proof


JUDGE_WITHIN = 10.0  # s to judge a directory to add here (it stats it, and the mount's replicas)


def _colifs_mount(mountpoint: str) -> str:
    """The resolved mount point of the colifs mount at `mountpoint` (its root is not stat-ed: its
    daemon may hang); NotMountedError when there is none."""
    mnt = resolved(mountpoint)
    entry = mount_at(mnt)
    if entry is None or entry.fstype != "fuse.colifs":
        raise NotMountedError(f"{mnt} is not a colifs mount")
    return mnt


def _steerable(mnt: str, timeout: float) -> tuple[dict, int, int]:
    """The mount's stats.json, its daemon's pid and uid, once the kernel and the daemon agree that
    the caller's user serves it (NotReloadedError otherwise: nothing is asked)."""
    owner = mount_at(mnt)
    me = os.geteuid()
    if owner is None or owner.user_id != me:  # the kernel's word: whose daemon serves it
        who = "nobody known" if owner is None or owner.user_id is None else _who(owner.user_id)
        raise NotReloadedError(
            f"{mnt}: its daemon runs as {who} and takes commands from that user only: run as it; "
            "nothing asked of it"
        )
    st = _stats_within(mnt, timeout)
    if not st:
        raise NotReloadedError(f"the daemon of {mnt} does not answer; nothing asked of it")
    try:
        pid, uid = int(st["pid"]), int(st["uid"])
    except (KeyError, TypeError, ValueError):
        raise NotReloadedError(f"the daemon of {mnt} takes no commands (older colifs: remount it)") from None
    if uid != me:  # a FUSE file system of another user posing as colifs
        raise NotReloadedError(
            f"{mnt} says its daemon runs as uid {uid}, but {_who(me)} mounted it; not asked"
        )
    return st, pid, uid


def mirror(
    mountpoint: str, command: str, path: str, timeout: float, weight: float | None = None, deep: bool = False
) -> dict:
    """`colifs mirror remove|add`: the mount's daemon does it and answers once it is done (for a
    removal: once no descriptor is left on the mirror); what it did. A directory to add is judged
    here first as the daemon judges it (colifs.checks.judge_mirror), and the daemon's proof of its
    copies (sampled, or every byte with `deep`) shows its progress on stderr."""
    mnt = _colifs_mount(mountpoint)
    st, pid, uid = _steerable(mnt, timeout)
    path = os.path.abspath(path)  # not resolved here: a mirror is removed when its drive hangs
    entry = mount_at(mnt)
    dev = entry.dev if entry is not None else 0
    real = _judge_here(path, mnt, dev, st) if command == "add" else path
    request = {"command": f"mirror-{command}", "path": path, "wait": timeout, "weight": weight, "deep": deep}
    shown = _ProofShown(mnt, real) if command == "add" else None
    try:
        return ask(pid, uid, request, timeout + ASK_SLACK, also=st.get("control_socket"))
    except NotAsked as e:
        raise NotReloadedError(f"{mnt}: {e}; nothing asked of it") from None
    except NoAnswer as e:
        done = {"remove": "removed", "add": "added"}[command]
        raise NotReloadedError(f"{mnt}: {e}; {path} may not be {done} (see colifs stats)") from None
    finally:
        if shown is not None:
            shown.stop()


def _judge_here(path: str, mnt: str, dev: int, st: dict) -> str:
    """The directory to add, judged as the daemon will (UsageError if it may not join): its
    resolved served directory. On a thread, within JUDGE_WITHIN: a path through a drive that does
    not answer must not hang the command."""
    states = {"removed": "removed", "down": "down"}
    known = [
        (r.get("path", ""), "primary" if i == 0 else states.get(r.get("health", {}).get("state"), "up"))
        for i, r in enumerate(st.get("replicas", []))
    ]
    got: list = []

    def judge() -> None:
        try:
            got.append(judge_mirror(path, mnt, dev, known, st.get("revision", "main"))[0])
        except Exception as e:  # raised on the caller's thread below
            got.append(e)

    t = threading.Thread(target=judge, daemon=True)
    t.start()
    t.join(JUDGE_WITHIN)
    if not got:
        raise NotReloadedError(
            f"{path}: not judged within {JUDGE_WITHIN:g} s (a drive that does not answer?); "
            "nothing asked of the daemon"
        )
    if isinstance(got[0], Exception):
        raise got[0]
    return got[0]


class _ProofShown:
    """While the daemon proves the copies of directory `root` (its stats.json `reload.proof`), their
    progress on stderr (colifs.progress: a line redrawn on a terminal, every 10 s otherwise)."""

    def __init__(self, mnt: str, root: str) -> None:
        self._mnt, self._root = mnt, root
        self._since = time.time() - 1.0
        self._done = threading.Event()
        self._progress: Progress | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(PROOF_POLL):
            st = _stats_within(self._mnt, PROOF_POLL)
            proof = ((st or {}).get("reload") or {}).get("proof") or {}
            if proof.get("path") != self._root or proof.get("started", 0) < self._since:
                continue
            if self._progress is None:
                label = f"proving {self._root} against the primary ({proof['mode']})"
                self._progress = Progress(proof["bytes"], label)
            self._progress.add(proof["bytes_done"] - self._progress.done)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(PROOF_POLL + 1.0)
        if self._progress is not None and (sys.stderr.isatty() or time.time() - self._since > 10):
            self._progress.finish()


def _who(uid: int) -> str:
    return "root" if uid == 0 else f"uid {uid}"


STATUS_WAIT = 5.0  # s for every daemon together to say what it serves


def mounts_using(mirror: str, wait: float = STATUS_WAIT) -> list[str]:
    """The live colifs mounts that serve the directory `mirror` as one of their mirrors (not one
    they removed: `colifs mirror add` brings it back). Each daemon is asked on its control socket,
    all at once, for `wait` seconds in all; no other mount is touched (a hung mirror's mount point
    is never stat-ed: its daemon answers the paths it resolved at mount, compared as strings). A
    mount that cannot be checked is said on stderr, one line each."""
    want = os.path.realpath(mirror)  # the caller's own directory
    mounts = colifs_mounts()
    if not mounts:
        return []
    answers, untrusted = ask_everyone({"command": "status"}, wait)
    for why in untrusted:
        _say(f"{why}: its sockets were not asked")
    me = os.geteuid()
    serving: dict[str, list[dict]] = {}
    for pid, answer in sorted(answers.items()):
        if isinstance(answer, dict):
            serving.setdefault(str(answer.get("mountpoint")), []).append(answer)
        else:
            _say(f"daemon {pid}: {answer}")
    out = []
    for mnt, entry in mounts:
        theirs = [a for a in serving.get(mnt, []) if a.get("uid") == entry.user_id]
        if theirs:
            if any(_serves(r, want) for a in theirs for r in a.get("replicas", [])[1:]):
                out.append(mnt)
        elif entry.user_id != me:
            who = "nobody known" if entry.user_id is None else _who(entry.user_id)
            _say(f"{mnt}: mounted by {who}; not checked (its daemon answers that user only)")
        else:
            _say(f"{mnt}: its daemon does not answer; not checked")
    return list(dict.fromkeys(out))


def _say(line: str) -> None:
    print(f"colifs: {line}", file=sys.stderr)


def _serves(replica: dict, mirror: str) -> bool:
    """A mount's replica (as its daemon resolved it at mount) is the directory `mirror`, in use
    (not removed)."""
    return not replica.get("removed") and replica.get("path") == mirror


def _stats_within(mnt: str, wait: float) -> dict | None:
    """The mount's stats.json ({} when it is not a colifs daemon that answers as one), or None
    after `wait` s: a hung daemon's read may never return, so it runs on a thread left behind."""
    got: list[dict] = []

    def read() -> None:
        try:
            got.append(read_stats(mnt))
        except (NotMountedError, ValueError):
            got.append({})  # stale, or not answering as a colifs daemon does

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(max(wait, 0.0))
    return got[0] if got else None


def route(path: str, offset: int) -> dict:
    """The tensor, key and drive of byte `offset` of a file on a mount, as the mount answers."""
    if not os.path.isfile(path):
        raise UsageError(f"{path} is not a file")
    try:
        raw = os.getxattr(path, ROUTE_XATTR.decode() + str(offset))
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise UsageError(f"offset {offset} is outside {path} ({os.path.getsize(path)} bytes)") from None
        raise NotMountedError(f"{path} is not a file on a colifs mount") from None
    return json.loads(raw)
