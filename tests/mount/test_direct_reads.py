"""--direct-reads (native engine): the read calls of page-cache opens reach the daemon as they are
(FUSE direct I/O), their fills wait for the calls after them instead of going into the page cache,
and what the engine maps still goes through the page cache. The bytes are always the primary's."""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from pathlib import Path

import pytest

from colifs.formats.layout import ExpertKey
from tests.helpers import daemon_files, drop_file_cache, extents_of, fused_model, mounted
from tests.mount.test_page_cache import EXPERT, UNTIMED, fills_of, settled

pytestmark = pytest.mark.mounts

DIRECT = (*UNTIMED, "--direct-reads")
HOLD_S = 0.1  # native/fill.c HOLD_NS: a read call's fill waits this long for the calls after it


@pytest.fixture
def fused(tmp_path: Path, engine: str) -> tuple[Path, Path, Path]:
    """Two layers of 4 fused experts, each three 2 MiB extents (native engine only)."""
    if engine == "pyfuse3":
        pytest.skip("--direct-reads is the native engine's")
    return fused_model(tmp_path, 2, 1024)


def test_read_calls_come_as_they_are_and_every_byte_is_right(fused, tmp_path: Path) -> None:
    """Read calls at odd offsets and sizes, whole experts from their first byte, and four readers at
    once: every byte the primary's, each call counted as it was made, none of it stored into the
    page cache, and no fill left holding memory."""
    primary, mirror, model = fused
    want = model.read_bytes()
    rng = random.Random(7)
    calls = [(rng.randrange(len(want)), rng.randrange(1, 3 << 20)) for _ in range(60)]
    for layer in range(2):
        for x in range(4):
            calls += [(s, e - s) for s, e in extents_of(model, ExpertKey("blk", layer, x))]
    with mounted(primary, [mirror], tmp_path / "mnt", *DIRECT) as m:
        assert m.stats()["passthrough"]["direct_reads_at_init"] == 1
        via = m.path / model.name
        errors: list[str] = []
        asked = sum(min(n, len(want) - at) for at, n in calls)

        def read(part: list[tuple[int, int]]) -> None:
            fd = os.open(via, os.O_RDONLY)
            try:
                for at, n in part:
                    if os.pread(fd, n, at) != want[at : at + n]:
                        errors.append(f"{at}+{n}")
            finally:
                os.close(fd)

        readers = [threading.Thread(target=read, args=(calls[i::4],)) for i in range(4)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        assert not errors
        fills = settled(m)
        assert fills["read_call_bytes"] == asked, (fills["read_call_bytes"], asked)
        assert fills["fills_started"] > 0 and fills["bytes_answered"] > 0, fills
        assert fills["bytes_stored"] == 0 and fills["bytes_held"] == 0, fills
        assert m.stats()["fallbacks"] == 0


def test_what_a_reader_maps_still_goes_through_the_page_cache(fused, tmp_path: Path) -> None:
    """A mapping of an open whose read calls come direct: its faults are the page cache's requests
    (no read call counted), answered or stored by fills as without --direct-reads."""
    primary, mirror, model = fused
    want = model.read_bytes()
    with mounted(primary, [mirror], tmp_path / "mnt", *DIRECT) as m:
        via = m.path / model.name
        drop_file_cache(via)
        with open(via, "rb") as f, mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mm:
            assert mm[:] == want
            assert f.read(1 << 20) == want[: 1 << 20]  # the same open's read call
        fills = settled(m)
        assert fills["read_call_bytes"] == 1 << 20, fills
        assert fills["bytes_stored"] + fills["bytes_answered"] >= 0.9 * 8 * EXPERT, fills


def test_a_read_calls_fill_drops_what_no_call_asks_for(fused, tmp_path: Path) -> None:
    """A read call from an expert's first byte starts a fill of the whole expert; a reader that
    reads only that extent leaves the other two, which are dropped once the fill has waited its
    time, with no request coming to sweep it: the memory comes back."""
    primary, mirror, model = fused
    want = model.read_bytes()
    spans = extents_of(model, ExpertKey("blk", 0, 1))
    assert len(spans) == 3
    with mounted(primary, [mirror], tmp_path / "mnt", *DIRECT) as m:
        via = m.path / model.name
        s, e = spans[0]
        with open(via, "rb", buffering=0) as f:
            f.seek(s)
            assert f.read(e - s) == want[s:e]
            time.sleep(HOLD_S * 3)
            fills = fills_of(m)
            assert fills["fills_started"] == 1 and fills["fills_from_first_page"] == 1, fills
            assert fills["bytes_held"] == 0, fills
            assert fills["bytes_dropped_unasked"] >= 2 * (e - s) - 8192, fills
            f.seek(spans[1][0])  # read later: from the drives (their own page caches), right
            assert f.read(e - s) == want[spans[1][0] : spans[1][0] + e - s]


def test_the_drives_files_close_once_the_reader_is_done(fused, tmp_path: Path) -> None:
    """Read calls read the drives through buffered twins of the daemon's O_DIRECT descriptors: once
    the reader closed the file and its fills are gone, the daemon holds no descriptor of either
    drive's file (nothing keeps a mirror's filesystem busy)."""
    primary, mirror, model = fused
    want = model.read_bytes()
    with mounted(primary, [mirror], tmp_path / "mnt", *DIRECT) as m:
        pid = m.stats()["pid"]

        def held() -> list[str]:
            links = daemon_files(pid).values()
            return [x for x in links if x.startswith((f"{primary}/", f"{mirror}/"))]

        with open(m.path / model.name, "rb") as f:
            assert f.read() == want
            assert held(), "read calls hold the drives' files open while the reader does"
        deadline = time.monotonic() + 10
        while held() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held() == []


def test_without_the_flag_read_calls_go_through_the_page_cache(fused, tmp_path: Path) -> None:
    """The default: read calls are the page cache's, none counted as a read call."""
    primary, mirror, model = fused
    with mounted(primary, [mirror], tmp_path / "mnt", *UNTIMED) as m:
        assert (m.path / model.name).read_bytes() == model.read_bytes()
        assert m.stats()["passthrough"]["direct_reads_at_init"] == 0
        assert fills_of(m)["read_call_bytes"] == 0


def test_a_file_read_through_in_calls_reads_each_extent_once(fused, tmp_path: Path) -> None:
    """A reader that reads the file through in 1 MiB calls (cp, a checksum, an engine's fread of
    its tensors) enters each expert's extents mid-way or crosses into them: the call that does
    starts a fill of the rest of that extent (no lead for the next call to outrun, none of the
    key's other extents, which such a reader reaches much later), so the fills answer nearly every
    byte and drop next to nothing (before: half the bytes answered, 46% of what fills read dropped)."""
    primary, mirror, model = fused
    want = model.read_bytes()
    with mounted(primary, [mirror], tmp_path / "mnt", *DIRECT) as m:
        with open(m.path / model.name, "rb", buffering=0) as f:
            got = b"".join(iter(lambda: f.read(1 << 20), b""))
        assert got == want
        fills = settled(m)
        extents = 2 * 4 * 3
        assert 0 < fills["fills_started"] <= extents + 4, fills
        assert fills["bytes_answered"] >= 0.85 * len(want), fills
        assert fills["bytes_dropped_unasked"] <= 0.05 * len(want), fills
        assert fills["bytes_held"] == 0 and fills["bytes_stored"] == 0, fills
