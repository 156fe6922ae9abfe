"""Per-drive worker threads: blocking reads run here, never on the trio thread.

pyfuse3 runs every handler on one thread, so a blocking pread there would stall the whole mount.
`trio.to_thread.run_sync` costs ~90–150 µs per call here; long-lived threads fed through a
SimpleQueue and answering with one `run_sync_soon` are cheaper, and the thread count is the
per-drive capacity limit (the number of reads in flight on that drive). `gather` hands several
calls (on several drives) over at once and wakes the caller once, when the last one is done.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import outcome
import trio

Call = tuple["DriveWorkers", Callable[..., Any], tuple[Any, ...]]
_Job = tuple[Callable[..., Any], tuple[Any, ...], Callable[[outcome.Outcome], None]]


def _abort_failed(_: object) -> trio.lowlevel.Abort:
    # A read already handed to a thread cannot be taken back: cancellation waits for its result.
    return trio.lowlevel.Abort.FAILED


class DriveWorkers:
    """`threads` long-lived threads serving one drive's queue."""

    def __init__(self, name: str, threads: int) -> None:
        self.name = name
        self.busy = 0  # jobs queued or running: reads in flight on this drive
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            fn, args, deliver = job
            deliver(outcome.capture(fn, *args))

    def submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...], deliver: Callable[[outcome.Outcome], None]
    ) -> None:
        """Queue fn(*args); `deliver(outcome)` is called on the worker thread when it is done."""
        self.busy += 1
        self._queue.put((fn, args, deliver))

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on one of this drive's threads and return (or raise) its result."""
        (result,) = await gather([(self, fn, args)])
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


async def gather(calls: Sequence[Call]) -> list[outcome.Outcome]:
    """Run every call on its drive's threads, concurrently; their outcomes, in order."""
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    results: list[outcome.Outcome] = [outcome.Value(None)] * len(calls)
    left = len(calls)

    def done(i: int, workers: DriveWorkers, result: outcome.Outcome) -> None:  # on the trio thread
        nonlocal left
        results[i] = result
        workers.busy -= 1
        left -= 1
        if left == 0:
            trio.lowlevel.reschedule(task)

    for i, (workers, fn, args) in enumerate(calls):

        def deliver(result: outcome.Outcome, i: int = i, workers: DriveWorkers = workers) -> None:
            # RunFinishedError: the loop is gone (shutdown), nobody waits for this result any more.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done, i, workers, result)

        workers.submit(fn, args, deliver)
    await trio.lowlevel.wait_task_rescheduled(_abort_failed)
    return results
