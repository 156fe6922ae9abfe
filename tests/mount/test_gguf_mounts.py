"""GGUF models through a mount: whole, split and divergent files."""

from __future__ import annotations

import mmap
import shutil
from pathlib import Path

import pytest

from colifs.formats.layout import ExpertKey
from tests.helpers import (
    drive_of_each_expert,
    expert_ranges,
    mounted,
)

pytestmark = pytest.mark.mounts  # every test here runs on both engines


def assert_same_gguf(direct: Path, via: Path) -> None:
    """gguf's reader sees the same tensors both ways (its maps are gone on return: the mount is
    not held busy by them)."""
    import gguf

    a, b = gguf.GGUFReader(str(direct)), gguf.GGUFReader(str(via))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert x.tensor_type == y.tensor_type and bytes(x.data) == bytes(y.data), x.name


def test_gguf_models_through_the_mount(tmp_path: Path) -> None:

    from colifs.synth import write_gguf

    primary, mirror = tmp_path / "p", tmp_path / "m"
    primary.mkdir()
    write_gguf(
        str(primary / "qwen3-moe-Q8_0.gguf"),
        "qwen3moe",
        layers=2,
        experts=16,
        hidden=256,
        inter=128,
        qtype="Q8_0",
    )
    write_gguf(
        str(primary / "ds-F16.gguf"), "deepseek2", layers=2, experts=16, hidden=128, inter=128, qtype="F16"
    )
    shutil.copytree(primary, mirror)
    ranges = expert_ranges(primary)
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1", "--routing", "expert") as m:
        for p in sorted(primary.glob("*.gguf")):
            via = m.path / p.name
            assert_same_gguf(p, via)
            want = p.read_bytes()
            with open(via, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                assert mm[:] == want
        where = drive_of_each_expert(m, ranges)  # each expert slice of the fused tensors: one drive
        assert set(where.values()) == {0, 1}
        assert {k for _, k in where} >= {ExpertKey("blk", 1, e) for e in range(16)}
        assert m.stats()["files"]["ds-F16.gguf"]["replicas"] == [str(primary), str(mirror)]


@pytest.mark.daemon_warns("malformed header", "served without this mirror")
def test_bad_and_divergent_gguf_files(tmp_path: Path) -> None:
    from colifs.synth import write_gguf

    primary, mirror = tmp_path / "p", tmp_path / "m"
    primary.mkdir()
    write_gguf(str(primary / "good.gguf"), "qwen3moe", layers=1, experts=8, qtype="F16")
    good = (primary / "good.gguf").read_bytes()
    (primary / "cut.gguf").write_bytes(good[:100])  # header cut short
    (primary / "zero.gguf").write_bytes(b"")
    shutil.copytree(primary, mirror)
    blob = bytearray(good)  # same size, a byte of the metadata changed
    i = blob.index(b"qwen3moe")
    blob[i] = ord("Q")
    (mirror / "good.gguf").write_bytes(blob)
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        lines = m.stderr.splitlines()
        assert any("cut.gguf" in x and "malformed header" in x and "does not fit" in x for x in lines)
        assert any("zero.gguf" in x and "malformed header" in x and "bad magic" in x for x in lines)
        assert any("good.gguf" in x and "header differs" in x for x in lines)
        for name in ("cut.gguf", "zero.gguf", "good.gguf"):
            assert (m.path / name).read_bytes() == (primary / name).read_bytes()
            assert m.stats()["files"][name]["replicas"] == [str(primary)]
        assert m.stats()["replicas"][1]["bytes_served"] == 0


def test_split_gguf_files_are_each_parsed_and_routed(tmp_path: Path) -> None:

    from colifs.synth import write_gguf

    primary, mirror = tmp_path / "p", tmp_path / "m"
    primary.mkdir()
    write_gguf(str(primary / "model.gguf"), "qwen3moe", layers=4, experts=8, qtype="F16", split_max_tensors=7)
    parts = sorted(primary.glob("*.gguf"))
    assert len(parts) >= 3 and all("-of-" in p.name for p in parts)
    shutil.copytree(primary, mirror)
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        st = m.stats()
        for p in parts:
            assert st["files"][p.name]["replicas"] == [str(primary), str(mirror)]
            assert_same_gguf(p, m.path / p.name)
        assert all(r["bytes_served"] > 0 for r in m.stats()["replicas"])
