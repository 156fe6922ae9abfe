"""Per-drive worker threads: blocking reads run here, never on the trio thread.

pyfuse3 runs every handler on one thread, so a blocking pread there would stall the whole mount.
`trio.to_thread.run_sync` costs ~90–150 µs per call here; long-lived threads fed through a
SimpleQueue and answering with one `run_sync_soon` are cheaper, and the thread count is the
per-drive capacity limit (the number of reads in flight on that drive).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")
_Job = tuple[Callable[..., Any], tuple[Any, ...], Callable[[outcome.Outcome], None]]


def _abort_failed(_: object) -> trio.lowlevel.Abort:
    # A read already handed to a thread cannot be taken back: cancellation waits for its result.
    return trio.lowlevel.Abort.FAILED


class DriveWorkers:
    """`threads` long-lived threads serving one drive's queue."""

    def __init__(self, name: str, threads: int) -> None:
        self.name = name
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

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on one of this drive's threads and return (or raise) its result."""
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()

        def deliver(result: outcome.Outcome) -> None:
            # RunFinishedError: the loop is gone (shutdown), nobody waits for this result any more.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        self._queue.put((fn, args, deliver))
        return await trio.lowlevel.wait_task_rescheduled(_abort_failed)

    def close(self) -> None:
        """Stop the threads once the queued jobs are done."""
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
