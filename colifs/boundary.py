"""The one error boundary of every request handler, in both engines.

An `OSError` is an answer: its errno goes back to the caller. Anything else is a bug in colifs: the
caller gets `EIO`, the log gets one line (the traceback goes to the log file only), rate-limited so
that a bug hit by every request cannot flood it, and the mount keeps serving. No request ends the
daemon.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("colifs")

BURST = 5  # internal errors logged in full per period; the rest are counted
PERIOD = 60.0  # seconds


class RateLimit:
    """At most `burst` events per `period` seconds pass; the others are counted, and reported
    with the next one that passes."""

    def __init__(self, burst: int, period: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.period = period
        self._clock = clock
        self._window = -period
        self._passed = 0
        self._held = 0
        self._lock = threading.Lock()  # the native engine's FUSE threads share it

    def take(self) -> int | None:
        """None: hold this one back. Otherwise: how many were held back since the last one passed."""
        with self._lock:
            now = self._clock()
            if now - self._window >= self.period:
                self._window, self._passed = now, 0
            if self._passed >= self.burst:
                self._held += 1
                return None
            self._passed += 1
            held, self._held = self._held, 0
            return held


_limit = RateLimit(BURST, PERIOD)


def request_errno(e: BaseException, handler: str) -> int:
    """The errno a failed request answers with; a non-OSError is logged as an internal error."""
    if isinstance(e, OSError):
        return e.errno or errno.EIO
    held = _limit.take()
    if held is not None:
        more = f" ({held} more internal errors not logged)" if held else ""
        log.error("internal error in %s: %r; answered EIO%s", handler, e, more, exc_info=e)
    return errno.EIO
