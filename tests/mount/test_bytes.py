"""Bytes through a real mount: every way of reading returns the primary's bytes (both engines)."""

from __future__ import annotations

import mmap
import os
import random
import shutil
import threading
from pathlib import Path

import pytest
from safetensors import safe_open

from colifs.backing import BLOCK
from colifs.synth import FAMILIES, write_checkpoint
from tests.helpers import (
    expert_spans,
    mounted,
    read_direct,
    shards,
)

pytestmark = pytest.mark.mounts  # every test here runs on both engines


@pytest.mark.parametrize(
    ("backing", "routing"), [("direct", "stripe"), ("buffered", "stripe"), ("direct", "expert")]
)
def test_every_access_method_returns_the_primary_bytes(model, backing, routing) -> None:
    primary, mirror, mnt = model
    with mounted(
        primary, [mirror], mnt, "--weights", "1,1", "--backing-io", backing, "--routing", routing
    ) as m:
        rng = random.Random(7)
        for p in sorted(primary.iterdir()):
            want = p.read_bytes()
            via = mnt / p.name
            assert via.read_bytes() == want  # whole file, buffered
            with open(via, "rb", buffering=0) as f:  # random ranges crossing tensor boundaries
                for _ in range(50):
                    off = rng.randrange(len(want))
                    size = rng.randrange(1, 400_000)
                    assert os.pread(f.fileno(), size, off) == want[off : off + size]
            with open(via, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                for _ in range(50):  # page faults at random places, like llama.cpp
                    off = rng.randrange(len(want))
                    assert mm[off : off + 5000] == want[off : off + 5000]
            for _ in range(20):
                off = rng.randrange(len(want))
                size = rng.randrange(1, 3 << 20)
                assert read_direct(via, off, size) == want[off : off + size]
        st = m.stats()
        assert st["fallbacks"] == 0
        assert all(r["bytes_served"] > 0 for r in st["replicas"])


def test_o_direct_readers_aligning_to_st_blksize_read_what_they_need(model) -> None:
    """llama.cpp's direct-I/O load rounds every tensor read out to st_blksize: the mount reports the
    page size, as ext4 does, so it reads the same bytes through the mount as from the drive (at
    1 MiB it read 5% more, and each small tensor as a whole MiB)."""
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        spans = [s for per_key in expert_spans(primary).values() for s in per_key]
        before = sum(r["bytes_served"] for r in m.stats()["replicas"])
        asked = 0
        for name, start, end in spans[:20]:
            via = mnt / name
            align = os.stat(via).st_blksize
            assert align == BLOCK
            a, b = start // align * align, -(-end // align) * align  # what llama.cpp reads
            assert read_direct(via, a, b - a)[start - a : end - a] == (primary / name).read_bytes()[start:end]
            asked += end - start
        served = sum(r["bytes_served"] for r in m.stats()["replicas"]) - before
        assert asked <= served <= asked + 20 * 2 * BLOCK


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_safe_open_through_the_mount_gives_the_same_arrays(tmp_path: Path, family: str) -> None:
    primary, mirror, mnt = tmp_path / "p", tmp_path / "m", tmp_path / "mnt"
    write_checkpoint(str(primary), family, layers=2, experts=8, hidden=64, inter=64, shards=2)
    shutil.copytree(primary, mirror)
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        for p in shards(primary):
            with safe_open(p, "numpy") as a, safe_open(mnt / p.name, "numpy") as b:
                assert sorted(a.keys()) == sorted(b.keys())
                assert a.metadata() == b.metadata()
                for k in a.keys():  # noqa: SIM118 (safe_open is not iterable)
                    x, y = a.get_tensor(k), b.get_tensor(k)
                    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k
        assert all(r["bytes_served"] > 0 for r in m.stats()["replicas"])


def test_many_threads_opening_and_reading_at_once(model) -> None:
    primary, mirror, mnt = model
    files = shards(primary)
    want = {p.name: p.read_bytes() for p in files}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        rng = random.Random(k)
        try:
            for _ in range(20):
                name = rng.choice(list(want))
                off = rng.randrange(len(want[name]))
                assert read_direct(mnt / name, off, 1 << 20) == want[name][off : off + (1 << 20)]
        except BaseException as e:
            errors.append(e)

    with mounted(primary, [mirror], mnt):
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
