"""Choosing the shards for a smaller mirror, and sizes (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from colifs.formats.layout import Layout
from colifs.plan import Shard, choose
from colifs.units import parse_size

LAYOUT = Layout(8, 16, (8,), ("t",))  # any layout: choose only asks whether there is one


@st.composite
def shards(draw: st.DrawFn) -> list[Shard]:
    out = []
    for i in range(draw(st.integers(0, 12))):
        state = draw(st.sampled_from(["present", "missing", "header differs", "unreadable"]))
        layout = None if state == "unreadable" else LAYOUT
        size = draw(st.integers(1, 1000))
        out.append(Shard(f"s{i:02d}", size, layout, state, traffic=draw(st.floats(0, 1e6))))
    return out


@given(shards(), st.integers(0, 8000), st.integers(0, 8000))
def test_choose_keeps_what_is_there_copies_within_budget_and_free_space(
    all_shards: list[Shard], budget: int, free: int
) -> None:
    choices = choose(all_shards, budget, free)
    assert sorted(c.shard.relpath for c in choices) == sorted(s.relpath for s in all_shards)
    present = sum(s.size for s in all_shards if s.present)
    copied = [c.shard for c in choices if c.selected and not c.shard.present]
    assert sum(s.size for s in copied) <= max(0, min(budget - present, free))
    for c in choices:
        if c.shard.present:
            assert c.selected  # a valid copy costs nothing: always kept
        if c.shard.blocked or c.shard.layout is None:
            assert not c.selected  # never replaces another file, never copies an unreadable one
    dense = [c.shard for c in choices if not c.shard.present]
    ratios = [s.traffic / s.size for s in dense]
    assert ratios == sorted(ratios, reverse=True)  # offered in order of traffic per byte


def test_choose_takes_the_hottest_per_byte_first() -> None:
    hot, big, cold = (Shard(n, size, LAYOUT, "missing", traffic=t) for n, size, t in
                      [("hot", 100, 1000.0), ("big", 1000, 2000.0), ("cold", 100, 10.0)])  # fmt: skip
    picked = {c.shard.relpath for c in choose([cold, big, hot], budget=250, free=10**9) if c.selected}
    assert picked == {"hot", "cold"}  # big has more traffic, but less per byte, and does not fit


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1234", 1234),
        ("200G", 200 << 30),
        ("1.5T", int(1.5 * 2**40)),
        ("500MiB", 500 << 20),
        ("2GB", 2 * 10**9),
    ],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size
