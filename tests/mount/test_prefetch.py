"""Expert prefetch (--prefetch expert, native engine): a page-cache reader's first touch of a
routed expert reads the whole expert, from both drives, into the page cache; nothing past it."""

from __future__ import annotations

import mmap
import os
import shutil
import time
from pathlib import Path

import pytest

from colifs.formats import format_of
from colifs.layout import ExpertKey
from colifs.synth import write_checkpoint, write_gguf
from tests.helpers import drop_file_cache, mounted

pytestmark = pytest.mark.mounts

PAGE = mmap.PAGESIZE
PREFETCHING = ("--weights", "1,1", "--prefetch", "expert")


def extents_of(path: Path, key: ExpertKey) -> list[tuple[int, int]]:
    fmt = format_of(path.name)
    assert fmt is not None
    return [(s, e) for s, e, k in fmt.read(str(path))[2].extents() if k == key]


def expert_span(path: Path, key: ExpertKey) -> tuple[int, int]:
    spans = extents_of(path, key)
    return spans[0][0], spans[-1][1]


def wait_stored(m, at_least: int) -> dict:
    deadline = time.monotonic() + 10  # the stores run after the reply, on their own thread
    while (st := m.stats())["prefetch"]["bytes_stored_ahead"] < at_least:
        assert time.monotonic() < deadline, st["prefetch"]
        time.sleep(0.01)
    return st


def drive_reads(m) -> tuple[int, int]:
    st = m.stats()
    return sum(r["reads"] for r in st["replicas"]), sum(r["bytes_served"] for r in st["replicas"])


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, Path, Path]:
    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "mixtral", layers=2, experts=4, hidden=1024, inter=512, shards=1)
    shutil.copytree(primary, mirror)
    return primary, mirror, next(primary.glob("*.safetensors"))


@pytest.mark.daemon_warns("needs the native engine")
def test_a_fault_inside_an_expert_brings_in_the_whole_expert(checkpoint, tmp_path: Path, engine: str) -> None:
    primary, mirror, shard = checkpoint
    a, b = expert_span(shard, ExpertKey("model.layers", 1, 2))  # 3 MiB, 3 tensors
    want = shard.read_bytes()
    with mounted(primary, [mirror], tmp_path / "mnt", *PREFETCHING) as m:
        if engine == "pyfuse3":
            assert "--prefetch expert needs the native engine" in m.stderr
            assert m.stats()["prefetch"] == {}
            return
        via = m.path / shard.name
        drop_file_cache(via)
        reads0, bytes0 = drive_reads(m)
        with open(via, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            middle = (a + b) // 2 // PAGE * PAGE
            assert mm[middle : middle + 1] == want[middle : middle + 1]  # one fault, mid-expert
            assert m.stats()["prefetch"]["prefetches"] == 1  # counted before the fault returns
            st = wait_stored(m, b - a - 2 * PAGE - (128 << 10))
            reads1, bytes1 = drive_reads(m)
            # The rest of the expert came with it: touching every page of it reaches no drive (the
            # pages it shares with its neighbours at its two ends are theirs as much as its own).
            inner_a, inner_b = -(-a // PAGE) * PAGE, b // PAGE * PAGE
            assert mm[inner_a:inner_b] == want[inner_a:inner_b]
            assert drive_reads(m)[0] == reads1
            stored = st["prefetch"]["bytes_stored_ahead"]
            assert b - a - 2 * PAGE - (128 << 10) <= stored <= b - a
            assert bytes1 - bytes0 <= (b - a) + (256 << 10)  # never far past the expert's ends
            assert {r["bytes_served"] > 0 for r in st["replicas"]} == {True}  # from both drives
            # Every byte of the file is still the primary's, prefetched or not.
            assert mm[:] == want
        assert reads1 > reads0


@pytest.mark.daemon_warns("needs the native engine")
def test_o_direct_readers_never_prefetch(checkpoint, tmp_path: Path, engine: str) -> None:
    primary, mirror, shard = checkpoint
    a, b = expert_span(shard, ExpertKey("model.layers", 0, 1))
    with mounted(primary, [mirror], tmp_path / "mnt", *PREFETCHING) as m:
        fd = os.open(m.path / shard.name, os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, 1 << 20)
            os.preadv(fd, [buf], (a + b) // 2 // PAGE * PAGE)
        finally:
            os.close(fd)
        assert m.stats()["prefetch"].get("prefetches", 0) == 0


def test_prefetch_is_off_by_default(checkpoint, tmp_path: Path, engine: str) -> None:
    primary, mirror, shard = checkpoint
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        drop_file_cache(m.path / shard.name)
        assert (m.path / shard.name).read_bytes() == shard.read_bytes()
        assert m.stats()["prefetch"].get("prefetches", 0) == 0


def fused_model(tmp_path: Path, layers: int, inter: int) -> tuple[Path, Path, Path]:
    """(primary, mirror, model): a GGUF of 4 fused experts per layer, each three extents of
    `inter` KiB x 2, one in each of three tensors."""
    primary, mirror = tmp_path / "p", tmp_path / "m"
    primary.mkdir()
    write_gguf(
        str(primary / "m.gguf"), "qwen3moe", layers=layers, experts=4, hidden=1024, inter=inter, qtype="F16"
    )
    shutil.copytree(primary, mirror)
    return primary, mirror, primary / "m.gguf"


@pytest.fixture
def fused(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Each expert three 1 MiB extents."""
    return fused_model(tmp_path, 1, 512)


def test_each_extent_of_a_fused_expert_is_prefetched_and_a_fault_prefetches_its_own(
    fused, tmp_path: Path, engine: str
) -> None:
    """The extent prefetched is the faulting page's, not the one the read-around window starts in;
    and every extent of an expert is prefetched at its first touch (not only the first extent)."""
    if engine == "pyfuse3":
        pytest.skip("prefetch is the native engine's")
    primary, mirror, model = fused
    want = model.read_bytes()
    gate, up, down = extents_of(model, ExpertKey("blk", 0, 2))
    with mounted(primary, [mirror], tmp_path / "mnt", *PREFETCHING) as m:
        via = m.path / model.name
        drop_file_cache(via)
        with open(via, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            stored = 0
            for n, (a, b) in enumerate((gate, up, down), 1):
                first = -(-a // PAGE) * PAGE  # the extent's first whole page: the window starts before it
                assert mm[first : first + 1] == want[first : first + 1]
                assert m.stats()["prefetch"]["prefetches"] == n
                st = wait_stored(m, stored + (b - a) - 2 * PAGE - (128 << 10))
                stored = st["prefetch"]["bytes_stored_ahead"]
                reads = drive_reads(m)[0]
                assert mm[first : b // PAGE * PAGE] == want[first : b // PAGE * PAGE]
                assert drive_reads(m)[0] == reads  # the whole extent came with the first fault
            assert mm[:] == want
