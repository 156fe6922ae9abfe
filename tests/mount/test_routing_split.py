"""Routing through a real mount: keys and bytes split as the weights say, the same key on the same
drive across mounts, every mirror serving, one expert striped over both drives."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from colifs.synth import write_checkpoint
from tests.helpers import (
    drive_of_each_expert,
    expert_ranges,
    mounted,
    read_direct,
    shards,
)

pytestmark = pytest.mark.mounts  # every test here runs on both engines


@pytest.fixture
def many_experts(tmp_path: Path):
    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "mixtral", layers=2, experts=64, hidden=128, inter=64, shards=2)
    shutil.copytree(primary, mirror)
    return primary, mirror, tmp_path


@pytest.mark.parametrize("weights", [(1, 1), (3, 1)])
def test_split_of_keys_and_bytes_follows_the_weights(many_experts, weights) -> None:
    primary, mirror, tmp = many_experts
    share = weights[1] / sum(weights)
    ranges = expert_ranges(primary)
    with mounted(
        primary, [mirror], tmp / "mnt", "--weights", ",".join(map(str, weights)), "--routing", "expert"
    ) as m:
        where = drive_of_each_expert(m, ranges)
        per_layer: dict[int, list[int]] = {}
        for (_, key), drive in where.items():
            per_layer.setdefault(key.layer, []).append(drive)
        for drives in per_layer.values():  # exact quota per layer: within one expert
            assert abs(sum(drives) - share * len(drives)) <= 1
        for p in shards(primary):  # every byte once, through O_DIRECT
            read_direct(m.path / p.name, 0, p.stat().st_size)
        st = m.stats()["replicas"]
        total = st[0]["bytes_served"] + st[1]["bytes_served"]
        # Tolerance: experts are split exactly; the few name-keyed tensors (attention, router,
        # embeddings; ~5% of the bytes) land by hash.
        assert st[1]["bytes_served"] / total == pytest.approx(share, abs=0.04)


def test_same_key_same_drive_across_two_mounts(many_experts) -> None:
    primary, mirror, tmp = many_experts
    ranges = expert_ranges(primary)
    runs = []
    for _ in range(2):
        with mounted(primary, [mirror], tmp / "mnt", "--weights", "3,1", "--routing", "expert") as m:
            runs.append(drive_of_each_expert(m, ranges))
    assert runs[0] == runs[1]


def test_two_mirrors_all_serve(tmp_path: Path) -> None:
    primary = tmp_path / "p"
    write_checkpoint(str(primary), "qwen3", layers=2, experts=32, hidden=64, inter=64, shards=2)
    mirrors = [tmp_path / "m1", tmp_path / "m2"]
    for m in mirrors:
        shutil.copytree(primary, m)
    with mounted(primary, mirrors, tmp_path / "mnt", "--weights", "1,1,1") as m:
        for p in shards(primary):
            assert read_direct(m.path / p.name, 0, p.stat().st_size) == p.read_bytes()
        st = m.stats()
        assert [r["role"] for r in st["replicas"]] == ["primary", "mirror", "mirror"]
        shares = [r["byte_share"] for r in st["replicas"]]
        assert all(s == pytest.approx(1 / 3, abs=0.08) for s in shares), shares
        assert (m.path / ".colifs" / "stats").read_text().startswith("MIRROR: primary ")
        assert " | mirror1 " in (m.path / ".colifs" / "stats").read_text()


def test_stripe_routing_reads_one_expert_from_both_drives(tmp_path: Path) -> None:
    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "mixtral", layers=1, experts=8, hidden=1024, inter=1024, shards=1)
    shutil.copytree(primary, mirror)
    ranges = expert_ranges(primary)
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "3,1", "--routing", "stripe") as m:
        assert m.stats()["routing"] == "stripe"
        for (name, _), spans in sorted(ranges.items())[:4]:  # experts of 3 x 2 MiB (fp16 1024 x 1024)
            before = [r["bytes_served"] for r in m.stats()["replicas"]]
            for s, e in spans:
                assert read_direct(m.path / name, s, e - s) == (primary / name).read_bytes()[s:e]
            after = [r["bytes_served"] for r in m.stats()["replicas"]]
            moved = [b - a for a, b in zip(before, after, strict=True)]
            assert all(x > 0 for x in moved)  # one expert, both drives
            assert moved[1] / sum(moved) == pytest.approx(0.25, abs=0.1)
