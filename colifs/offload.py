"""Blocking calls the daemon makes for a reload or a mirror command (stat a directory, read
headers, compare a copy's bytes), off its trio loop and with a bound.

A call into a drive that does not answer can never be interrupted: waiting for it on the loop
would stop the health checks, the balancer, signals and the control socket with it. So each such
call runs on a thread of its own (never one of trio's default pool, which unmounting and saving
the usage need), the loop waits at most `within` seconds for it, and a call given up on is left
to end on its own. Those left running are counted: past `most` of them, new calls are refused at
once, so a drive that hangs for good holds a few threads, not an ever-growing number.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import TypeVar

import trio

from colifs.backing import TimedOut

T = TypeVar("T")


class Crowded(TimedOut):
    """Not begun: too many calls of its kind are still stuck in drives that do not answer."""


class Offload:
    """Runs blocking calls of one kind (`what`, for messages) off the loop, within a bound."""

    def __init__(self, what: str, most: int = 4) -> None:
        self.what = what
        self.most = most
        self._lock = threading.Lock()
        self.running = 0  # calls on their threads now, given up on or not

    async def run(self, fn: Callable[..., T], *args: object, within: float | None) -> T:
        """`fn(*args)` on a thread; TimedOut after `within` seconds (None: no bound, but it still
        ends when the caller is cancelled), or at once when `most` calls are still running."""
        with self._lock:
            if self.running >= self.most:
                raise TimedOut(
                    f"{self.running} earlier {self.what} still wait on a drive that does not answer"
                )
            self.running += 1

        state = {"started": False, "dropped": False}

        def call() -> T | None:
            with self._lock:
                if state["dropped"]:  # given up on before it began: it must not begin now
                    return None
                state["started"] = True
            try:
                return fn(*args)
            finally:
                with self._lock:
                    self.running -= 1

        # A limiter of its own: the thread holds no token anyone else waits for.
        limiter = trio.CapacityLimiter(1)
        try:
            with trio.fail_after(math.inf if within is None else within):
                return await trio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=limiter)  # type: ignore[return-value]
        except trio.TooSlowError:
            raise TimedOut(f"{self.what}: no answer within {within:g} s") from None
        finally:
            with self._lock:
                if not state["started"] and not state["dropped"]:
                    state["dropped"] = True
                    self.running -= 1
