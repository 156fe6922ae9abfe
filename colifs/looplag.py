"""How late the daemon's trio loop runs its timers: the health checks, the balancer, signals,
reloads and the control socket all wait on that loop, so a loop held up (by the GIL, by a
blocking call made on it) delays every one of them. stats.json shows it (`loop`).
"""

from __future__ import annotations

import time
from collections import deque

import trio

TICK = 0.1  # s between the loop's look at the clock
WINDOW = 10.0  # s over which `late_ms_recent` is the worst


class LoopLag:
    """A task that sleeps TICK and notes how much later than asked it woke. Bounded: one entry per
    tick of the last WINDOW seconds at most."""

    def __init__(self) -> None:
        self._recent: deque[tuple[float, float]] = deque(maxlen=int(WINDOW / TICK) + 1)
        self._due: float | None = None  # when the current sleep should end (monotonic)
        self.worst = 0.0
        self.ticks = 0

    async def run(self) -> None:
        """For the life of the mount."""
        while True:
            self._due = time.monotonic() + TICK
            await trio.sleep(TICK)
            now = time.monotonic()
            late = max(0.0, now - self._due)
            self._recent.append((now, late))
            self.worst = max(self.worst, late)
            self.ticks += 1

    def recent(self, now: float | None = None) -> float:
        """The worst lateness (s) of the last WINDOW seconds, counting a tick overdue right now (a
        loop held up at this moment shows while it is held up, not only once it wakes)."""
        now = time.monotonic() if now is None else now
        overdue = 0.0 if self._due is None else max(0.0, now - self._due)
        return max([late for t, late in list(self._recent) if now - t <= WINDOW] + [overdue])

    def as_dict(self) -> dict:
        recent = self.recent()
        return {
            "tick_s": TICK,
            "ticks": self.ticks,
            "late_ms_recent": round(1e3 * recent, 1),
            "late_ms_worst": round(1e3 * max(self.worst, recent), 1),
            "window_s": WINDOW,
        }
