"""Proof, by the daemon itself, that a mirror copy holds the primary's bytes before it serves.

At mount a copy serves when its size and header match the primary's. A copy that joins while the
mount serves (`colifs mirror add`, a reload finding a copy staged, repaired or replaced) must
show more: size and header are public, and whoever can write a directory (or ask a daemon to add
one) could otherwise have the mount serve any bytes for every expert. So before such a copy
serves, the daemon reads ranges of it and of the primary through the same reads it serves with
(O_DIRECT where the drive allows) and compares them byte for byte:

- sampled (always): SAMPLES ranges of SAMPLE bytes per file, at offsets drawn from the system's
  random source when the proof runs (nobody can know them in advance), and the file's last range;
- deep (`colifs mirror add --deep`): every byte.

Nothing the client sends can make it weaker: a client may only ask for the deep one. A copy is
proven only if both files are still the ones judged (identity) after their bytes were read. A
proof can be stopped (`stop`): a timeout, an unmount or SIGTERM ends it at its next range.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from colifs.backing import BackingIO, align_down, align_up
from colifs.replicas import Identity

SAMPLE = 1 << 20  # bytes per sampled range
SAMPLES = 8  # random ranges per file, besides its last one
CHUNK = 4 << 20  # bytes a deep proof reads of each copy at a time
_random = random.SystemRandom()


class Stopped(Exception):
    """The proof was stopped before its end (a timeout, an unmount)."""


@dataclass(frozen=True)
class Claim:
    """A copy to prove: the primary's file as mounted (st_ino, st_size, st_mtime_ns) and the
    mirror's copy as judged (its identity)."""

    relpath: str
    primary: str
    mirror: str
    mounted: tuple[int, int, int]
    identity: Identity

    @property
    def size(self) -> int:
        return self.mounted[1]


@dataclass
class Proving:
    """What stats.json shows of a proof, while it runs and once it ended."""

    path: str
    mode: str  # "sampled" or "deep"
    files: int
    bytes: int
    files_done: int = 0
    bytes_done: int = 0
    started: float = field(default_factory=time.time)
    ended: float | None = None
    refused: dict[str, str] = field(default_factory=dict)  # the mirror copy's path -> why
    outcome: str = "running"  # running, proven, stopped (why)

    def planned(self, nbytes: int) -> None:
        self.bytes = nbytes

    def compared(self, nbytes: int) -> None:
        self.bytes_done += nbytes

    def judged(self, mirror: str, problem: str | None) -> None:
        """One copy done: proven (None) or not, and why."""
        if problem is not None:
            self.refused[mirror] = problem
        self.files_done += 1

    def end(self, outcome: str) -> None:
        self.outcome = outcome
        self.ended = time.time()

    def as_dict(self) -> dict:
        return {
            "path": self.path, "mode": self.mode, "files": self.files, "bytes": self.bytes,
            "files_done": self.files_done, "bytes_done": self.bytes_done,
            "started": round(self.started, 1), "ended": None if self.ended is None else round(self.ended, 1),
            "refused": dict(list(self.refused.items())[:20]), "refused_count": len(self.refused),
            "outcome": self.outcome,
        }  # fmt: skip


def ranges(size: int, deep: bool) -> list[tuple[int, int]]:
    """The (offset, length) ranges compared, block-aligned: every byte in CHUNK pieces (deep), or
    SAMPLES ranges of SAMPLE bytes at random plus the last one (all of a file smaller than that)."""
    if deep or size <= (SAMPLES + 1) * SAMPLE:
        return [(off, min(CHUNK, align_up(size) - off)) for off in range(0, align_up(size), CHUNK)]
    last = align_down(size - SAMPLE)
    picks = {align_down(_random.randrange(0, size - SAMPLE)) for _ in range(SAMPLES)} - {last}
    return [(off, SAMPLE) for off in sorted(picks)] + [(last, align_up(size) - last)]


def prove(io: BackingIO, claims: Sequence[Claim], deep: bool, stop: threading.Event, shown: Proving) -> None:
    """Compare each claim's copy with the primary; what differs goes to `shown.refused`. Blocks
    (call it off the loop); Stopped once `stop` is set."""
    plans = [ranges(c.size, deep) for c in claims]
    shown.planned(sum(n for plan in plans for _, n in plan))
    buffers = [mmap.mmap(-1, max(CHUNK, SAMPLE)) for _ in range(2)]
    try:
        for c, plan in zip(claims, plans, strict=True):
            shown.judged(c.mirror, _prove_one(io, c, plan, stop, shown, buffers))
    finally:
        for b in buffers:
            b.close()


def _prove_one(
    io: BackingIO, c: Claim, plan: list[tuple[int, int]], stop: threading.Event, shown: Proving,
    buffers: list[mmap.mmap],
) -> str | None:  # fmt: skip
    """Why the copy is not proven, None when it is."""
    fds: list[int] = []
    try:
        for path in (c.primary, c.mirror):
            fds.append(io.open(path))
        for off, n in plan:
            if stop.is_set():
                raise Stopped
            got = [io.pread_into(fd, memoryview(b)[:n], off) for fd, b in zip(fds, buffers, strict=True)]
            if got[0] != got[1] or buffers[0][: got[0]] != buffers[1][: got[1]]:
                return f"data differs from the primary's in bytes {off}-{off + n}"
            shown.compared(n)
        st = os.fstat(fds[0])
        if (st.st_ino, st.st_size, st.st_mtime_ns) != c.mounted:
            return "the primary's file is not the one mounted"
        if io.identity(fds[1]) != c.identity:
            return "changed while it was compared"
    except OSError as e:
        return f"cannot read ({e.strerror})"
    finally:
        for fd in fds:
            io.close(fd)
    return None
