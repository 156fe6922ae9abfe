"""Per-mirror health: a mirror that keeps failing leaves the routing until a check read passes.

Without it a dead or hung mirror still gets its share of every read, and each of those reads pays
an error or a timeout before the primary answers. A mirror is "down" after FAILURES_TO_DOWN read
failures in a row (errors, short reads, timeouts; one success resets the count: a single bad
file must not take a whole drive out). While down, all its keys go to the primary; a check read
runs after a back-off (1 s, doubling to 30 s), so a healed mirror is back within ~30 s.
Pure state: the clock is injected, the check reads are the engine's (pyfuse3/reader.py, native.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

FAILURES_TO_DOWN = 3
FIRST_RETRY_S = 1.0
MAX_RETRY_S = 30.0


class Health:
    """The health of one mirror: up or down, why, and when it is checked again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.up = True
        self.in_a_row = 0  # consecutive failures
        self.errors = 0  # read errors and short reads, all time
        self.timeouts = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None  # wall clock, for people
        self.downs = 0  # times taken out of the routing
        self.checks = 0  # check reads while down
        self.down_since: float | None = None
        self.retry_at = 0.0
        self._backoff = FIRST_RETRY_S
        self.removed_at: float | None = None  # wall clock: `colifs mirror remove` took it away

    def remove(self) -> None:
        """Taken away by its user: never checked again, until `restore`."""
        self.removed_at = time.time()

    def restore(self) -> None:
        """Back from a removal; checked at once if it was down."""
        self.removed_at = None
        self.retry_at = self._clock()

    def another_directory(self) -> None:
        """A new directory takes this removed mirror's slot: the counts were the old mirror's and
        start again. A slot that was down stays so until a check read of the new one passes (the
        engine routes nothing there until then)."""
        self.in_a_row = self.errors = self.timeouts = self.downs = self.checks = 0
        self.last_error = self.last_error_at = None
        self._backoff = FIRST_RETRY_S
        if not self.up:
            self.down_since = self._clock()

    def succeeded(self) -> None:
        if self.up:
            self.in_a_row = 0

    def failed(self, problem: str, timeout: bool = False) -> bool:
        """Count a failed read; True when this failure takes the mirror down."""
        if timeout:
            self.timeouts += 1
        else:
            self.errors += 1
        self.last_error, self.last_error_at = problem, time.time()
        self.in_a_row += 1
        if self.up and self.in_a_row >= FAILURES_TO_DOWN:
            self.up = False
            self.downs += 1
            self.down_since = self._clock()
            self._backoff = FIRST_RETRY_S
            self.retry_at = self.down_since + self._backoff
            return True
        return False

    def due(self) -> bool:
        """Down (not removed) and its back-off is over: time for a check read."""
        return not self.up and self.removed_at is None and self._clock() >= self.retry_at

    def wait(self) -> float:
        """Seconds until the next check read (0 when due)."""
        return max(0.0, self.retry_at - self._clock())

    def next_check(self) -> int:
        """Count a check read about to run; its number picks what it reads."""
        self.checks += 1
        return self.checks

    def check_passed(self) -> float:
        """Back in the routing; returns how long it was down (s)."""
        down_for = self._clock() - (self.down_since or self._clock())
        self.up, self.in_a_row, self.down_since = True, 0, None
        self._backoff = FIRST_RETRY_S
        return down_for

    def check_failed(self, problem: str, timeout: bool = False) -> None:
        self.failed(problem, timeout)
        self._backoff = min(self._backoff * 2, MAX_RETRY_S)
        self.retry_at = self._clock() + self._backoff

    def as_dict(self) -> dict:
        now = self._clock()
        return {
            "state": "removed" if self.removed_at is not None else "up" if self.up else "down",
            "removed_at": _when(self.removed_at),
            "failures_in_a_row": self.in_a_row,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "last_error": self.last_error,
            "last_error_at": _when(self.last_error_at),
            "times_down": self.downs,
            "checks": self.checks,
            "down_for_s": None if self.up else round(now - (self.down_since or now), 1),
            "next_check_in_s": None if self.up else round(max(0.0, self.retry_at - now), 1),
        }


def _when(t: float | None) -> str | None:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) if t else None
