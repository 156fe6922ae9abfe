"""colifs bench's pure parts: expert discovery and expert choice."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from colifs.bench import _Chooser, find_experts
from colifs.formats.layout import ExpertKey
from colifs.synth import write_checkpoint


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "p"
    write_checkpoint(str(root), "deepseek", layers=2, experts=8, hidden=64, inter=64, shards=3)
    return root


def test_find_experts_groups_every_tensor_of_an_expert(ckpt: Path) -> None:
    experts = {e.key: e for e in find_experts(str(ckpt))}
    # 2 main layers + 1 MTP layer, 8 experts each
    assert len(experts) == 3 * 8
    assert ExpertKey("mtp.layers", 0, 7) in experts
    e = experts[ExpertKey("model.layers", 1, 3)]
    assert len(e.ranges) == 6  # gate/up/down weights + their scales
    assert e.nbytes == 3 * 64 * 64 + 3 * 4


def test_uniform_choice_reads_every_expert_once_before_any_twice() -> None:
    choose = _Chooser(50, 0.0, seed=1)
    rng = random.Random(0)
    first = [choose(rng) for _ in range(50)]
    assert sorted(first) == list(range(50))
    assert choose.passes == 0
    choose(rng)
    assert choose.passes == 1


def test_zipf_choice_is_skewed() -> None:
    choose = _Chooser(100, 1.2, seed=1)
    rng = random.Random(0)
    counts = Counter(choose(rng) for _ in range(20000))
    top = counts.most_common(10)
    assert sum(n for _, n in top) > 0.5 * 20000
