"""Adaptive weights: the split follows what each drive delivers now, not what it did at mount.

Both engines count, per drive, the bytes it delivered, its busy time (time with a read of ours
running on it) and its time **alone**: time in which it alone had reads that an O_DIRECT reader
waits for, the other drives none (they sat idle while a reader waited on it). Every TICK the engine
hands the totals to `Balancer.observe`, which looks at them over WINDOW-second windows:

- readers waited on one drive alone (times alone adding up to WAITED of the window at least; both
  engines count them): the drive alone longest gives a step of share to the one alone
  least, once they differ by BALANCED_ALONE of the window in two windows in a row;
- else, unless only time alone moves the split (`by_utilization` off: queue routing, whose spills
  even out backlogs; there readers that wait on no drive in particular have the split right): one
  drive busy while another idles (utilizations more than BALANCED apart, in two windows in a
  row): the busiest drive gives a step of share to the idlest;
- a step grows while the direction holds and halves when it reverses, so the split closes in on
  the point where neither waits for the other;
- every drive busy (all at least SATURATED): each one's rate (bytes per busy second) is what it
  can deliver, and the shares move halfway to the rates, once some share is DEADBAND off;
- otherwise (light load, drives equally busy) the split is right as it is.

Why time alone first, then utilization, and not the rates alone: a drive that is not kept busy
reads much faster per busy second than it can sustain (measured: a 150 MB/s throttle at half the
traffic it could take showed 737 MB/s; a 300 MB/s one read by one reader, 658), so rates are
trusted only from saturated drives, and its busy time understates how long readers wait for it;
the time a reader waits on one drive while the others idle is what a better split removes. A
step that time alone asks for is never more than what would have the waiting reader's pieces end
together (`evening`), and is judged like any other once it went too far: a step after which
readers still wait on the drive it left, more than on the other, did not overshoot (the window
after it still drains that drive's backlog, routed before the step: a mirror slowed to a crawl
moves less for a while, whatever the split), and is kept. The reason of every change says what
moved it (time alone, busy time, measured rates, or an undo). After a change the next window starts
SETTLE s later (requests routed before it drain). Every drive keeps at least FLOOR of the
weight, so it is still read, still measured, and gets its share back when it recovers. A drive
that served nothing in a window (down, or no copy) takes no part. Weights only move interval
boundaries (colifs.routing): each layer's experts and each file's stripes split exactly in the
weights in force, and a change moves only the keys between the old and the new boundaries. Pure
but for the clock the caller passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import trio

log = logging.getLogger("colifs")

TICK = 0.25  # s between looks at the counters
WINDOW = 1.0  # s over which utilizations and rates are measured for one decision
SETTLE = 1.0  # s after a change before the next window starts (a throttled drive pays back bursts)
BALANCED = 0.10  # utilizations closer than this: no drive waits for another
SATURATED = 0.80  # utilization from which a drive's rate is what it can deliver
STEP, STEP_MIN, STEP_MAX = 0.10, 0.01, 0.15  # share moved per decision while utilizations differ
HALF_LIFE = 2.0  # s: the smoothing of the rates shown
MIN_BUSY = 0.02  # s a drive must have been busy in a window for its rate to count
PENDING = 5.0  # s over which a barely busy drive's bytes and busy time add up, at most
CAPACITY_KEEP = 0.5  # of a drive's capacity kept per saturated window (the rest: the window's rate)
FLOOR = 1 / 64  # the least share any drive keeps: one slot of a stripe sequence (colifs.routing)
DEADBAND = 0.02  # with every drive saturated, shares this close to the rates' are left alone
LOGGED = 0.10  # a change of a share by this much (relative) is logged
TOLERANCE = 0.15  # a change after which the mount moves this much less (relative) is undone (noise: less)
TOLERANCE_ALONE = 0.05  # the same for a step time alone asked for: undone, it is tried by half
AGAIN = 2  # steps one way after an overshoot, then the step is full again (the best split moved on)
AGAIN_ALONE = 4  # the same, when time alone decides: it flips from one drive to the other at the
# best split (a reader waits on one or the other), and a drive that read in bursts while lightly
# used pays back for seconds after: the split closes in by halving steps instead of swinging
HOLD = 20.0  # s an undone step's direction is not tried again
SPILLED = 0.05  # a drive whose backlog spilled this share of the window's bytes gets no step of share
BALANCED_ALONE = 0.03  # times alone closer than this (share of the window): pieces end together
WAITED = 0.05  # time alone (all drives, share of the window) from which it decides the step
IDLE = 0.25  # a step towards a drive busy less than this is not on trial: it has room, whatever
# the threads say (the judging window is too noisy then: a slow drive's few reads per window)


def evening(late: float, early: float, alone: float) -> float:
    """The share that, moved from the drive a reader waited on to the other, has their pieces end
    together, if the reader waited on it `alone` (a fraction) of each request: its pieces take
    1/(1 - alone) times the other's. Time alone is counted over the window, in which the reader
    also computes, so `alone` understates it and the move falls short: the split closes in on the
    point from one side, without swinging past it."""
    alone = min(alone, 0.99)
    return late - (late + early) * late * (1 - alone) / (late * (1 - alone) + early)


def _minus(now: Sequence[float], then: Sequence[float]) -> list:
    return [b - a for a, b in zip(then, now, strict=True)]


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


class Activity(NamedTuple):
    """What an engine counted per drive since mount: bytes served, seconds with a read running,
    and, if it measures them, seconds alone with reads an O_DIRECT reader waits for, and bytes its
    routes gave the drive that its backlog spilled to another (queue routing)."""

    nbytes: Sequence[int]
    busy: Sequence[float]
    alone: Sequence[float] | None = None
    spilled: Sequence[int] | None = None


@dataclass
class Window:
    """What each drive did over one measuring window."""

    seconds: float
    nbytes: list[int]
    busy: list[float]
    alone: list[float] | None = None  # None: the engine does not measure it
    spilled: list[int] | None = None  # bytes routed to the drive that went to another (queue routing)

    def room(self, d: int) -> bool:
        """Whether drive d can take more: not if its backlog spilled (SPILLED of the bytes moved)."""
        return self.spilled is None or self.spilled[d] <= SPILLED * sum(self.nbytes)

    @property
    def throughput(self) -> float:
        """Bytes/s the mount delivered (all drives)."""
        return sum(self.nbytes) / self.seconds

    @property
    def utilization(self) -> list[float]:
        return [min(1.0, s / self.seconds) for s in self.busy]

    def rate(self, d: int) -> float | None:
        return self.nbytes[d] / self.busy[d] if self.busy[d] >= MIN_BUSY and self.nbytes[d] else None


@dataclass(frozen=True)
class Trial:
    """A change on trial: the weights before it, what the mount moved before it (bytes/s), the
    direction of its step (None: a move to the rates), and, for an undo, what the mount moved
    before the step it undid."""

    weights: list[float]
    throughput: float
    direction: tuple[int, int] | None
    undo: bool = False
    before_step: float = 0.0
    by_alone: bool = False  # a step that time alone asked for


@dataclass
class Balancer:
    """The weights in force (per replica, plain: before the partial-mirror correction), and what
    was measured of the drives."""

    weights: list[float]
    floor: float = FLOOR
    fixed: bool = False  # --fixed-weights, or copies on one drive: the drives are measured and shown
    by_utilization: bool = True  # off: only time alone moves the split (and saturated drives' rates)
    rates: list[float | None] = field(default_factory=list)  # bytes per busy second, smoothed
    # The same, from the windows in which the drive was saturated only: what it can deliver.
    capacity: list[float | None] = field(default_factory=list)
    saturated_windows: int = 0  # windows in which a capacity was measured
    utilization: list[float] = field(default_factory=list)  # of the last window
    alone: list[float] = field(default_factory=list)  # of the last window, share of it
    changes: int = 0
    last_change: dict = field(default_factory=dict)  # at (None: never), why, shares before and after
    _start: tuple[Activity, float] | None = None  # the window's counters at its start, and when
    _not_before: float = 0.0  # the next window starts then (SETTLE after a change)
    _step: float = STEP
    _last_move: tuple[int, int] | None = None  # (from, to) of the last step
    _asked: tuple[int, int] | None = None  # (from, to) the last window asked for, not taken yet
    _same: int = 0  # steps in a row in the last step's direction
    _reversed: bool = False  # a step has reversed the one before it (the best split was crossed)
    _direction: tuple[int, int] | None = None  # (from, to) of the step being decided, if a step
    _trial: Trial | None = None  # the last change, until the first window after it judges it
    _held: dict[tuple[int, int], float] = field(default_factory=dict)  # direction -> not before
    _pending: list[tuple[int, float, float]] = field(default_factory=list)  # per drive: bytes, busy, since

    def __post_init__(self) -> None:
        self.rates = [None] * len(self.weights)
        self.capacity = [None] * len(self.weights)
        self._pending = [(0, 0.0, 0.0)] * len(self.weights)
        self.utilization = [0.0] * len(self.weights)
        self.alone = [0.0] * len(self.weights)
        now = [round(x, 4) for x in shares(self.weights)]
        # The same shape before the first change as after: stats.json barely grows while serving.
        self.last_change = {"at": None, "why": "as mounted", "shares_before": now, "shares_after": now}

    def observe(self, a: Activity, now: float) -> list[float] | None:
        """Counter totals at monotonic time `now`; the new weights when they change, else None."""
        if now < self._not_before:
            return None
        a = Activity(*(None if x is None else list(x) for x in a))  # an engine may hand its live lists
        if self._start is None or now < self._start[1]:
            self._start = (a, now)
            return None
        a0, t0 = self._start
        if now - t0 < WINDOW:
            return None
        self._start = (a, now)
        w = Window(
            now - t0,
            _minus(a.nbytes, a0.nbytes),
            _minus(a.busy, a0.busy),
            None if a.alone is None or a0.alone is None else _minus(a.alone, a0.alone),
            None if a.spilled is None or a0.spilled is None else _minus(a.spilled, a0.spilled),
        )
        self._measured(w, now)
        if self.fixed:
            return None
        undone = self._judge_trial(w, now)
        if undone is not None:
            return undone
        target = self._target(w, now)
        if target is None:
            return None
        return self._apply(target, now, w)

    def _judge_trial(self, w: Window, now: float) -> list[float] | None:
        """The first window after a change judges it: a step after which the mount moves less than
        before, and that did not stop short of the split (`_stands`), is undone (the signals
        misled: drives differ in more than their speed) and its
        direction left alone for HOLD s (one that time alone asked for: tried again by half); an
        undo after which the mount moves less still is undone in turn (the drives changed
        meanwhile: the step was right). Returns the weights when it changes them."""
        if w.throughput <= 0:  # no load: nothing to judge by yet
            return None
        trial, self._trial = self._trial, None
        if trial is not None and trial.undo and w.throughput < 0.5 * trial.before_step:
            self._held.pop(trial.direction, None)  # type: ignore[arg-type]
            return None  # less than half of before the step, either way: the drives changed
        if trial is None or self._stands(trial, w):
            return None
        if trial.undo:
            self._held.pop(trial.direction, None)  # type: ignore[arg-type]
        elif trial.direction is not None:
            # Time alone does not mislead about the direction (the reader waited on that drive): a
            # step that lowered the throughput was too big, and a half step is tried next.
            if not trial.by_alone or self._step <= STEP_MIN:
                self._held[trial.direction] = now + HOLD
            self._step = max(STEP_MIN, self._step / 2)
            self._trial = Trial(list(self.weights), w.throughput, trial.direction, True, trial.throughput)
        before = shares(self.weights)
        self.weights = trial.weights
        self._start, self._not_before, self._asked, self._last_move = None, now + SETTLE, None, None
        what = "redone" if trial.undo else "undone"
        self._changed(before, shares(self.weights), f"{what}: {w.throughput / 1e6:.0f} MB/s after it, "
                      f"{trial.throughput / 1e6:.0f} before")  # fmt: skip
        return self.weights

    def _stands(self, trial: Trial, w: Window) -> bool:
        """Whether a change stands: the mount moves about as much as before it, or, for a step
        time alone asked for, readers still wait on the drive it left (WAITED of the window at
        least), more than on the other: it did not go too far, whatever the mount moved meanwhile
        (the drain of that drive's backlog), and undoing it would only lose time. Undo trials are
        never time alone's."""
        tolerance = TOLERANCE_ALONE if trial.by_alone else TOLERANCE
        if w.throughput >= (1 - tolerance) * trial.throughput:
            return True
        if not trial.by_alone or trial.direction is None:
            return False
        source, towards = trial.direction
        return self.alone[source] >= WAITED and self.alone[source] - self.alone[towards] > BALANCED_ALONE

    def _measured(self, w: Window, now: float) -> None:
        """Each drive's rate, smoothed. A drive busy less than MIN_BUSY in a window (a fast drive
        waiting for a slow one) adds up its windows, over PENDING s at most, until it was: it is
        measured too, a little later. Windows in which it delivered nothing (idle, or failing) do
        not count."""
        self.utilization = w.utilization
        self.alone = [0.0] * len(self.rates) if w.alone is None else [a / w.seconds for a in w.alone]
        self._saturated(w)
        for d in range(len(self.rates)):
            if not w.nbytes[d]:
                continue
            nbytes, busy, since = self._pending[d]
            if not nbytes or now - since > PENDING:  # nothing pending, or too old to say much now
                nbytes, busy, since = 0, 0.0, now - w.seconds
            nbytes, busy = nbytes + w.nbytes[d], busy + w.busy[d]
            if busy < MIN_BUSY:
                self._pending[d] = (nbytes, busy, since)
                continue
            self._pending[d] = (0, 0.0, 0.0)
            keep = 0.5 ** ((now - since) / HALF_LIFE)
            old = self.rates[d]
            self.rates[d] = nbytes / busy if old is None else keep * old + (1 - keep) * nbytes / busy

    def _saturated(self, w: Window) -> None:
        """Each drive's capacity: its rate in windows where it was SATURATED, smoothed over
        CAPACITY_KEEP of the old figure per window (the rates of a drive not kept busy run high)."""
        measured = False
        for d, u in enumerate(w.utilization):
            rate = w.rate(d)
            if u < SATURATED or rate is None:
                continue
            old = self.capacity[d]
            self.capacity[d] = rate if old is None else CAPACITY_KEEP * old + (1 - CAPACITY_KEEP) * rate
            measured = True
        self.saturated_windows += measured

    def capacity_mb_per_s(self, live: Sequence[bool]) -> float | None:
        """What the `live` drives (in the routing) deliver together, MB/s, once every one of them
        that served was measured saturated; None before, or for good if one never is (a drive that
        serves too little to be saturated, a partial mirror's, leaves the speed unknown)."""
        serving = zip(self.capacity, self.rates, live, strict=True)
        known = [c for c, r, up in serving if r is not None and up]
        if not known or None in known:
            return None
        return sum(known) / 1e6  # type: ignore[arg-type]

    def forget(self, drive: int) -> None:
        """Another drive in `drive`'s slot (a mirror added where one was removed): nothing measured
        of the old one counts for it."""
        self.rates[drive] = self.capacity[drive] = None
        self._pending[drive] = (0, 0.0, 0.0)

    def _target(self, w: Window, now: float) -> list[float] | None:
        """The shares the window asks for, or None (nothing to learn, or right as they are)."""
        taking = [d for d, b in enumerate(w.nbytes) if b > 0]  # a drive that served nothing: no part
        if len(taking) < 2:
            return None
        self._direction = None
        if sum(self.alone) >= WAITED:  # readers waited on one drive: who, says the step
            signal = self.alone
        elif self.by_utilization:
            signal = w.utilization
        else:  # queue routing: backlogs spill, and no reader waited on one drive
            signal = [0.0] * len(self.weights)
        busiest = max(taking, key=lambda d: signal[d])
        idlest = min((d for d in taking if w.room(d)), key=lambda d: signal[d], default=busiest)
        if signal[busiest] - signal[idlest] > (BALANCED_ALONE if signal is self.alone else BALANCED):
            # Two windows in a row must ask the same: a throttled drive's bursts and debts make
            # single windows flip between "this one waits" and "that one waits".
            asked, self._asked = self._asked, (busiest, idlest)
            if asked != (busiest, idlest) or self._held.get((busiest, idlest), 0.0) > now:
                return None
            return self._step_towards(shares(self.weights), busiest, idlest, signal is self.alone)
        self._asked = None
        return self._towards_rates(w, shares(self.weights), taking)

    def _towards_rates(self, w: Window, now: list[float], taking: list[int]) -> list[float] | None:
        """Every drive saturated: their rates are what they can deliver; halfway to them."""
        rates = [w.rate(d) for d in taking]
        if min(w.utilization[d] for d in taking) < SATURATED or None in rates:
            return None
        room = sum(now[d] for d in taking)
        total = sum(rates)  # type: ignore[arg-type]
        want = list(now)
        for d, r in zip(taking, rates, strict=True):
            want[d] = room * r / total  # type: ignore[operator]
        want = with_floor(want, self.floor)
        if max(abs(a - b) for a, b in zip(want, now, strict=True)) <= DEADBAND:
            return None
        return [(a + b) / 2 for a, b in zip(want, now, strict=True)]

    def _step_towards(
        self, now: list[float], busiest: int, idlest: int, by_alone: bool
    ) -> list[float] | None:
        if self._last_move == (idlest, busiest):
            self._step = max(STEP_MIN, self._step / 2)  # overshot: back, by half as much
            self._reversed, self._same = True, 0
        elif self._last_move == (busiest, idlest):
            self._same += 1
            if not self._reversed:  # searching: bigger steps
                self._step = min(STEP_MAX, self._step * 1.5)
            elif self._same >= (AGAIN_ALONE if by_alone else AGAIN):
                self._step, self._reversed = max(STEP, self._step), False
        self._last_move = self._direction = (busiest, idlest)
        move = min(self._step, now[busiest] - self.floor)
        if by_alone:
            move = min(move, evening(now[busiest], now[idlest], self.alone[busiest] - self.alone[idlest]))
        if move <= 0:
            return None
        out = list(now)
        out[busiest] -= move
        out[idlest] += move
        return with_floor(out, self.floor)

    def _apply(self, target: list[float], now: float, w: Window) -> list[float] | None:
        before = shares(self.weights)
        if max(abs(a - b) for a, b in zip(target, before, strict=True)) < 1e-3:
            return None
        by_alone = self._direction is not None and sum(self.alone) >= WAITED
        self._trial = (
            Trial(list(self.weights), w.throughput, self._direction, by_alone=by_alone)
            if self._on_trial(by_alone)
            else None
        )
        scale = sum(self.weights)
        self.weights = [t * scale for t in target]
        self._start, self._not_before, self._asked = None, now + SETTLE, None
        moved_by = "time alone" if by_alone else "busy time" if self._direction else "measured rates"
        why = f"{moved_by}: utilization " + ", ".join(f"{100 * u:.0f}%" for u in self.utilization)
        why += "; alone " + ", ".join(f"{100 * a:.0f}%" for a in self.alone)
        why += "; measured MB/s " + ", ".join("?" if r is None else f"{r / 1e6:.1f}" for r in self.rates)
        self._changed(before, target, why)
        return self.weights

    def _on_trial(self, by_alone: bool) -> bool:
        """Whether the window after the change judges it. A step towards an idle drive is judged
        only when time alone asked for it (by what the waiting reader got then)."""
        return self._direction is None or by_alone or self.utilization[self._direction[1]] >= IDLE

    def grow(self, weight: float) -> None:
        """One more drive (a mirror added while serving), at `weight`; measured from the next window."""
        before = shares(self.weights)
        self.weights.append(weight)
        self.rates.append(None)
        self.capacity.append(None)
        self.utilization.append(0.0)
        self.alone.append(0.0)
        self._pending.append((0, 0.0, 0.0))
        self._start, self._trial = None, None
        self._changed([*before, 0.0], shares(self.weights), "a mirror added (colifs mirror add)")

    def set_weight(self, drive: int, weight: float, why: str) -> None:
        """A weight given while serving (colifs mirror add --weight): in force from now on, and
        the next window measures from here."""
        before = shares(self.weights)
        self.weights[drive] = weight
        self._start, self._trial = None, None
        self._changed(before, shares(self.weights), why)

    def _changed(self, before: Sequence[float], after: Sequence[float], why: str) -> None:
        self.changes += 1
        self.last_change = {
            "at": round(time.time(), 1),
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
            "saturated_mb_per_s": [None if r is None else round(r / 1e6, 1) for r in self.capacity],
            "utilization": [round(u, 3) for u in self.utilization],
            "alone": [round(a, 3) for a in self.alone],
            "changes": self.changes,
            "last_change": self.last_change,
        }


class Adaptive:
    """Runs a `Balancer` for a mount: reads the engine's counters every TICK and, when the weights
    change, gives the routing its new weights (`apply`, with the partial-mirror correction done by
    `held`); each of `listeners` gets the balancer after every look (the native engine's queue
    routing compares backlogs by the measured rates, the readahead follows the drives' speed)."""

    def __init__(
        self,
        balancer: Balancer,
        activity: Callable[[], Activity],
        held: Callable[[list[float]], list[float]],
        apply: Callable[[list[float]], None],
        listeners: Sequence[Callable[[Balancer], None]] = (),
    ) -> None:
        self.balancer = balancer
        self._activity = activity
        self._held = held
        self._apply = apply
        self._listeners = listeners

    def tick(self, now: float) -> None:
        weights = self.balancer.observe(self._activity(), now)
        if weights is not None:
            self._apply(self._held(weights))
        for listener in self._listeners:
            listener(self.balancer)

    async def run(self) -> None:
        """For the life of the mount."""
        while True:
            self.tick(trio.current_time())
            await trio.sleep(TICK)
