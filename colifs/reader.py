"""The read path: split a request by key, route each piece to a drive, read the pieces concurrently,
fall back to the primary when a mirror fails.

Invariant: the bytes returned are the primary's bytes. A mirror is used only for files whose header
matched at mount, and any error or short read on it is answered by re-reading from the primary.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from colifs.backing import BackingIO
from colifs.layout import HEADER, ExpertKey
from colifs.logs import WarnOnce
from colifs.replicas import Replica, ServedFile
from colifs.routing import pick
from colifs.stats import Stats
from colifs.workers import DriveWorkers

log = logging.getLogger("colifs")


@dataclass(slots=True)
class OpenFile:
    """Descriptors of one served file, shared by all its FUSE opens (refcounted)."""

    file: ServedFile
    fds: list[int | None]  # per replica; None = not used for this file
    weights: list[float]  # per replica; 0 where fds is None
    refs: int = 0


class Reader:
    """Owns the open descriptors, the per-drive workers and the routing of every read."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        workers: Sequence[DriveWorkers],
        io: BackingIO,
        stats: Stats,
    ) -> None:
        self.replicas = list(replicas)
        self.workers = list(workers)
        self.io = io
        self.stats = stats
        self._open: dict[str, OpenFile] = {}
        self._warn = WarnOnce()

    # -- descriptors -------------------------------------------------------------------------

    async def open(self, f: ServedFile) -> OpenFile:
        """Open the primary copy (errors propagate) and every valid mirror copy (errors warn)."""
        of = self._open.get(f.relpath)
        if of is None:
            fds: list[int | None] = [None] * len(self.replicas)
            fds[0] = await self.workers[0].run(self.io.open, self._path(0, f))
            for i in f.replicas[1:]:
                try:
                    fds[i] = await self.workers[i].run(self.io.open, self._path(i, f))
                except OSError as e:
                    self._mirror_trouble(f, i, f"cannot open ({e.strerror})")
            weights = [r.weight if fds[r.index] is not None else 0.0 for r in self.replicas]
            of = self._open.get(f.relpath)  # another task may have opened it meanwhile
            if of is None:
                of = self._open[f.relpath] = OpenFile(f, fds, weights)
            else:
                for fd in fds:
                    if fd is not None:
                        self.io.close(fd)
        of.refs += 1
        return of

    def release(self, of: OpenFile) -> None:
        of.refs -= 1
        if of.refs == 0:
            del self._open[of.file.relpath]
            for fd in of.fds:
                if fd is not None:
                    self.io.close(fd)

    def _path(self, drive: int, f: ServedFile) -> str:
        return os.path.join(self.replicas[drive].root, f.relpath)

    # -- reads -------------------------------------------------------------------------------

    def plan(self, of: OpenFile, off: int, end: int) -> list[tuple[int, int, int]]:
        """[off, end) as (start, end, drive) runs: pieces routed by key, same-drive neighbours merged."""
        f = of.file
        if f.layout is None or len(f.replicas) == 1:
            return [(off, end, 0)]
        runs: list[tuple[int, int, int]] = []
        layout, positions = f.layout, f.positions
        for start, stop, extent in layout.pieces(off, end):
            if extent == HEADER:
                drive = 0
            else:
                drive = pick(positions[extent], of.weights)
                key = layout.keys[extent]
                if isinstance(key, ExpertKey):
                    self.stats.routed(f"{key.stack}.{key.layer}", drive, stop - start)
            if runs and runs[-1][2] == drive:
                runs[-1] = (runs[-1][0], stop, drive)
            else:
                runs.append((start, stop, drive))
        return runs

    async def read(self, of: OpenFile, off: int, size: int) -> bytes | bytearray | memoryview:
        """The primary's bytes [off, off+size), short only at the end of the file."""
        end = min(off + size, of.file.size)
        if off >= end:
            return b""
        runs = self.plan(of, off, end)
        buf = bytearray(end - off)
        view = memoryview(buf)
        if len(runs) == 1:
            got = await self._read_run(of, runs[0][2], off, view)
            return buf if got == len(buf) else view[:got]
        counts = [0] * len(runs)
        failures: list[OSError] = []

        async def fill(i: int, start: int, stop: int, drive: int) -> None:
            try:
                counts[i] = await self._read_run(of, drive, start, view[start - off : stop - off])
            except OSError as e:
                failures.append(e)

        async with trio.open_nursery() as nursery:
            for i, (start, stop, drive) in enumerate(runs):
                nursery.start_soon(fill, i, start, stop, drive)
        if failures:
            raise failures[0]
        total = 0
        for (start, stop, _), got in zip(runs, counts, strict=True):
            total += got
            if got < stop - start:  # the primary ended early: the file shrank under us
                break
        return buf if total == len(buf) else view[:total]

    async def _read_run(self, of: OpenFile, drive: int, start: int, view: memoryview) -> int:
        if drive != 0:
            try:
                got = await self.workers[drive].run(self.io.pread_into, of.fds[drive], view, start)
            except OSError as e:
                problem = f"read error at {start}: {e.strerror or e}"
            else:
                if got == len(view):
                    self.stats.served(drive, got)
                    return got
                problem = f"short read at {start}: {got} of {len(view)} bytes"
            self.stats.failed(drive, problem)
            self.stats.fallbacks += 1
            self._mirror_trouble(of.file, drive, problem)
        fd = of.fds[0]
        assert fd is not None
        try:
            got = await self.workers[0].run(self.io.pread_into, fd, view, start)
        except OSError as e:
            self.stats.failed(0, f"read error at {start}: {e.strerror or e}")
            self._warn((of.file.relpath, 0), "%s: primary read error: %s", of.file.relpath, e)
            raise
        self.stats.served(0, got)
        return got

    def _mirror_trouble(self, f: ServedFile, drive: int, problem: str) -> None:
        self._warn(
            (f.relpath, drive),
            "%s: mirror %s: %s; reading from the primary instead",
            f.relpath,
            self.replicas[drive].root,
            problem,
        )
