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

import outcome

from colifs.backing import BackingIO
from colifs.buffers import BLOCK, BufferPool, align_down, align_up
from colifs.layout import HEADER, ExpertKey
from colifs.logs import WarnOnce
from colifs.replicas import Identity, Replica, ServedFile
from colifs.routing import CHUNK, pick, stripe_sequence
from colifs.stats import Stats
from colifs.workers import DriveWorkers, gather

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
        pool: BufferPool | None = None,
        routing: str = "stripe",
    ) -> None:
        self.pool = pool or BufferPool()
        self.striping = routing == "stripe"
        self._sequences: dict[tuple[float, ...], tuple[int, ...]] = {}
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
                    fd = await self.workers[i].run(self._open_checked, self._path(i, f), f.identities[i])
                except OSError as e:
                    self._mirror_trouble(f, i, f"cannot open ({e.strerror})")
                except Changed as e:
                    self._mirror_changed(f, i, str(e))
                else:
                    fds[i] = fd
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

    def _open_checked(self, path: str, expect: Identity) -> int:
        """Open a mirror copy, if it is still the one validated at mount (on a worker thread)."""
        fd = self.io.open(path)
        now = self.io.identity(fd)
        if now != expect:
            self.io.close(fd)
            raise Changed(_what_changed(expect, now))
        return fd

    def _pread_checked(self, fd: int, view: memoryview, offset: int, expect: Identity) -> int:
        """A mirror read whose bytes count only if the file is unchanged after it (worker thread)."""
        n = self.io.pread_into(fd, view, offset)
        now = self.io.identity(fd)
        if now != expect:
            raise Changed(_what_changed(expect, now))
        return n

    def _path(self, drive: int, f: ServedFile) -> str:
        return os.path.join(self.replicas[drive].root, f.relpath)

    # -- reads -------------------------------------------------------------------------------

    def plan(self, of: OpenFile, off: int, end: int) -> list[tuple[int, int, int]]:
        """[off, end) as (start, end, drive) runs: pieces routed by key, same-drive neighbours merged.

        Expert routing: a key's bytes all go to one drive. Stripe routing: a key of two chunks or
        more is cut at absolute CHUNK boundaries, chunk c going to seq[(c + rotation) % len(seq)].
        """
        f = of.file
        if f.layout is None or len(f.replicas) == 1:
            return [(off, end, 0)]
        runs: list[tuple[int, int, int]] = []

        def add(start: int, stop: int, drive: int, layer: str | None) -> None:
            if layer is not None:
                self.stats.routed(layer, drive, stop - start)
            if runs and runs[-1][2] == drive:
                runs[-1] = (runs[-1][0], stop, drive)
            else:
                runs.append((start, stop, drive))

        layout = f.layout
        for start, stop, extent in layout.pieces(off, end):
            if extent == HEADER:
                add(start, stop, 0, None)
                continue
            key = layout.keys[extent]
            layer = f"{key.stack}.{key.layer}" if isinstance(key, ExpertKey) else None
            rotation = f.stripes[extent] if self.striping else -1
            if rotation < 0:
                add(start, stop, pick(f.positions[extent], of.weights), layer)
                continue
            seq = self._sequence(of)
            while start < stop:
                chunk = start // CHUNK
                piece_end = min(stop, (chunk + 1) * CHUNK)
                add(start, piece_end, seq[(chunk + rotation) % len(seq)], layer)
                start = piece_end
        return runs

    def _sequence(self, of: OpenFile) -> tuple[int, ...]:
        key = tuple(of.weights)
        seq = self._sequences.get(key)
        if seq is None:
            seq = self._sequences[key] = stripe_sequence(of.weights)
        return seq

    async def read(self, of: OpenFile, off: int, size: int) -> bytes | memoryview:
        """The primary's bytes [off, off+size), short only at the end of the file.

        The range is rounded out to BLOCK (O_DIRECT), read into a pooled buffer, and returned as a
        view of it: no copy, no allocation.
        """
        end = min(off + size, of.file.size)
        if off >= end:
            return b""
        start, stop = align_down(off), align_up(end)
        runs = snap(self.plan(of, start, end), stop)
        buf = self.pool.take(stop - start)
        try:
            view = memoryview(buf)
            valid = min(end, await self._read_runs(of, runs, view, off, end))
        finally:
            self.pool.lend(buf)
        return view[off - start : valid - start] if valid > off else b""

    async def _fetch(
        self, of: OpenFile, runs: list[tuple[int, int, int]], view: memoryview, base: int
    ) -> list[outcome.Outcome]:
        """Read each run on its drive, concurrently; per run, the byte count or the error.

        Page-cache hits (buffered backing) are read inline without blocking; the rest is handed
        to the drives' workers all at once.
        """
        size = of.file.size
        got = [0] * len(runs)
        calls, waiting = [], []
        for i, (s, e, d) in enumerate(runs):
            fd = of.fds[d]
            if d != 0:  # mirrors: always on a worker, checked for changes after the read
                rest = (fd, view[s - base : e - base], s, of.file.identities[d])
                calls.append((self.workers[d], self._pread_checked, rest))
                waiting.append(i)
                continue
            got[i] = self.io.pread_nowait(fd, view[s - base : e - base], s)
            if got[i] < min(e, size) - s:
                rest = (fd, view[s + got[i] - base : e - base], s + got[i])
                calls.append((self.workers[d], self.io.pread_into, rest))
                waiting.append(i)
        results: list[outcome.Outcome] = [outcome.Value(n) for n in got]
        for i, result in zip(waiting, await gather(calls) if calls else [], strict=True):
            results[i] = outcome.Value(got[i] + result.value) if isinstance(result, outcome.Value) else result
        return results

    async def _read_runs(
        self, of: OpenFile, runs: list[tuple[int, int, int]], view: memoryview, off: int, end: int
    ) -> int:
        """Read the runs, re-read failed mirror runs from the primary, count what each drive served.

        Returns the file offset up to which `view` holds valid bytes.
        """
        base = runs[0][0]
        size = of.file.size
        results = await self._fetch(of, runs, view, base)
        redo = []
        for i, ((s, e, d), result) in enumerate(zip(runs, results, strict=True)):
            if d == 0:
                continue
            if isinstance(result, outcome.Error) and isinstance(result.error, Changed):
                self.stats.failed(d, f"changed since mount: {result.error}")
                self.stats.fallbacks += 1
                self._mirror_changed(of.file, d, str(result.error))
                of.weights[d] = 0.0
                redo.append(i)
                continue
            if isinstance(result, outcome.Error):
                problem = f"read error at {s}: {_describe(result.error)}"
            elif result.value < min(e, size) - s:
                problem = f"short read at {s}: {result.value} of {min(e, size) - s} bytes"
            else:
                self.stats.served(d, _overlap(s, e, off, end))
                continue
            self.stats.failed(d, problem)
            self.stats.fallbacks += 1
            self._mirror_trouble(of.file, d, problem)
            redo.append(i)
        if redo:
            again = await self._fetch(of, [(runs[i][0], runs[i][1], 0) for i in redo], view, base)
            for i, result in zip(redo, again, strict=True):
                results[i] = result
                runs[i] = (runs[i][0], runs[i][1], 0)
        valid = base
        for (s, e, d), result in zip(runs, results, strict=True):
            if isinstance(result, outcome.Error):  # only the primary's errors are left
                self.stats.failed(0, f"read error at {s}: {_describe(result.error)}")
                self._warn((of.file.relpath, 0), "%s: primary read error: %s", of.file.relpath, result.error)
                raise result.error
            if d == 0:
                self.stats.served(0, _overlap(s, s + result.value, off, end))
            valid += result.value
            if result.value < e - s:  # end of file (or the file shrank under us)
                break
        return valid

    def _mirror_changed(self, f: ServedFile, drive: int, what: str) -> None:
        """A mirror copy changed after mount: never used again for this file."""
        if drive in f.replicas:
            f.drop(drive, f"mirror {self.replicas[drive].root}: changed since mount ({what})")
            log.warning(
                "%s: mirror %s: changed since mount (%s); no longer used for this file",
                f.relpath,
                self.replicas[drive].root,
                what,
            )

    def _mirror_trouble(self, f: ServedFile, drive: int, problem: str) -> None:
        self._warn(
            (f.relpath, drive),
            "%s: mirror %s: %s; reading from the primary instead",
            f.relpath,
            self.replicas[drive].root,
            problem,
        )


def snap(runs: list[tuple[int, int, int]], stop: int) -> list[tuple[int, int, int]]:
    """Move run boundaries to the nearest BLOCK multiple and the last end to `stop`.

    Every copy used holds the same bytes, so this only shifts < BLOCK bytes between drives, and
    lets each run be read with O_DIRECT straight into its place in one aligned buffer.
    """
    bounds = [runs[0][0]] + [align_down(s + BLOCK // 2) for s, _, _ in runs[1:]] + [stop]
    out: list[tuple[int, int, int]] = []
    for (_, _, d), s, e in zip(runs, bounds, bounds[1:], strict=False):
        if s >= e:
            continue
        if out and out[-1][2] == d:
            out[-1] = (out[-1][0], e, d)
        else:
            out.append((s, e, d))
    return out


def _overlap(s: int, e: int, off: int, end: int) -> int:
    """Bytes of [s, e) inside the caller's range [off, end): what the drive delivered to the mount."""
    return max(0, min(e, end) - max(s, off))


def _describe(error: BaseException) -> str:
    return (error.strerror if isinstance(error, OSError) else None) or repr(error)


class Changed(Exception):
    """A mirror copy is no longer the file validated at mount."""


def _what_changed(before: Identity, now: Identity) -> str:
    names = ("device", "inode", "size", "mtime")
    return ", ".join(f"{n} {a} -> {b}" for n, a, b in zip(names, before, now, strict=True) if a != b)
