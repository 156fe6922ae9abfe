"""Adaptive weights as pure state: a simulated pair of drives under saturating load, on a fake clock."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from colifs.balance import DEADBAND, FLOOR, TICK, Balancer, shares, with_floor
from colifs.layout import ExpertKey
from colifs.routing import pick, positions


class Drives:
    """Drives of `rates` bytes/s under a load that keeps the busiest one saturated (16 readers): per
    tick, drive d delivers its share of what the load moves and is busy for as long as that takes."""

    def __init__(self, rates: list[float], noise: float = 0.0, seed: int = 1) -> None:
        self.rates = list(rates)
        self.noise = noise
        self.bytes = [0] * len(rates)
        self.busy = [0.0] * len(rates)
        self.now = 0.0
        self.rng = random.Random(seed)

    def run(self, weights: list[float], dt: float = TICK) -> tuple[list[int], list[float], float]:
        s = shares(weights)
        moved = min(r / x for r, x in zip(self.rates, s, strict=True) if x > 0) * dt
        for d, (r, x) in enumerate(zip(self.rates, s, strict=True)):
            rate = r * (1 + self.rng.uniform(-self.noise, self.noise))
            self.bytes[d] += int(moved * x)
            self.busy[d] += moved * x / rate
        self.now += dt
        return list(self.bytes), list(self.busy), self.now


def settle(b: Balancer, drives: Drives, ticks: int) -> list[list[float]]:
    """The shares in force after each tick."""
    out = []
    for _ in range(ticks):
        b.observe(*drives.run(b.weights))
        out.append(shares(b.weights))
    return out


def test_wrong_weights_move_to_the_drives_ratio_within_seconds() -> None:
    b = Balancer([1.0, 1.0])
    drives = Drives([60e6, 20e6])
    history = settle(b, drives, int(10 / TICK))
    first_close = next(i for i, s in enumerate(history) if abs(s[1] - 0.25) < 0.025)
    assert first_close * TICK <= 5.0, history[:12]
    assert abs(shares(b.weights)[1] - 0.25) < 0.025
    assert abs(b.weights[0] / b.weights[1] - 3) < 1e-6 and b.weights == [60.0, 20.0]  # in MB/s


def test_steady_noisy_load_settles_and_stops_moving() -> None:
    b = Balancer([3.0, 1.0])
    drives = Drives([900e6, 300e6], noise=0.08)
    settle(b, drives, 40)
    changes = b.changes
    history = settle(b, drives, 400)  # 200 s more of the same load
    assert b.changes - changes <= 2, b.changes - changes  # no oscillation between two splits
    assert all(abs(s[1] - 0.25) <= 0.025 + DEADBAND for s in history)


def test_a_mirror_that_slows_mid_run_and_recovers_gets_its_share_back() -> None:
    b = Balancer([3.0, 1.0])
    drives = Drives([60e6, 20e6])
    settle(b, drives, 10)
    drives.rates[1] = 5e6  # the mirror slows to a quarter
    settle(b, drives, int(10 / TICK))
    assert abs(shares(b.weights)[1] - 5 / 65) < 0.02
    drives.rates[1] = 0.1e6  # nearly stalled: the floor keeps it read, so measured
    settle(b, drives, int(10 / TICK))
    assert shares(b.weights)[1] <= FLOOR + DEADBAND
    drives.rates[1] = 60e6  # recovered: as fast as the primary
    settle(b, drives, int(10 / TICK))
    assert abs(shares(b.weights)[1] - 0.5) < 0.03


def test_the_primary_slowing_moves_traffic_to_the_mirror() -> None:
    b = Balancer([3.0, 1.0])
    drives = Drives([60e6, 20e6])
    settle(b, drives, 10)
    drives.rates[0] = 20e6
    settle(b, drives, int(10 / TICK))
    assert abs(shares(b.weights)[0] - 0.5) < 0.03


def test_an_idle_or_unmeasured_drive_keeps_its_share() -> None:
    b = Balancer([2.0, 1.0, 1.0])
    for t in range(1, 10):  # only the primary and mirror 1 read (mirror 2 is down, say)
        assert b.observe([t * 10**7, t * 10**6, 0], [t * 0.1, t * 0.1, 0.0], t * TICK) in (None, b.weights)
    s = shares(b.weights)
    assert s[2] == 0.25 and abs(s[0] / s[1] - 10) < 1e-6
    weights = list(b.weights)
    for t in range(10, 20):  # no load at all: nothing to learn, nothing changes
        assert b.observe([9 * 10**7, 9 * 10**6, 0], [0.9, 0.9, 0.0], t * TICK) is None
    assert b.weights == weights


def test_fixed_weights_never_move_but_the_rates_are_measured() -> None:
    b = Balancer([1.0, 1.0], fixed=True)
    settle(b, Drives([60e6, 20e6]), 20)
    assert b.weights == [1.0, 1.0] and b.changes == 0
    assert b.as_dict()["measured_mb_per_s"] == [60.0, 20.0]


def test_every_layer_splits_exactly_in_the_weights_in_force_at_every_step() -> None:
    """The weights only move interval boundaries: each layer's experts follow every step's shares
    within one expert, and a step moves only the experts between the old and the new boundary."""
    keys = [ExpertKey("model.layers", layer, e) for layer in range(4) for e in range(64)]
    where = positions(keys)
    b = Balancer([1.0, 1.0])
    drives = Drives([60e6, 20e6], noise=0.05)
    before = {k: pick(where[k], b.weights) for k in keys}
    for _ in range(30):
        b.observe(*drives.run(b.weights))
        s = shares(b.weights)
        now = {k: pick(where[k], b.weights) for k in keys}
        for layer in range(4):
            count = Counter(now[k] for k in keys if k.layer == layer)
            assert abs(count[1] - 64 * s[1]) <= 1
        moved = {k for k in keys if now[k] != before[k]}
        assert len({now[k] for k in moved}) <= 1  # all moved one way: only across one boundary
        before = now


@given(st.lists(st.floats(0, 1e6), min_size=2, max_size=8).filter(lambda xs: sum(xs) > 0))
def test_with_floor_keeps_every_share_above_the_floor_and_the_order(raw: list[float]) -> None:
    target = shares(raw)
    out = with_floor(target, FLOOR)
    assert abs(sum(out) - 1) < 1e-9
    assert min(out) >= min(FLOOR, 1 / len(raw)) - 1e-12
    for i in range(len(raw) - 1):
        a, b, x, y = target[i], target[i + 1], out[i], out[i + 1]
        assert (a <= b) == (x <= y) or abs(x - y) < 1e-12
