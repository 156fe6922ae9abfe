"""The pure read planner and the native engine's run tables: every byte of every column of a table
is routed as `pieces()` routes it (the pyfuse3 engine and `colifs route` use `pieces()` directly);
stripes spread big keys over the drives and keep small ones whole."""

from __future__ import annotations

import bisect
import itertools
import shutil
from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colifs.catalogue import ServedFile, build_files
from colifs.formats.layout import HEADER, ExpertKey, Layout
from colifs.health import Health
from colifs.readplan import (
    PLAIN,
    Router,
    merge,
    pieces,
    plan,
    route_columns,
    run_table,
    table_drive,
    usable_weights,
)
from colifs.replicas import Replica
from colifs.routing import CHUNK
from colifs.synth import write_checkpoint, write_gguf
from colifs.tree import Tree


@st.composite
def served_files(draw: st.DrawFn) -> tuple[ServedFile, list[float]]:
    n = draw(st.integers(1, 10))
    data_start = draw(st.integers(8, 3 * 4096))
    sizes = draw(st.lists(st.integers(1, 5 * CHUNK), min_size=n, max_size=n))
    starts, pos = [], data_start
    for size in sizes:
        starts.append(pos)
        pos += size
    expert = [draw(st.booleans()) for _ in range(n)]
    keys = tuple(ExpertKey("model.layers", i % 3, i) if e else f"t{i}" for i, e in enumerate(expert))
    nrep = draw(st.integers(1, 4))
    held = (0, *sorted(draw(st.sets(st.integers(1, nrep - 1))))) if nrep > 1 else (0,)
    f = ServedFile(
        "x.safetensors",
        pos,
        Layout(data_start, pos, tuple(starts), keys),
        held,
        positions=tuple(draw(st.floats(0, 1, exclude_max=True)) for _ in range(n)),
        stripes=tuple(draw(st.integers(-1, 63)) if size >= 2 * CHUNK else -1 for size in sizes),
    )
    weights = draw(st.lists(st.floats(0.1, 10), min_size=nrep, max_size=nrep))
    return f, weights


def decode(table: tuple[bytes, bytes, bytes, bytes]) -> tuple[list[int], list[int], list[int], list[int]]:
    starts, keys, where, rotations = array("Q"), array("i"), array("I"), array("b")
    for arr, raw in zip((starts, keys, where, rotations), table, strict=True):
        arr.frombytes(raw)
    assert len(starts) == len(keys) == len(where) == len(rotations)
    return list(starts), list(keys), list(where), list(rotations)


@settings(max_examples=200, deadline=None)
@given(served_files(), st.data(), st.booleans())
def test_every_column_of_a_run_table_routes_each_byte_as_pieces_does(case, data, striping) -> None:
    """The table holds no weights: with any weights' routes, every byte goes where pieces() sends it."""
    f, weights = case
    key_ids = {k: i for i, k in enumerate(dict.fromkeys(f.layout.keys))}
    ncols = 1 << (len(weights) - 1)
    starts, keys, where, rotations = decode(run_table(f, striping, key_ids))
    assert starts[0] == 0 and starts == sorted(set(starts))
    for w in (weights, data.draw(st.lists(st.floats(0.1, 10), min_size=len(weights), max_size=len(weights)))):
        columns = route_columns(w)
        for _ in range(20):
            off = data.draw(st.integers(0, f.size - 1))
            seg = bisect.bisect_right(starts, off) - 1
            for col in range(ncols):
                usable = {d for d in f.copies if d and (col >> (d - 1)) & 1}
                _start, _, drive, extent = pieces(f, usable_weights(w, usable), striping, off, off + 1)[0]
                col_of_file = sum(1 << (d - 1) for d in usable)  # the engine's column: the file's usable set
                got = table_drive(columns, len(w), col_of_file, keys[seg], where[seg], rotations[seg], off)
                assert got == drive
                assert drive == 0 or drive in usable  # never a mirror outside the column's set
            assert keys[seg] == (-1 if extent == HEADER else key_ids[f.layout.keys[extent]])


@settings(max_examples=100, deadline=None)
@given(served_files(), st.data(), st.booleans())
def test_pieces_tile_the_range_and_merge_joins_same_drive_neighbours(case, data, striping) -> None:
    f, weights = case
    off = data.draw(st.integers(0, f.size - 1))
    end = data.draw(st.integers(off + 1, f.size + 5 * CHUNK))
    plan = pieces(f, weights, striping, off, end)
    assert plan[0][0] == off and plan[-1][1] == min(end, f.size)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(plan))
    assert all(p[1] - p[0] <= CHUNK for p in plan if p[3] >= 0 and f.stripes[p[3]] >= 0 and striping)
    runs = merge(plan)
    assert all(a[2] != b[2] for a, b in itertools.pairwise(runs))
    assert sum(e - s for s, e, _ in runs) == min(end, f.size) - off


def test_a_file_without_layout_is_one_primary_segment() -> None:
    f = ServedFile("config.json", 1234)
    assert pieces(f, [1.0, 3.0], True, 10, 99) == [(10, 99, 0, PLAIN)]
    assert decode(run_table(f, True, {})) == ([0], [0 - 1], [0], [-1])
    assert decode(run_table(ServedFile("empty.json", 0), True, {})) == ([], [], [], [])


def _served(primary: Path, mirror: Path, weights: list[float]) -> ServedFile:
    """The model file of a one-shard checkpoint, as the mount's catalogue builds it."""
    replicas = [Replica(0, str(primary), weights[0]), Replica(1, str(mirror), weights[1])]
    files = build_files(Tree(str(primary)), replicas)
    return next(f for f in files.values() if f.is_model)


def test_stripe_plan_spreads_big_keys_by_chunk_and_keeps_small_keys_whole(tmp_path: Path) -> None:
    primary, mirror = tmp_path / "p", tmp_path / "m"
    # experts of 3 projections x 1 MiB (striped) and shared experts of 128 KiB (kept whole)
    write_checkpoint(str(primary), "deepseek", layers=1, experts=4, hidden=1024, inter=1024, shards=1)
    shutil.copytree(primary, mirror)
    plans = []
    for _ in range(2):  # two catalogues of the same files: the same plan
        f = _served(primary, mirror, [3, 1])
        lay = f.layout
        assert lay is not None
        ends = [*lay.starts[1:], lay.size]
        plans.append([plan(f, [3.0, 1.0], True, s, e) for s, e in zip(lay.starts, ends, strict=True)])
        for k, s, e, runs, rot in zip(lay.keys, lay.starts, ends, plans[-1], f.stripes, strict=True):
            if isinstance(k, ExpertKey) and e - s >= CHUNK and rot >= 0:
                chunks = {(a // CHUNK, d) for a, b, d in runs}
                assert len({d for _, d in chunks}) == 2 or e - s < 4 * CHUNK  # both drives over 4 chunks
            if rot < 0:
                assert len(runs) == 1  # small keys whole on one drive
    assert plans[0] == plans[1]  # the same chunk goes to the same drive every time
    by_drive = [0, 0]  # bytes of the experts split about 3:1
    for runs, k in zip(plans[0], lay.keys, strict=True):
        if isinstance(k, ExpertKey):
            for a, b, d in runs:
                by_drive[d] += b - a
    assert by_drive[1] / sum(by_drive) == pytest.approx(0.25, abs=0.06)


def test_stripes_split_fused_experts_in_the_weights_ratio_to_within_a_chunk(tmp_path: Path) -> None:
    """Fused experts straddle chunks; with one rotation per file every stretch of striped bytes
    (the whole file, and each window a sweeping reader waits on) splits 3:1 to within a chunk or two.
    A rotation per key made each straddling chunk a coin toss: a 64 MiB window of a 3 GB model
    was off by ~2.5 MiB, and a sweep through the mount lost 9% of its speed."""
    primary, mirror = tmp_path / "p", tmp_path / "m"
    primary.mkdir()
    # 1.5 MiB per expert and projection: key boundaries fall inside chunks
    write_gguf(str(primary / "m.gguf"), "qwen3moe", layers=2, experts=16, hidden=1024, inter=768, qtype="F16")
    shutil.copytree(primary, mirror)
    f = _served(primary, mirror, [3, 1])
    plan_ = pieces(f, [3.0, 1.0], True, 0, f.size)
    striped = [(s, e, d) for s, e, d, x in plan_ if x >= 0 and f.stripes[x] >= 0]
    assert len(set(f.stripes) - {-1}) == 1  # one rotation per file
    total = sum(e - s for s, e, _ in striped)
    assert total > 100 * CHUNK
    window = 16 * CHUNK
    for lo in [*range(0, f.size, window), None]:
        inside = [(max(s, lo), min(e, lo + window), d) for s, e, d in striped] if lo is not None else striped
        got = [sum(e - s for s, e, d in inside if e > s and d == drive) for drive in (0, 1)]
        assert abs(got[1] - sum(got) / 4) <= 2 * CHUNK, (lo, got)


def test_stripe_plan_never_uses_a_drive_without_a_valid_copy(tmp_path: Path) -> None:
    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "deepseek", layers=1, experts=4, hidden=1024, inter=1024, shards=1)
    mirror.mkdir()  # the mirror lacks the file
    f = _served(primary, mirror, [1, 1])
    assert f.copies == (0,)
    weights = usable_weights([1.0, 1.0], set(f.copies))
    assert plan(f, weights, True, 0, f.size) == [(0, f.size, 0)]
    health = [Health(), Health()]
    assert Router([1.0, 1.0], True, health).drive_at(f, f.size // 2) == 0
