"""Per-drive worker threads: blocking reads run here, never on the trio thread.

pyfuse3 runs every handler on one thread, so a blocking pread there would stall the whole mount.
`trio.to_thread.run_sync` costs ~90–150 µs per call here; long-lived threads fed through a
SimpleQueue and answering with one `run_sync_soon` are cheaper, and the thread count is the
per-drive capacity limit (the number of reads in flight on that drive). `gather` hands several
calls (on several drives) over at once and wakes the caller once, when the last one is done.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import outcome
import trio

from colifs.backing import TimedOut

Call = tuple["DriveWorkers", Callable[..., Any], tuple[Any, ...]]
_Job = tuple[Callable[..., Any], tuple[Any, ...], Callable[[outcome.Outcome], None]]


class DriveWorkers:
    """`threads` long-lived threads serving one drive's queue.

    `timeout`: seconds after which `gather` gives up waiting for a call (a mirror; the caller
    then reads the primary); None waits for ever (the primary: there is nowhere else to go).
    """

    def __init__(self, name: str, threads: int, timeout: float | None = None) -> None:
        self.name = name
        self.timeout = timeout
        self.retired = False  # another set of workers serves the drive now (Reader.renew)
        self.busy = 0  # jobs queued or running: reads in flight on this drive
        self._running = 0  # jobs running now, and since when (under _lock): the drive's busy time
        self._since = 0.0
        self._busy_s = 0.0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            fn, args, deliver = job
            self._active(1)
            result = outcome.capture(fn, *args)
            self._active(-1)
            deliver(result)

    def _active(self, delta: int) -> None:
        with self._lock:
            now = time.monotonic()
            if delta > 0 and self._running == 0:
                self._since = now
            self._running += delta
            if delta < 0 and self._running == 0:
                self._busy_s += now - self._since

    @property
    def in_calls(self) -> int:
        """Calls running on these threads now: a call stuck in a hung drive counts until it returns."""
        with self._lock:
            return self._running

    @property
    def busy_seconds(self) -> float:
        """Seconds with at least one job running, since start (what colifs.balance divides by)."""
        with self._lock:
            running = time.monotonic() - self._since if self._running else 0.0
            return self._busy_s + running

    def submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...], deliver: Callable[[outcome.Outcome], None]
    ) -> None:
        """Queue fn(*args); `deliver(outcome)` is called on the worker thread when it is done."""
        self.busy += 1
        self._queue.put((fn, args, deliver))

    def forget(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue fn(*args) with nobody waiting for it: a close, which can block (a FUSE or NFS
        mirror's flush) and must not stall the trio thread, on which every handler runs. Retired
        workers' threads are ending: there it runs on a thread of its own, still counted."""
        if self.retired:
            threading.Thread(
                target=self._run_alone, args=(fn, args), name=f"{self.name}-late", daemon=True
            ).start()
        else:
            self._queue.put((fn, args, _nobody))

    def _run_alone(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._active(1)
        outcome.capture(fn, *args)
        self._active(-1)

    def retire(self) -> None:
        """No more work comes (the drive has new workers): each thread ends once what was queued
        before is done, a call stuck in a hung drive included. Never blocks."""
        self.retired = True
        for _ in self._threads:
            self._queue.put(None)

    def finished(self) -> None:
        """A submitted job's outcome was taken (on the trio thread): one fewer in flight."""
        self.busy -= 1

    async def run(
        self, fn: Callable[..., Any], *args: Any, on_late: Callable[[outcome.Outcome], None] | None = None
    ) -> Any:
        """Run fn(*args) on one of this drive's threads and return (or raise) its result.

        Raises TimedOut after the drive's timeout; `on_late` then gets the outcome when it comes.
        """
        (result,) = await gather([(self, fn, args)], None if on_late is None else lambda _, o: on_late(o))
        if result is None:
            raise TimedOut(f"no answer from {self.name} within {self.timeout:g} s")
        return result.unwrap()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads once the queued jobs are done, waiting `timeout` s at most in all.

        A thread stuck in a read on a hung drive must not hang the unmount: the threads are
        daemon threads, so the process still exits.
        """
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


class Waiting:
    """Each drive's time alone (colifs.balance): seconds in which it alone had reads that an
    O_DIRECT reader waits for, the other drives none. Counted on the trio thread only: a read
    counts from its hand-out until its outcome is taken or its reader gives up on it (`gather`)."""

    def __init__(self, drives: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.pending = [0] * drives
        self._alone = [0.0] * drives
        self._clock = clock
        self._since = clock()

    def change(self, drive: int, delta: int) -> None:
        self._add(self._clock())
        self.pending[drive] += delta

    def _add(self, now: float) -> None:
        busy = [d for d, n in enumerate(self.pending) if n]
        if len(busy) == 1:
            self._alone[busy[0]] += now - self._since
        self._since = now

    def grow(self) -> None:
        """One more drive (a mirror added while serving)."""
        self.pending.append(0)
        self._alone.append(0.0)

    def seconds(self) -> list[float]:
        """Per drive, seconds alone since start, up to now."""
        self._add(self._clock())
        return list(self._alone)


def _nobody(_: outcome.Outcome) -> None:
    """Where the outcome of a forgotten call goes."""


async def gather(
    calls: Sequence[Call],
    on_late: Callable[[int, outcome.Outcome], None] | None = None,
    settled: Callable[[int], None] | None = None,
) -> list[outcome.Outcome | None]:
    """Run every call on its drive's threads, concurrently; their outcomes, in order.

    Calls on drives with a `timeout` are given up once it has passed: their outcome is None, and
    `on_late(i, outcome)` gets it when it comes (e.g. to close an fd opened too late). Calls on
    drives without one (the primary) are always waited for. A thread cannot be interrupted: a
    given-up call keeps writing into its arguments, so the caller must not reuse them.
    `settled(i)`, on the trio thread, once call i holds the caller up no longer: its outcome is
    taken, or it is given up on.
    """
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    results: list[outcome.Outcome | None] = [None] * len(calls)
    left = len(calls)
    patient = sum(1 for w, _, _ in calls if w.timeout is None)  # left that cannot be given up
    timeouts = [w.timeout for w, _, _ in calls if w.timeout is not None]
    deadline = trio.current_time() + min(timeouts) if timeouts else math.inf
    waiting = True
    cancelled = False  # the deadline or a shutdown came while patient calls ran: only those are waited for

    def done(i: int, workers: DriveWorkers, result: outcome.Outcome) -> None:  # on the trio thread
        nonlocal left, patient, waiting
        workers.finished()
        if not waiting:  # given up on: the caller has moved on
            if on_late is not None:
                on_late(i, result)
            return
        results[i] = result
        if settled is not None:
            settled(i)
        left -= 1
        patient -= workers.timeout is None
        if waiting and (left == 0 or (patient == 0 and cancelled)):
            waiting = False
            trio.lowlevel.reschedule(task)

    def abort(_: object) -> trio.lowlevel.Abort:
        # The deadline, or a cancellation (shutdown), ends the wait once nothing patient is left:
        # the primary's reads are waited for (there is nowhere else to read from), a mirror's are
        # given up on (trio asks only once: a cancellation before the deadline must not leave the
        # wait to a hung mirror's read).
        nonlocal waiting, cancelled
        if patient > 0:
            cancelled = True
            return trio.lowlevel.Abort.FAILED
        waiting = False
        return trio.lowlevel.Abort.SUCCEEDED

    for i, (workers, fn, args) in enumerate(calls):

        def deliver(result: outcome.Outcome, i: int = i, workers: DriveWorkers = workers) -> None:
            # RunFinishedError: the loop is gone (shutdown), nobody waits for this result any more.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done, i, workers, result)

        workers.submit(fn, args, deliver)
    try:
        if deadline == math.inf:
            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            with trio.move_on_at(deadline):
                await trio.lowlevel.wait_task_rescheduled(abort)
    finally:
        waiting = False  # also when cancelled: what comes now is late
        if settled is not None:
            for i in (i for i, r in enumerate(results) if r is None):
                settled(i)  # given up on
    return results
