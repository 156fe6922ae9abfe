"""A DBRX-shaped checkpoint (row-fused experts) loads through a mount as a Mixtral-shaped one does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def backing_reads_per_mb(tmp_path: Path, family: str) -> float:
    """Load every tensor with safe_open through a mount (cold caches); backing reads per MB served."""
    from safetensors import safe_open

    from colifs.synth import write_checkpoint
    from tests.helpers import drop_file_cache, mounted

    primary, mirror = tmp_path / f"{family}-p", tmp_path / f"{family}-m"
    write_checkpoint(str(primary), family, layers=2, experts=8, hidden=512, inter=256, shards=1)
    shutil.copytree(primary, mirror)
    with mounted(primary, [mirror], tmp_path / f"{family}-mnt", "--weights", "1,1") as m:
        for p in primary.glob("*.safetensors"):
            drop_file_cache(m.path / p.name)
            with safe_open(str(m.path / p.name), "np") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    f.get_tensor(name)
        replicas = m.stats()["replicas"]
    return sum(r["reads"] for r in replicas) / (sum(r["bytes_served"] for r in replicas) / 1e6)


@pytest.mark.mounts
def test_a_dbrx_checkpoint_reads_like_a_mixtral_one_through_the_mount(tmp_path: Path) -> None:
    dbrx, mixtral = backing_reads_per_mb(tmp_path, "dbrx"), backing_reads_per_mb(tmp_path, "mixtral")
    print(f"backing reads per MB with safe_open: DBRX-shaped {dbrx:.1f}, Mixtral-shaped {mixtral:.1f}")
    # 9.0 against 8.6 on an idle machine (docs/benchmarks.md): DBRX stores an expert as three
    # separate slices (of w1, v1, w2), so a read meets more expert boundaries per MB. The count
    # depends on the kernel's readahead timing (under load: 15.5 against 8.6); the bug this guards
    # against (its rows keyed as "experts") gave 11x.
    assert dbrx <= mixtral * 3
