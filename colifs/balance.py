"""Adaptive weights: the split follows what each drive delivers now, not what it did at mount.

Each drive's rate is measured as it serves: bytes delivered per second with a read running on it
(its busy time; both engines count it). Every TICK the engine hands the totals to `Balancer.observe`;
the rates are smoothed (half-life HALF_LIFE) and the weights move to them once some drive's share is
DEADBAND away from the share in force, so under steady load they settle and stop moving. Every
drive keeps at least FLOOR of the weight: it is still read, so still measured, and a drive that
recovers gets its share back. Weights only move interval boundaries (colifs.routing): each layer's
experts and each file's stripes split exactly in the weights in force, and a change moves only the
keys between the old and the new boundaries. Pure but for the clock the caller passes.

Why bytes per busy second: a drive that is slow, throttled or shared delivers fewer bytes for each
second it works on ours, whatever share it has; a drive waiting for work is not charged for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

log = logging.getLogger("colifs")

TICK = 0.5  # s between looks at the counters
HALF_LIFE = 1.5  # s: the rates' smoothing
MIN_BUSY = 0.02  # s a drive must have been busy for a rate sample (over one tick or more)
FLOOR = 0.03  # the least share of the weight any drive keeps
DEADBAND = 0.02  # the weights change once some drive's share is this far from the share in force
LOGGED = 0.10  # a change of a share by this much (relative) is logged


def shares(weights: Sequence[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def with_floor(target: Sequence[float], floor: float) -> list[float]:
    """Shares summing to 1 where none is below `floor`: the shares below it are raised to it, the
    others scaled down to make room (again, until scaling pushes none below)."""
    floor = min(floor, 1 / len(target))
    low = [t < floor for t in target]
    while True:
        rest = sum(t for t, lo in zip(target, low, strict=True) if not lo)
        room = 1 - floor * sum(low)
        out = [floor if lo or rest <= 0 else t / rest * room for t, lo in zip(target, low, strict=True)]
        now_low = [lo or x < floor for lo, x in zip(low, out, strict=True)]
        if now_low == low:
            return out
        low = now_low


@dataclass
class Balancer:
    """The weights in force (per replica, plain: before the partial-mirror correction) and the
    drives' measured rates."""

    weights: list[float]
    half_life: float = HALF_LIFE
    floor: float = FLOOR
    deadband: float = DEADBAND
    fixed: bool = False  # --fixed-weights: the rates are measured and shown, the weights stay
    rates: list[float | None] = field(default_factory=list)  # bytes/s, smoothed; None: not measured
    changes: int = 0
    last_change: dict = field(default_factory=dict)  # at (None: never), why, shares before and after
    _base: list[tuple[int, float, float]] = field(default_factory=list)  # per drive: last sample's end

    def __post_init__(self) -> None:
        self.rates = [None] * len(self.weights)
        now = [round(x, 4) for x in shares(self.weights)]
        # The same shape before the first change as after: stats.json barely grows while serving.
        self.last_change = {"at": None, "why": "as mounted", "shares_before": now, "shares_after": now}

    def observe(self, nbytes: Sequence[int], busy: Sequence[float], now: float) -> list[float] | None:
        """Counter totals (bytes delivered, seconds busy, per drive) at monotonic time `now`; the new
        weights when they change, else None. A drive's sample spans as many ticks as it takes to be
        busy MIN_BUSY s (a drive with a small share is measured over a longer window)."""
        if not self._base:
            self._base = [(b, s, now) for b, s in zip(nbytes, busy, strict=True)]
            return None
        for d, (b, s) in enumerate(zip(nbytes, busy, strict=True)):
            b0, s0, t0 = self._base[d]
            if s - s0 < MIN_BUSY or b <= b0 or now <= t0:
                continue
            self._base[d] = (b, s, now)
            sample = (b - b0) / (s - s0)
            old = self.rates[d]
            keep = 0.5 ** ((now - t0) / self.half_life)
            self.rates[d] = sample if old is None else keep * old + (1 - keep) * sample
        return self._decide()

    def _decide(self) -> list[float] | None:
        measured = [d for d, r in enumerate(self.rates) if r is not None]
        if self.fixed or len(measured) < 2:
            return None
        now_shares = shares(self.weights)
        # Unmeasured drives keep their share; the measured ones split the rest by their rates.
        room = sum(now_shares[d] for d in measured)
        total = sum(self.rates[d] for d in measured)  # type: ignore[misc]
        target = [
            room * self.rates[d] / total if d in measured else s  # type: ignore[operator]
            for d, s in enumerate(now_shares)
        ]
        target = with_floor(target, self.floor)
        if max(abs(t - s) for t, s in zip(target, now_shares, strict=True)) <= self.deadband:
            return None
        scale = total / 1e6 / room  # weights in MB/s, as the probe gives them
        new = [t * scale for t in target]
        self._changed(now_shares, target)
        self.weights = new
        return new

    def _changed(self, before: Sequence[float], after: Sequence[float]) -> None:
        self.changes += 1
        mbs = [None if r is None else round(r / 1e6, 1) for r in self.rates]
        why = "measured MB/s " + ", ".join("?" if m is None else f"{m:g}" for m in mbs)
        self.last_change = {
            "at": time.time(),
            "why": why,
            "shares_before": [round(x, 4) for x in before],
            "shares_after": [round(x, 4) for x in after],
        }
        if any(abs(a - b) > LOGGED * b for a, b in zip(after, before, strict=True)):
            log.info(
                "weights: shares %s -> %s (%s)",
                " / ".join(f"{100 * x:.0f}%" for x in before),
                " / ".join(f"{100 * x:.0f}%" for x in after),
                why,
            )

    def as_dict(self) -> dict:
        return {
            "adaptive": not self.fixed,
            "weights": [round(w, 3) for w in self.weights],
            "shares": [round(s, 4) for s in shares(self.weights)],
            "measured_mb_per_s": [None if r is None else round(r / 1e6, 1) for r in self.rates],
            "changes": self.changes,
            "last_change": self.last_change,
        }


class Adaptive:
    """Runs a `Balancer` for a mount: reads the engine's counters every TICK and, when the weights
    change, gives the routing its new weights (`apply`, with the partial-mirror correction done by
    `held`)."""

    def __init__(
        self,
        balancer: Balancer,
        activity: Callable[[], tuple[Sequence[int], Sequence[float]]],
        held: Callable[[list[float]], list[float]],
        apply: Callable[[list[float]], None],
    ) -> None:
        self.balancer = balancer
        self._activity = activity
        self._held = held
        self._apply = apply

    def tick(self, now: float) -> None:
        weights = self.balancer.observe(*self._activity(), now)
        if weights is not None:
            self._apply(self._held(weights))

    async def run(self) -> None:
        """For the life of the mount."""
        while True:
            self.tick(trio.current_time())
            await trio.sleep(TICK)
