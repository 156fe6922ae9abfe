"""colifs bench on real directories and on a mount."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from colifs.synth import write_checkpoint
from tests.helpers import mounted, run_colifs


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "p"
    write_checkpoint(str(root), "deepseek", layers=2, experts=8, hidden=64, inter=64, shards=3)
    return root


@pytest.mark.mounts
def test_bench_command_on_directories_and_on_a_mount(ckpt: Path, tmp_path: Path) -> None:
    out = run_colifs("bench", str(ckpt), "--seconds", "0.5", "--threads", "2", "--json", "--warm")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["experts"] > 0 and r["bytes"] > 0 and r["experts_total"] == 24
    mirror = tmp_path / "m"
    shutil.copytree(ckpt, mirror)
    for mode in ("--odirect", "--buffered", "--mmap"):
        out = run_colifs(
            "bench", str(ckpt), str(mirror), "--weights", "3,1", "--seconds", "0.3", mode, "--warm"
        )
        assert out.returncode == 0, out.stderr
        assert "GB/s" in out.stdout and "experts/s" in out.stdout
    with mounted(ckpt, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        out = run_colifs("bench", str(m.path), "--seconds", "0.5", "--json", "--warm")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["bytes"] > 0
        assert all(r["bytes_served"] > 0 for r in m.stats()["replicas"])
