"""colifs bench on directories that are not a model: one clear error."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import run_colifs


def test_bench_refuses_a_directory_without_experts(tmp_path: Path) -> None:
    out = run_colifs("bench", str(tmp_path), "--seconds", "0.1")
    assert out.returncode == 2 and "no routed MoE expert tensors" in out.stderr
    out = run_colifs("bench", str(tmp_path / "nope"))
    assert out.returncode == 2 and "is not a directory" in out.stderr
