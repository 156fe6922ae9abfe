"""Page-cache readers (mmap, buffered) and the whole-extent buffer (native engine,
--extent-buffer-mib): the first request into a routed expert's extent reads all of the extent from
every drive at once, and the kernel's next requests there are answered from the buffer. The bytes
are always the primary's."""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import pytest

from colifs.formats.layout import ExpertKey
from tests.helpers import drop_file_cache, extents_of, fused_model, mounted
from tests.mount.test_faults import read_all, stats, through_faultfs

pytestmark = pytest.mark.mounts

PAGE = mmap.PAGESIZE
BUFFER = ("--extent-buffer-mib", "64")


@pytest.fixture
def fused(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Two layers of 4 fused experts, each three 2 MiB extents."""
    return fused_model(tmp_path, 2, 1024)


@pytest.fixture
def native_only(engine: str) -> None:
    if engine == "pyfuse3":
        pytest.skip("the extent buffer is the native engine's")


def buffer_of(m) -> dict:
    return m.stats()["extent_buffer"]


def test_page_cache_readers_are_answered_from_whole_extent_reads(fused, tmp_path: Path, native_only) -> None:
    """mmap faults through a whole fused model: every byte the primary's; each extent is read
    once, from both drives, and most of the kernel's requests are answered from the buffer."""
    primary, mirror, model = fused
    want = model.read_bytes()
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1", *BUFFER) as m:
        via = m.path / model.name
        drop_file_cache(via)
        with open(via, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert mm[:] == want
        st = m.stats()
        buf = st["extent_buffer"]
        extents = 2 * 3 * 4
        assert extents <= buf["stretches_read"] <= extents + 2, buf
        assert buf["requests_answered"] >= 4 * buf["stretches_read"], buf  # 2 MiB / 128 KiB a stretch
        assert buf["bytes_answered"] >= 0.9 * extents * (2 << 20), buf
        assert buf["stretches_not_started_buffer_full"] == 0
        assert all(r["bytes_served"] > (10 << 20) for r in st["replicas"])  # both drives read it
        read = sum(r["bytes_served"] for r in st["replicas"])
        assert read < 1.1 * len(want), (read, len(want))  # nothing read twice
        assert st["fallbacks"] == 0


def test_direct_readers_and_a_zero_buffer_never_use_it(fused, tmp_path: Path, native_only) -> None:
    primary, mirror, model = fused
    want = model.read_bytes()
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1", *BUFFER) as m:
        fd = os.open(m.path / model.name, os.O_RDONLY | os.O_DIRECT)
        try:
            got = mmap.mmap(-1, len(want) // PAGE * PAGE)
            os.preadv(fd, [got], 0)
        finally:
            os.close(fd)
        assert got[:] == want[: len(got)]
        assert buffer_of(m)["stretches_read"] == 0
    with mounted(primary, [mirror], tmp_path / "mnt2", "--weights", "1,1") as m:  # off by default
        drop_file_cache(m.path / model.name)
        assert (m.path / model.name).read_bytes() == want
        assert buffer_of(m)["stretches_read"] == 0 and buffer_of(m)["requests_answered"] == 0


def test_the_buffer_never_holds_more_than_its_bound(fused, tmp_path: Path, native_only) -> None:
    """Eight readers of different experts at once, a buffer of 4 MiB (two stretches): what it holds
    stays within 4 MiB; what finds it full is read as if there were no buffer, and right."""
    primary, mirror, model = fused
    want = model.read_bytes()
    spans = [s for e in range(4) for s in extents_of(model, ExpertKey("blk", 1, e))]
    held, errors = [], []
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1", "--extent-buffer-mib", "4") as m:
        via = m.path / model.name
        drop_file_cache(via)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                held.append(buffer_of(m)["bytes_held"])
                time.sleep(0.002)

        def read(a: int, b: int) -> None:
            with open(via, "rb", buffering=0) as f:
                f.seek(a)
                if f.read(b - a) != want[a:b]:
                    errors.append((a, b))

        sampler = threading.Thread(target=sample)
        sampler.start()
        readers = [threading.Thread(target=read, args=span) for span in spans[:8]]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        done.set()
        sampler.join()
        assert not errors
        assert max(held) <= 4 << 20, max(held)
        buf = buffer_of(m)
        assert buf["stretches_read"] >= 2 and buf["bytes_held"] <= 4 << 20, buf


def test_one_touch_does_not_pin_the_rest_for_long(fused, tmp_path: Path, native_only) -> None:
    primary, mirror, model = fused
    want = model.read_bytes()
    a = extents_of(model, ExpertKey("blk", 0, 1))[0][0]
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1", *BUFFER) as m:
        via = m.path / model.name
        drop_file_cache(via)
        first = -(-a // PAGE) * PAGE
        with open(via, "rb", buffering=0) as f:
            f.seek(first)
            assert f.read(PAGE) == want[first : first + PAGE]  # one page of a 2 MiB extent
            assert buffer_of(m)["bytes_held"] >= 1 << 20
            deadline = time.monotonic() + 10  # a stretch unused for 1 s goes at the next request
            while buffer_of(m)["bytes_held"] and time.monotonic() < deadline:
                time.sleep(0.5)
                drop_file_cache(via)
                f.seek(0)
                assert f.read(PAGE) == want[:PAGE]  # any page-cache request lets stale stretches go
        assert buffer_of(m)["bytes_held"] == 0


@pytest.mark.daemon_warns("reading from the primary instead", "went down")
@pytest.mark.parametrize("flags", [BUFFER, ()], ids=["buffer", "plain"])
def test_a_mirror_failing_mid_extent_is_read_from_the_primary(tmp_path: Path, native_only, flags) -> None:
    """Errors, short reads and a hang (past --mirror-timeout) on the mirror while page-cache readers
    go through the buffer (or without it): every byte the primary's, the failures counted."""
    with through_faultfs(tmp_path, "--mirror-timeout", "1", *flags) as (primary, mnt, control):
        shards = sorted(primary.glob("*.safetensors"))
        for fault in ("ok", "eio", "short", "hang"):
            control.write_text(fault)
            before = stats(mnt)
            for p in shards:
                drop_file_cache(mnt / p.name)
                assert (mnt / p.name).read_bytes() == p.read_bytes(), (fault, p.name)
            after = stats(mnt)
            if flags:
                assert (
                    after["extent_buffer"]["requests_answered"] > before["extent_buffer"]["requests_answered"]
                )
            if fault != "ok":
                assert (
                    after["fallbacks"] > before["fallbacks"]
                    or after["replicas"][1]["health"]["state"] != "up"
                )
            control.write_text("ok")
        read_all(mnt, primary)
