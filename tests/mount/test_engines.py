"""The two engines held to one routing: every block read through a native mount and through a
pyfuse3 mount of the same model is served by the same drives, byte for byte; and the engine is
chosen with one clear error for a bad choice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from colifs.config import ENGINES
from colifs.synth import write_checkpoint
from tests.helpers import mounted, read_direct, run_colifs, shards


def served_by_drive(mnt: Path) -> list[int]:
    return [r["bytes_served"] for r in json.loads((mnt / ".colifs" / "stats.json").read_text())["replicas"]]


def bytes_per_drive_of_each_read(mnt: Path, primary: Path, block: int, shift: int) -> list[tuple[int, ...]]:
    """Read every shard in `block`-sized O_DIRECT reads from `shift` on; per read, the bytes each
    drive served (the reads are checked against the primary)."""
    out = []
    for p in shards(primary):
        data = p.read_bytes()
        for off in range(shift, len(data), block):
            before = served_by_drive(mnt)
            assert read_direct(mnt / p.name, off, block) == data[off : off + block]
            out.append(tuple(b - a for a, b in zip(before, served_by_drive(mnt), strict=True)))
    return out


@pytest.fixture
def big_experts(tmp_path: Path) -> tuple[Path, list[Path]]:
    """3 MiB experts: over two chunks, so stripe routing cuts them."""
    primary = tmp_path / "p"
    write_checkpoint(str(primary), "deepseek", layers=2, experts=4, hidden=1024, inter=1024, shards=2)
    mirrors = [tmp_path / "m1", tmp_path / "m2"]
    for m in mirrors:
        shutil.copytree(primary, m)
    return primary, mirrors


@pytest.mark.parametrize(
    ("mirrors", "weights", "routing"), [(1, "3,1", "stripe"), (1, "3,1", "expert"), (2, "2,1,1", "stripe")]
)
def test_both_engines_serve_every_byte_from_the_same_drive(big_experts, tmp_path, mirrors, weights, routing):
    primary, all_mirrors = big_experts
    seen = {}
    for engine in ENGINES:
        flags = ("--weights", weights, "--routing", routing, "--engine", engine, "--no-usage")
        with mounted(primary, all_mirrors[:mirrors], tmp_path / "mnt", *flags) as m:
            assert m.stats()["engine"] == engine
            seen[engine] = [
                *bytes_per_drive_of_each_read(m.path, primary, 1 << 20, 0),  # aligned requests
                *bytes_per_drive_of_each_read(m.path, primary, 300_000, 3_000),  # unaligned: snapped runs
            ]
            assert m.stats()["fallbacks"] == 0
    assert seen["native"] == seen["pyfuse3"]
    assert all(sum(1 for x in row if x) >= 1 for row in seen["native"])
    assert all(sum(col) > 0 for col in zip(*seen["native"], strict=True))  # every drive served


def test_a_bad_engine_from_the_environment_is_one_line(model) -> None:
    primary, mirror, mnt = model
    out = run_colifs("mount", str(primary), str(mirror), str(mnt), env={"COLIFS_ENGINE": "rust"})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "colifs: error: $COLIFS_ENGINE='rust': not one of native, pyfuse3"
    ]
