"""The read path: split a request by key, route each piece to a drive, read the pieces concurrently,
fall back to the primary when a mirror fails.

Invariant: the bytes returned are the primary's bytes. A mirror is used only for files whose header
matched at mount, and any error or short read on it is answered by re-reading from the primary.
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import outcome
import trio

from colifs.backing import (
    BLOCK,
    BackingIO,
    Changed,
    TimedOut,
    align_down,
    align_up,
    check_read,
    check_unchanged,
    open_checked,
)
from colifs.catalogue import ServedFile
from colifs.formats.layout import ExpertKey
from colifs.health import Health
from colifs.logs import WarnOnce
from colifs.mirrors import MirrorPolicy, describe
from colifs.pyfuse3.buffers import BufferPool
from colifs.pyfuse3.workers import DriveWorkers, Waiting, gather
from colifs.readplan import Piece, Router, merge, pieces, usable_weights
from colifs.recorder import Tally
from colifs.replicas import Identity, Replica
from colifs.stats import Stats

OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)  # an open that fails so says nothing of the mirror

log = logging.getLogger("colifs")


RETIRED_FDS = 8  # replaced descriptors one open file keeps (as native/engine.h)
CHECK_POLL = 0.25  # s between looks at the down mirrors while a check runs


@dataclass(slots=True)
class OpenFile:
    """Descriptors of one served file, shared by all its FUSE opens (refcounted). Each descriptor
    belongs to the drive workers it was opened on (a drive gets new ones when its mirror is removed
    or replaced: Reader.renew), and so do the reads that use it: a descriptor retired waits for
    the reads of its own workers only, never for a read stuck in an older drive's."""

    file: ServedFile
    fds: list[int | None]  # per replica; None = not used for this file
    usable: set[int]  # the replicas it may be read from (opened, unchanged): the primary always
    detached: set[int]  # mirrors not opened yet because they were down
    epochs: list[int]  # per replica: the Reader's epoch when its descriptor was opened
    pools: list[DriveWorkers | None]  # per replica: the workers its descriptor was opened on
    # (workers, fd) replaced: closed once no read runs on those workers
    retired: list[tuple[DriveWorkers, int]] = field(default_factory=list)
    refs: int = 1
    # Per drive workers: reads running (or given up on and not returned) on their descriptors.
    mirror_reads: dict[DriveWorkers, int] = field(default_factory=dict)

    def hold(self) -> None:
        self.refs += 1

    def let_go(self) -> bool:
        """One open fewer; True when it was the last."""
        self.refs -= 1
        return self.refs == 0

    def reattach(self, down: set[int]) -> list[int]:
        """The detached mirrors that are up now: tried once each (no longer detached)."""
        ready = sorted(self.detached - down)
        self.detached.difference_update(ready)
        return ready

    def attach(self, drive: int, fd: int, epoch: int, pool: DriveWorkers) -> None:
        self.fds[drive] = fd
        self.epochs[drive] = epoch
        self.pools[drive] = pool
        self.usable.add(drive)

    def _retire(self, drive: int) -> None:
        fd, pool = self.fds[drive], self.pools[drive]
        if fd is not None and pool is not None:
            self.retired.append((pool, fd))
        self.fds[drive] = None

    def renew(self, epochs: Sequence[int]) -> None:
        """Mirror descriptors opened before their mirror last came back up may be dead (its
        filesystem mounted again): detached, to be opened again; the old ones close once no read
        runs on their mirror (a read given up on may still use one), at most RETIRED_FDS of them
        (past that the old one stays: a flapping mirror must not take every descriptor)."""
        for d in sorted(self.usable - {0}):
            fd = self.fds[d]
            if self.epochs[d] != epochs[d] and fd is not None and len(self.retired) < RETIRED_FDS:
                self._retire(d)
                self.usable.discard(d)
                self.detached.add(d)

    def swap(self, drive: int, again: bool) -> None:
        """A reload changed the mirror's copy: its descriptor retires (closed once no read runs on
        that mirror), and the copy is opened `again` at the next read, or not used."""
        self._retire(drive)
        self.usable.discard(drive)
        if again:
            self.detached.add(drive)
        else:
            self.detached.discard(drive)

    def grow(self) -> None:
        """One more replica (a mirror added while serving): not used by this file until a reload
        or the addition gives it a copy there (then `swap` queues it to be opened)."""
        self.fds.append(None)
        self.epochs.append(0)
        self.pools.append(None)

    def mirror_read_starts(self, drive: int) -> DriveWorkers:
        """A read of the mirror's descriptor: the workers it belongs to (mirror_read_ends)."""
        pool = self.pools[drive]
        assert pool is not None  # a mirror read runs only on a descriptor it opened
        self.hold()
        self.mirror_reads[pool] = self.mirror_reads.get(pool, 0) + 1
        return pool

    def mirror_read_ends(self, pool: DriveWorkers) -> list[tuple[DriveWorkers, int]]:
        """One mirror read fewer (release the hold apart): the retired descriptors to close now."""
        self.mirror_reads[pool] -= 1
        return self.unread_retired()

    def unread_retired(self) -> list[tuple[DriveWorkers, int]]:
        """The retired descriptors no read can use any more, taken: those of workers with no read
        running (per workers: another mirror's reads, or a read stuck in an older drive of the
        same mirror, must not keep them open)."""
        out = [(w, fd) for w, fd in self.retired if not self.mirror_reads.get(w)]
        self.retired = [(w, fd) for w, fd in self.retired if self.mirror_reads.get(w)]
        return out

    def stop_using(self, drive: int) -> None:
        """A mirror copy that changed: no more reads from it (its descriptor closes with the file)."""
        self.usable.discard(drive)


class Reader:
    """Owns the open descriptors, the per-drive workers and the routing of every read."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        workers: list[DriveWorkers],
        io: BackingIO,
        stats: Stats,
        health: Sequence[Health],
        router: Router,
        tally: Tally | None = None,
        files: Sequence[ServedFile] = (),
        pool: BufferPool | None = None,
    ) -> None:
        self.pool = pool or BufferPool()
        self.tally = tally  # counts what is served per key and file (None: not counted)
        # Per replica, for files the mirrors hold (a partial mirror gets more than its plain weight):
        # the router's list, changed in place by `set_weights`.
        self.weights = router.weights
        self.striping = router.striping
        self.health = health  # [0], the primary's, is never failed
        self._down: set[int] = set()
        self._epoch = [0] * len(replicas)  # +1 each time a mirror comes back up: reopen its copies
        self._went_down = trio.Event()
        self.replicas = replicas  # shared: a mirror added in a removed one's slot changes its root
        self.workers = workers  # shared with the engine, which closes them
        self.retired_workers: list[DriveWorkers] = []  # replaced by `renew`: ending once their calls return
        self.waiting = Waiting(len(replicas))  # each drive's time alone, for colifs.balance
        self.io = io
        self.stats = stats
        self._open: dict[str, OpenFile] = {}
        self._warn = WarnOnce()
        self.mirrors = MirrorPolicy(replicas, health, files, self._set_up)  # checks read `files`

    # -- descriptors -------------------------------------------------------------------------

    async def open(self, f: ServedFile) -> OpenFile:
        """Open the primary copy (errors propagate) and every usable mirror copy (errors warn)."""
        of = self._open.get(f.relpath)
        if of is None:
            fd = await self._open_primary(f)
            of = self._open.get(f.relpath)
            if of is None:
                n = len(self.replicas)
                fds: list[int | None] = [fd] + [None] * (n - 1)
                pools: list[DriveWorkers | None] = [self.workers[0]] + [None] * (n - 1)
                of = OpenFile(f, fds, {0}, set(f.copies[1:]), list(self._epoch), pools)
                self._open[f.relpath] = of
                await self._attach(of)
                return of
            self.workers[0].forget(self.io.close, fd)  # another task opened it meanwhile
        of.hold()
        return of

    async def _open_primary(self, f: ServedFile) -> int:
        """The primary's copy, if it is still the file mounted: its headers and run table are that
        file's, so a file replaced since (a rename, a rewrite) would mix its new bytes with the
        mirrors' old ones. EIO instead, said once per file."""
        path = self._path(0, f)
        if f.primary_identity is None:
            return await self.workers[0].run(self.io.open, path)
        try:
            return await self.workers[0].run(open_checked, self.io, path, f.primary_identity)
        except Changed as e:
            self.mirrors.primary_changed(f, str(e))
            raise OSError(errno.EIO, "the primary changed since mount", path) from None

    async def _attach(self, of: OpenFile) -> None:
        """Open the file's mirror copies, except on down mirrors: those wait until they are back.

        A copy that fails to open is not tried again for this open file (it warns once).
        """
        f = of.file
        for i in of.reattach(self._down):
            if i not in f.copies:
                continue
            epoch = self._epoch[i]  # before the open: a comeback while it runs renews it
            ident = f.identities[i]  # a reload while the open runs may validate another copy
            pool = self.workers[i]  # the descriptor is theirs, whoever serves the drive later
            try:
                late = functools.partial(self._close_late, pool)
                path = self._path(i, f)
                fd = await pool.run(open_checked, self.io, path, ident, on_late=late)
            except OSError as e:
                if e.errno in OUT_OF_DESCRIPTORS:
                    self.mirrors.out_of_descriptors(f, i)
                else:
                    self.mirrors.read_failed(f, i, f"cannot open ({describe(e)})", False)
            except TimedOut as e:
                self.mirrors.read_failed(f, i, f"cannot open ({describe(e)})", True)
            except Changed as e:
                self.mirrors.changed(f, i, str(e), e.expected)
            else:
                if f.identities.get(i) == ident and pool is self.workers[i]:
                    of.attach(i, fd, epoch, pool)
                else:  # a reload dropped or replaced the copy meanwhile (it queued it again, if valid)
                    pool.forget(self.io.close, fd)

    def renew(self, drive: int, fresh: DriveWorkers) -> DriveWorkers:
        """Drive `drive` gets workers of their own (its mirror removed, or another directory in its
        place): none of the old ones' calls, stuck in a hung drive maybe, holds up the new ones.
        The old ones retire (they end once their calls return) and are returned."""
        old = self.workers[drive]
        self.workers[drive] = fresh
        old.retire()
        self.retired_workers.append(old)
        return old

    def grow(self, workers: DriveWorkers) -> None:
        """One more mirror while serving (no file has a copy on it yet): its workers."""
        self.workers.append(workers)
        self.waiting.grow()
        self._epoch.append(0)
        for of in self._open.values():
            of.grow()

    def set_copy(self, f: ServedFile, drive: int, identity: Identity | None) -> bool:
        """A reload's verdict on a mirror copy (colifs.reload): an open file stops reading the old
        copy (its descriptor closes once no mirror read runs on the file: one may be using it) and
        opens the new one at its next read. Always taken at once (True)."""
        of = self._open.get(f.relpath)
        if of is not None:
            of.swap(drive, identity is not None)
            for pool, fd in of.unread_retired():
                pool.forget(self.io.close, fd)
        return True

    def open_files(self) -> int:
        """Files with descriptors open now (0 once every open was released)."""
        return len(self._open)

    def release(self, of: OpenFile) -> None:
        """One open fewer; at the last, every descriptor is closed on the workers it was opened on:
        a close can block (a FUSE or NFS mirror's flush), and every handler waits for this thread.
        The number stays taken until then."""
        if of.let_go():
            del self._open[of.file.relpath]
            held = [(pool, fd) for pool, fd in zip(of.pools, of.fds, strict=True) if fd is not None]
            for pool, fd in [*held, *of.retired]:
                assert pool is not None  # set with its descriptor
                pool.forget(self.io.close, fd)

    def _mirror_read_done(self, of: OpenFile, pool: DriveWorkers) -> None:
        """A mirror read returned (in time or late): the retired descriptors of its workers close
        once none runs there."""
        for owner, fd in of.mirror_read_ends(pool):
            owner.forget(self.io.close, fd)
        self.release(of)

    def _close_late(self, pool: DriveWorkers, result: outcome.Outcome) -> None:
        """A mirror open that answered after its timeout: nobody uses the descriptor."""
        if isinstance(result, outcome.Value):
            pool.forget(self.io.close, result.value)

    def _pread_checked(self, fd: int, view: memoryview, offset: int, expect: Identity) -> int:
        """A mirror read whose bytes count only if the file is unchanged after it (worker thread)."""
        n = self.io.pread_into(fd, view, offset)
        check_unchanged(self.io, fd, expect)
        return n

    def _path(self, drive: int, f: ServedFile) -> str:
        return os.path.join(self.replicas[drive].root, f.relpath)

    # -- reads -------------------------------------------------------------------------------

    def _pieces(self, of: OpenFile, off: int, end: int) -> list[Piece]:
        """[off, end) as pieces (colifs.readplan), with the file's weights and the down mirrors out."""
        weights = usable_weights(self.weights, of.usable - self._down)
        return pieces(of.file, weights, self.striping, off, end)

    def _count(self, f: ServedFile, plan: list[Piece], asked: int) -> None:
        """Count routed bytes per layer (files a mirror holds), and usage: only bytes from `asked` on
        (the caller's offset before rounding to BLOCK), once per extent."""
        mirrored = len(f.copies) > 1
        asked_of: dict[int, int] = {}  # extent -> bytes from `asked` on
        for start, stop, drive, extent in plan:
            if extent < 0:
                continue
            key = f.layout.keys[extent]  # type: ignore[union-attr]
            if stop > asked:
                asked_of[extent] = asked_of.get(extent, 0) + stop - max(start, asked)
            if mirrored and isinstance(key, ExpertKey):
                self.stats.routed(f"{key.stack}.{key.layer}", drive, stop - start)
        if self.tally is not None:
            for extent, nbytes in asked_of.items():
                self.tally.count(f.layout.keys[extent], nbytes)  # type: ignore[union-attr]

    async def read(self, of: OpenFile, off: int, size: int, direct: bool = False) -> bytes | memoryview:
        """The primary's bytes [off, off+size), short only at the end of the file.

        The range is rounded out to BLOCK (O_DIRECT), read into a pooled buffer, and returned as a
        view of it: no copy, no allocation. `direct`: an O_DIRECT opener asks, and waits for the
        answer (a page-cache reader's readahead may not): its reads count towards time alone.
        """
        end = min(off + size, of.file.size)
        if off >= end:
            return b""
        of.renew(self._epoch)
        if of.detached and not of.detached <= self._down:
            await self._attach(of)  # a mirror that was down when the file was opened is back
        if self.tally is not None:
            self.tally.count_file(of.file.relpath, end - off)
        start, stop = align_down(off), align_up(end)
        plan = self._pieces(of, start, end)
        self._count(of.file, plan, off)
        runs = snap(merge(plan), stop)
        buf = self.pool.take(stop - start)
        # Not back to the pool on an exception, or when a read given up on still writes into it.
        waited = direct and bool(of.usable - self._down - {0})
        valid, view = await self._read_runs(of, runs, memoryview(buf), off, end, waited)
        if view.obj is buf:
            self.pool.lend(buf)
        valid = min(end, valid)
        return view[off - start : valid - start] if valid > off else b""

    async def _fetch(
        self, of: OpenFile, runs: list[tuple[int, int, int]], view: memoryview, base: int, waited: bool
    ) -> list[outcome.Outcome]:
        """Read each run on its drive, concurrently; per run, the byte count or the error.

        Page-cache hits (buffered backing) are read inline without blocking; the rest is handed
        to the drives' workers all at once. A mirror read past its drive's timeout is given up
        on: its outcome is a TimedOut error.
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
        # Their drives now: the caller re-routes failed runs afterwards.
        outcomes = await self._gather(of, calls, [runs[i][2] for i in waiting], waited) if calls else []
        for i, result in zip(waiting, outcomes, strict=True):
            if result is None:
                timeout = self.workers[runs[i][2]].timeout
                results[i] = outcome.Error(TimedOut(f"no answer within {timeout:g} s"))
            elif isinstance(result, outcome.Value):
                results[i] = outcome.Value(got[i] + result.value)
            else:
                results[i] = result
        return results

    async def _gather(
        self, of: OpenFile, calls: list, drives: list[int], waited: bool
    ) -> list[outcome.Outcome | None]:
        """`gather` the calls (on `drives`). Each mirror read holds the file open until it returns,
        even given up on: a descriptor closed under it could have its number reused by another
        open before its pread; and its mirror's retired descriptors stay open until then.
        `waited`: each read is pending on its drive (time alone) until it settles."""
        # the workers whose descriptor each mirror read uses
        pools = {k: of.mirror_read_starts(d) for k, d in enumerate(drives) if d != 0}

        def late(k: int, _result: outcome.Outcome) -> None:  # only mirror reads are ever late
            self._mirror_read_done(of, pools[k])

        def settled(k: int) -> None:
            self.waiting.change(drives[k], -1)

        if waited:
            for d in drives:
                self.waiting.change(d, 1)
        outcomes = await gather(calls, late, settled if waited else None)
        for k, pool in pools.items():
            if outcomes[k] is not None:  # in time (a late one lets go when it returns)
                self._mirror_read_done(of, pool)
        return outcomes

    async def _read_runs(
        self,
        of: OpenFile,
        runs: list[tuple[int, int, int]],
        view: memoryview,
        off: int,
        end: int,
        waited: bool,
    ) -> tuple[int, memoryview]:
        """Read the runs, re-read failed mirror runs from the primary, count what each drive served.

        Returns the file offset up to which the returned view (`view`, or a fresh buffer when a
        mirror read was given up on) holds valid bytes.
        """
        base = runs[0][0]
        results = await self._fetch(of, runs, view, base, waited)
        if any(isinstance(r, outcome.Error) and isinstance(r.error, TimedOut) for r in results):
            view = _salvage(runs, results, view, base)
        redo = [
            i
            for i, (run, result) in enumerate(zip(runs, results, strict=True))
            if run[2] != 0 and not self._mirror_delivered(of, run, result, off, end)
        ]
        if redo:
            again = await self._fetch(of, [(runs[i][0], runs[i][1], 0) for i in redo], view, base, waited)
            for i, result in zip(redo, again, strict=True):
                results[i] = result
                runs[i] = (runs[i][0], runs[i][1], 0)
        valid = base
        for (s, e, d), result in zip(runs, results, strict=True):
            if isinstance(result, outcome.Error):  # only the primary's errors are left
                self.stats.failed(0, f"read error at {s}: {describe(result.error)}")
                self._warn((of.file.relpath, 0), "%s: primary read error: %s", of.file.relpath, result.error)
                raise result.error
            if d == 0:
                self.stats.served(0, _overlap(s, s + result.value, off, end))
            valid += result.value
            if result.value < e - s:  # end of file (or the file shrank under us)
                break
        return valid, view

    def _mirror_delivered(
        self, of: OpenFile, run: tuple[int, int, int], result: outcome.Outcome, off: int, end: int
    ) -> bool:
        """Whether a mirror run's read counts; if not, why is recorded (health, stats, one warning)
        and the caller re-reads it from the primary."""
        s, e, d = run
        size = of.file.size
        if isinstance(result, outcome.Error) and isinstance(result.error, Changed):
            self.stats.failed(d, f"changed since mount: {result.error}")
            self.stats.fell_back()
            if self.mirrors.changed(of.file, d, str(result.error), result.error.expected):
                of.stop_using(d)
            return False
        timed_out = False
        if isinstance(result, outcome.Error):
            timed_out = isinstance(result.error, TimedOut)
            what = "timeout" if timed_out else "read error"
            problem = f"{what} at {s}: {describe(result.error)}"
        elif result.value < min(e, size) - s:
            problem = f"short read at {s}: {result.value} of {min(e, size) - s} bytes"
        else:
            self.stats.served(d, _overlap(s, e, off, end))
            self.health[d].succeeded()
            return True
        self.stats.failed(d, problem)
        self.stats.fell_back()
        self.mirrors.read_failed(of.file, d, problem, timed_out)
        return False

    def set_weights(self, weights: list[float]) -> None:
        """New weights in force (colifs.balance): every request plans with them from now on."""
        self.weights[:] = weights

    # -- mirror health (colifs.mirrors decides) --------------------------------------------------

    def _set_up(self, drive: int, up: bool) -> None:
        if up:
            if drive in self._down:
                self._epoch[drive] += 1
            self._down.discard(drive)
        else:
            self._down.add(drive)
            self._went_down.set()

    async def watch(self) -> None:
        """Runs for the life of the mount: checks each down mirror once its back-off is over."""
        async with trio.open_nursery() as checks:
            while True:
                self.mirrors.start_checks(checks, self._check_read)
                idle = [d for d in self._down if d not in self.mirrors.checking]
                wait = min((self.health[d].wait() for d in idle), default=math.inf)
                if self.mirrors.checking:
                    wait = min(wait, CHECK_POLL)  # a check that fails sets the next back-off
                with trio.move_on_after(wait):
                    await self._went_down.wait()
                if self._went_down.is_set():
                    self._went_down = trio.Event()

    async def _check_read(self, drive: int, f: ServedFile | None, offset: int) -> None:
        if f is None:  # no file left on it to read: its directory must still be there
            await self.workers[drive].run(os.stat, self.replicas[drive].root)
        else:
            path = self._path(drive, f)
            await self.workers[drive].run(check_read, self.io, path, f.identities[drive], offset)


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


def _salvage(
    runs: list[tuple[int, int, int]], results: list[outcome.Outcome], view: memoryview, base: int
) -> memoryview:
    """A fresh buffer holding the finished runs' bytes: reads given up on still write into `view`.

    Only the runs that finished are copied; the others are re-read from the primary into it.
    """
    fresh = memoryview(mmap.mmap(-1, len(view)))
    for (s, _, _), r in zip(runs, results, strict=True):
        if isinstance(r, outcome.Value):
            fresh[s - base : s - base + r.value] = view[s - base : s - base + r.value]
    return fresh


def _overlap(s: int, e: int, off: int, end: int) -> int:
    """Bytes of [s, e) inside the caller's range [off, end): what the drive delivered to the mount."""
    return max(0, min(e, end) - max(s, off))
