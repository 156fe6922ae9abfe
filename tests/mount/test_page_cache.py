"""Page-cache readers (mmap, buffered) and fills (native engine, --fill-mib): the first request into a
routed expert reads the expert's pages the page cache lacks from every drive at once; each piece
answers the kernel's request that waits for it, or is stored into the page cache. The bytes are
always the primary's."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from colifs.formats.layout import ExpertKey
from colifs.synth import write_checkpoint
from tests.helpers import (
    UNTIMED,
    calls_returned,
    drop_file_cache,
    extents_of,
    fused_model,
    mounted,
    run_colifs,
    tensor_spans,
)
from tests.mount.test_faults import faulty_mirror, read_all, stats, through_faultfs

pytestmark = pytest.mark.mounts

PAGE = mmap.PAGESIZE
EXPERT = 3 * (2 << 20)  # the fused model's: three extents of 2 MiB
LEAD = 1 << 20  # what a fill reads of an expert before its reader shows it streams (fill.c FILL_LEAD)
# Weights given and no drive timed: the drives' depth stays unknown, so fills run. Timed, these test
# drives (the page cache behind them) would need no reads in flight, and fills would stay off.
UNTIMED = (*UNTIMED, "--probe-seconds", "0")


@pytest.fixture
def fused(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Two layers of 4 fused experts, each three 2 MiB extents."""
    return fused_model(tmp_path, 2, 1024)


@pytest.fixture
def native_only(engine: str) -> None:
    if engine == "pyfuse3":
        pytest.skip("fills are the native engine's")


def fills_of(m) -> dict:
    return m.stats()["fills"]


def served(m) -> int:
    return sum(r["bytes_served"] for r in m.stats()["replicas"])


def settled(m) -> dict:
    """The fills' counters once none holds memory (every piece answered, stored or failed)."""
    deadline = time.monotonic() + 10
    while (f := fills_of(m))["bytes_held"] and time.monotonic() < deadline:
        time.sleep(0.02)
    return f


@contextmanager
def slices_page_by_page(tmp_path: Path) -> Iterator[tuple]:
    """A model of 4 MiB extents (a 200B+ model's slices), mounted, open with POSIX_FADV_RANDOM (each
    request the pages read) and the daemon's view of it open: the mount, the file, its bytes, and
    the path of the model."""
    primary, mirror, model = fused_model(tmp_path, 1, 2048)
    with mounted(primary, [mirror], tmp_path / "mnt", *UNTIMED) as m:
        via = m.path / model.name
        drop_file_cache(via)
        with open(via, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            wait_for(lambda: fills_of(m)["views_open"] == 1)
            yield m, f, model.read_bytes(), model


def read_through(primary: Path, mirror: Path, model: Path, tmp_path: Path) -> dict:
    """The model file read in order through a mount, 128 KiB at a time (a load; POSIX_FADV_RANDOM:
    each request the pages read), every byte the primary's: the fills' counters after."""
    with mounted(primary, [mirror], tmp_path / "mnt", *UNTIMED) as m:
        via = m.path / model.name
        drop_file_cache(via)
        with open(via, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            got = bytearray()
            while chunk := f.read(128 << 10):
                got += chunk
        assert got == model.read_bytes()
        return settled(m)


def read_from_the_page_cache(m, f, want: bytes, spans: list[tuple[int, int]]) -> None:
    """The extents read whole, which a fill put in the page cache: nothing reaches a drive but their
    ragged ends."""
    before = served(m)
    for s, e in spans:
        f.seek(s)
        assert f.read(e - s) == want[s:e]
    assert served(m) - before <= 4 * PAGE, served(m) - before


def test_page_cache_readers_are_answered_and_stored_by_fills(fused, tmp_path: Path, native_only) -> None:
    """mmap faults through a whole fused model: every byte the primary's; each expert is read once,
    from both drives, its pieces answering requests or stored into the page cache."""
    primary, mirror, model = fused
    want = model.read_bytes()
    with mounted(primary, [mirror], tmp_path / "mnt", *UNTIMED) as m:
        via = m.path / model.name
        drop_file_cache(via)
        with open(via, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert mm[:] == want
        fills = settled(m)
        st = m.stats()
        keys = 2 * 4
        assert keys <= fills["fills_started"] <= 3 * keys, fills
        assert fills["bytes_stored"] + fills["bytes_answered"] >= 0.9 * keys * EXPERT, fills
        assert fills["bytes_stored"] > 0 and fills["requests_answered"] > 0, fills
        assert fills["fills_not_started_budget_spent"] == 0, fills
        assert all(r["bytes_served"] > (10 << 20) for r in st["replicas"])  # both drives read it
        assert served(m) < 1.1 * len(want), (served(m), len(want))  # nothing read twice
        assert st["fallbacks"] == 0


def test_one_touch_reads_a_lead_of_its_extent_only(fused, tmp_path: Path, native_only) -> None:
    """One page of an expert read (the kernel's readahead running past an extent does that): its
    fill reads a lead of 1 MiB in that extent, stored in the page cache, and none of the expert's
    other extents, which nobody has shown it wants."""
    primary, mirror, model = fused
    want = model.read_bytes()
    spans = extents_of(model, ExpertKey("blk", 1, 2))
    assert len(spans) == 3
    with mounted(primary, [mirror], tmp_path / "mnt", *UNTIMED) as m:
        via = m.path / model.name
        drop_file_cache(via)
        a = spans[1][0] + 5 * PAGE  # the middle extent, a little way in
        with open(via, "rb", buffering=0) as f:
            f.seek(a)
            assert f.read(PAGE) == want[a : a + PAGE]
            fills = settled(m)
            assert fills["fills_started"] == 1, fills
            assert LEAD <= fills["bytes_read"] <= LEAD + 2 * PAGE, fills
            before = served(m)
            f.seek(a)
            assert f.read(LEAD) == want[a : a + LEAD]
            assert served(m) - before <= PAGE, served(m) - before  # the lead's ragged end
            for s, e in (spans[0], spans[2]):
                drop_file_cache(via)  # a whole read: one fill per extent, nothing the lead read
                before = served(m)
                f.seek(s)
                assert f.read(e - s) == want[s:e]
                assert served(m) - before >= e - s - 2 * PAGE


def test_a_reader_going_on_past_its_lead_gets_the_whole_expert(tmp_path: Path, native_only) -> None:
    """Extents of 4 MiB (a 200B+ model's slices), longer than a lead: one page read, then the page
    just past the lead (the reader streams on through what the lead stored): that fill reads the
    rest of the expert, all three extents, and reading the expert whole reaches no drive after."""
    with slices_page_by_page(tmp_path) as (m, f, want, model):
        spans = extents_of(model, ExpertKey("blk", 0, 1))
        first = spans[0][0] // PAGE * PAGE + PAGE  # not the page it begins on: a lead
        f.seek(first)
        assert f.read(PAGE) == want[first : first + PAGE]
        lead = settled(m)["bytes_read"]
        assert LEAD <= lead <= LEAD + 2 * PAGE, lead
        on = first + PAGE + LEAD
        f.seek(on)
        assert f.read(PAGE) == want[on : on + PAGE]
        fills = settled(m)
        assert fills["fills_started"] == 2 and fills["bytes_read"] >= 3 * (4 << 20) - 2 * PAGE, fills
        read_from_the_page_cache(m, f, want, spans)


def test_a_read_from_an_experts_first_page_gets_the_whole_expert_at_once(tmp_path: Path, native_only) -> None:
    """An engine reading an expert (Colibrì's buffered read of it) asks first for the page that holds
    its first byte: that fill reads the whole expert, all three extents of 4 MiB, with no lead, and
    reading the expert whole reaches no drive after. A read that begins a page further in is read
    as a lead (the kernel's readahead reaching an expert)."""
    with slices_page_by_page(tmp_path) as (m, f, want, model):
        spans, other = (extents_of(model, ExpertKey("blk", 0, e)) for e in (1, 3))  # 3: not beside 1
        first = spans[0][0] // PAGE * PAGE
        f.seek(first)
        assert f.read(2 * PAGE) == want[first : first + 2 * PAGE]  # its middle in the expert
        fills = settled(m)
        assert fills["fills_started"] == 1 and fills["fills_from_first_page"] == 1, fills
        whole = fills["bytes_read"]
        assert whole >= 3 * (4 << 20) - 2 * PAGE and fills["leads_followed"] == 0, fills
        read_from_the_page_cache(m, f, want, spans)
        inside = other[0][0] // PAGE * PAGE + PAGE
        f.seek(inside)
        assert f.read(2 * PAGE) == want[inside : inside + 2 * PAGE]
        fills = settled(m)
        assert fills["fills_started"] == 2 and fills["fills_from_first_page"] == 1, fills
        assert LEAD <= fills["bytes_read"] - whole <= LEAD + 4 * PAGE, fills  # a lead


def test_a_reader_answered_from_its_lead_gets_the_whole_expert(tmp_path: Path, native_only) -> None:
    """The lead's pieces on a slow mirror (5 MB/s, nearly all its bytes routed there: 1 MiB takes
    0.2 s): a second request RUN_ON_REACH (512 KiB) into the lead, sent while the lead is read, waits
    for a piece in flight, and that shows the reader streams: the rest of the expert is read then (a
    lead followed), all the primary's bytes. The two requests come from two threads: the test drive
    serves its reads one at a time in the order they come, so the first request's own piece may
    wait for the whole lead, and a second request sent after it would find the lead stored."""
    fused = fused_model(tmp_path, 1, 2048)
    want = fused[2].read_bytes()
    spans = extents_of(fused[2], ExpertKey("blk", 0, 1))
    slow = ("--weights", "1,99", "--probe-seconds", "0")
    with (
        faulty_fused(tmp_path, fused, slow, "slow 5") as (m, via, control),
        open(via, "rb", buffering=0) as f,
    ):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        got: dict[int, bytes] = {}
        readers = []
        for at in (spans[0][0] // PAGE * PAGE + PAGE, spans[0][0] + (640 << 10)):  # a lead, then on
            readers.append(page_reader(f, at, got))
            readers[-1].start()
            time.sleep(0.02)  # the first request starts the fill; the second comes while its lead is read
        for t in readers:
            t.join()
        assert got == {at: want[at : at + PAGE] for at in got} and len(got) == 2
        fills = settled(m)
        assert fills["leads_followed"] == 1 and fills["fills_started"] == 2, fills
        assert fills["bytes_read"] >= 3 * (4 << 20) - 2 * PAGE, fills
        control.write_text("ok")
        for s, e in spans:
            f.seek(s)
            assert f.read(e - s) == want[s:e]


def test_a_reader_that_comes_to_another_extent_of_its_expert_gets_the_whole_expert(
    tmp_path: Path, native_only
) -> None:
    """A page read a little way into an expert's first extent (a lead), then, before anything else
    is read, a page a little way into its second extent: the reader went past the lead, onto the
    same expert (a loader reads an expert's tensors one after another, and the lead's pages were
    stored before it asked for them, so no request showed it reading through the lead). That
    fill reads the rest of the expert, and reading it whole reaches no drive after."""
    with slices_page_by_page(tmp_path) as (m, f, want, model):
        spans = extents_of(model, ExpertKey("blk", 0, 1))
        for s, _ in spans[:2]:
            at = s // PAGE * PAGE + 2 * PAGE  # not the page an extent begins on
            f.seek(at)
            assert f.read(PAGE) == want[at : at + PAGE]
            fills = settled(m)  # the lead read and stored, as a loader reads through it
        assert fills["fills_started"] == 2 and fills["leads_followed"] == 1, fills
        assert fills["bytes_read"] >= 3 * (4 << 20) - 4 * PAGE, fills
        read_from_the_page_cache(m, f, want, spans)


def test_a_load_of_a_tensor_per_projection_reads_each_expert_with_one_fill(
    tmp_path: Path, native_only
) -> None:
    """A safetensors checkpoint whose experts are a tensor per projection, side by side (transformers'
    Qwen3-MoE), read through 128 KiB at a time (a load; POSIX_FADV_RANDOM: each request the pages
    read): once the reader has crossed three boundaries between experts it streams, and each next
    expert's fill reads it whole from its first request, though that request begins a page into it
    (the page it shares with the tensor before is cached). Only the first experts' leads are
    followed."""
    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "qwen3", layers=2, experts=8, hidden=2048, inter=1024, shards=1)
    shutil.copytree(primary, mirror)
    fills = read_through(primary, mirror, next(primary.glob("*.safetensors")), tmp_path)
    assert fills["leads_followed"] <= 6, fills  # 3 (a host's stall may break the stream once); 16 when
    # each expert began with a lead


@pytest.mark.parametrize("weights", ["3,1", "1,1"])
def test_a_request_waits_only_for_a_clearly_quicker_drive(tmp_path: Path, native_only, weights) -> None:
    """A page of each expert extent read while the mirror hangs every read. A primary
    clearly quicker than the mirror (3,1, by the weights: nothing timed) reads each request's own
    piece: every read is answered, though a quarter of the stripes are routed to the mirror. At par
    (1,1) the routes split a request over both drives, so some request waits for the mirror's piece,
    until the mirror answers. The bytes are always the primary's."""
    fused = fused_model(tmp_path, 2, 1024)
    want = fused[2].read_bytes()
    # a page 256 KiB into each extent: no request ends where another expert's extent begins (that
    # one would run on from it, and start no fill)
    firsts = [-(-s // PAGE) * PAGE + (256 << 10) for k in range(4) for layer in range(2)
              for s, _ in extents_of(fused[2], ExpertKey("blk", layer, k))]  # fmt: skip
    flags = ("--weights", weights, "--probe-seconds", "0", "--mirror-timeout", "60")
    with (
        faulty_fused(tmp_path, fused, flags, "hang") as (m, via, control),
        open(via, "rb", buffering=0) as f,
    ):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # each request the page read
        got: dict[int, bytes] = {}
        readers = [page_reader(f, at, got) for at in firsts]
        for t in readers:
            t.start()
        deadline = time.monotonic() + 10
        for t in readers:
            t.join(max(0.0, deadline - time.monotonic()))
        waiting = sum(t.is_alive() for t in readers)
        control.write_text("ok")
        for t in readers:
            t.join()
        assert got == {at: want[at : at + PAGE] for at in firsts}
        assert fills_of(m)["fills_started"] == len(firsts), fills_of(m)
        if weights == "3,1":
            assert waiting == 0
        else:
            assert waiting > 0


def test_fills_start_only_for_the_experts_a_reader_reads(fused, tmp_path: Path, native_only) -> None:
    """Reads without the kernel's readahead (POSIX_FADV_RANDOM: each request is exactly the pages
    read). A page just past an expert read lately runs on from it (the kernel's readahead does
    that) and starts no fill; reading on into that expert does, once. A request that ends on the
    page where an expert begins (the first half of a fault's read-around) starts that expert's
    fill: its lead (the first MiB) is in the page cache after."""
    primary, mirror, model = fused
    want = model.read_bytes()
    one, two = (extents_of(model, ExpertKey("blk", 1, e)) for e in (1, 2))
    assert one[0][1] == two[0][0]  # gate extents side by side
    three = extents_of(model, ExpertKey("blk", 0, 2))  # a layer nothing read yet
    with mounted(primary, [mirror], tmp_path / "mnt", *UNTIMED) as m:
        via = m.path / model.name
        drop_file_cache(via)
        with open(via, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)

            def read(at: int, n: int = PAGE) -> None:
                f.seek(at)
                assert f.read(n) == want[at : at + n], at

            read((one[0][0] + one[0][1]) // 2 // PAGE * PAGE)
            assert settled(m)["fills_started"] == 1
            past = -(-two[0][0] // PAGE) * PAGE  # the first whole page of expert 2
            read(past)
            fills = fills_of(m)
            assert fills["fills_started"] == 1 and fills["requests_run_on"] == 1, fills
            for at in range(past + PAGE, two[0][1] // PAGE * PAGE, PAGE):
                read(at)
            fills = settled(m)
            assert fills["fills_started"] == 2 and fills["requests_run_on"] >= 1, fills
            edge = three[0][0] // PAGE * PAGE  # the page where an expert begins
            read(edge - 16 * PAGE, 16 * PAGE)
            assert settled(m)["fills_started"] == 3
            before = served(m)
            read(edge, LEAD)
            assert served(m) - before == 0, served(m) - before  # the lead


def test_a_reader_streaming_through_the_file_gets_each_next_expert_from_its_first_byte(
    fused, tmp_path: Path, native_only
) -> None:
    """The whole file read in order, 128 KiB at a time (a load; POSIX_FADV_RANDOM: each request the
    pages read): the requests into the next expert run on from the one before (the kernel's
    readahead past an expert does that) at no more than the first three boundaries between experts
    of each layer (24 here in all; the tensors between the layers' experts are read whole); from
    then on the reader streams through the file, and each expert's fill starts at its first request."""
    primary, mirror, model = fused
    boundaries = len(
        {s for k in range(4) for layer in range(2) for s, _ in extents_of(model, ExpertKey("blk", layer, k))}
    )
    fills = read_through(primary, mirror, model, tmp_path)
    window = (512 << 10) // (128 << 10)  # RUN_ON_REACH in requests
    assert boundaries == 24 and fills["requests_run_on"] <= 2 * 3 * window, fills
    assert fills["fills_started"] >= 2 * 4, fills


def test_a_reader_streaming_through_another_tensor_gets_a_fill(fused, tmp_path: Path, native_only) -> None:
    """A tensor that is no routed expert (an attention weight), read page by page from its start
    (POSIX_FADV_RANDOM: each request the page read): the first request starts no fill (an embedding
    table is read a few rows at a time), the second, starting where the first ended, fills the rest of
    the tensor: reading it on reaches no drive."""
    primary, mirror, model = fused
    want = model.read_bytes()
    (s, e) = next((s, e) for s, e, name in tensor_spans(model) if name == "blk.1.attn_q.weight")
    with mounted(primary, [mirror], tmp_path / "mnt", *UNTIMED) as m:
        via = m.path / model.name
        drop_file_cache(via)
        with open(via, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            first = -(-s // PAGE) * PAGE
            for at in (first, first + PAGE):
                f.seek(at)
                assert f.read(PAGE) == want[at : at + PAGE]
            assert settled(m)["fills_started"] == 1
            before = served(m)
            f.seek(first + 2 * PAGE)
            assert f.read(e - first - 2 * PAGE) == want[first + 2 * PAGE : e]
            assert served(m) - before <= PAGE, served(m) - before  # the tensor's ragged end


def test_direct_readers_and_a_zero_budget_never_fill(fused, tmp_path: Path, native_only) -> None:
    primary, mirror, model = fused
    want = model.read_bytes()
    with mounted(primary, [mirror], tmp_path / "mnt", *UNTIMED) as m:
        fd = os.open(m.path / model.name, os.O_RDONLY | os.O_DIRECT)
        try:
            got = mmap.mmap(-1, len(want) // PAGE * PAGE)
            os.preadv(fd, [got], 0)
        finally:
            os.close(fd)
        assert got[:] == want[: len(got)]
        assert fills_of(m)["fills_started"] == 0
    with mounted(primary, [mirror], tmp_path / "mnt2", *UNTIMED, "--fill-mib", "0") as m:
        drop_file_cache(m.path / model.name)
        assert (m.path / model.name).read_bytes() == want
        assert fills_of(m)["fills_started"] == 0 and fills_of(m)["requests_answered"] == 0


def test_fills_never_hold_more_than_their_budget(fused, tmp_path: Path, native_only) -> None:
    """Eight readers of different experts at once, a budget of 8 MiB (one expert's fill is 6): what
    fills hold stays within it; what finds it spent is read as if there were no fills, and right."""
    primary, mirror, model = fused
    want = model.read_bytes()
    spans = [s for e in range(4) for s in extents_of(model, ExpertKey("blk", 1, e))]
    held, errors = [], []
    with mounted(primary, [mirror], tmp_path / "mnt", *UNTIMED, "--fill-mib", "8") as m:
        via = m.path / model.name
        drop_file_cache(via)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                held.append(fills_of(m)["bytes_held"])
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
        assert max(held) <= 8 << 20, max(held)
        fills = settled(m)
        assert fills["fills_started"] >= 1 and fills["bytes_held"] == 0, fills


@pytest.mark.daemon_warns("reading from the primary instead", "went down")
@pytest.mark.parametrize(
    "flags", [(), ("--fill-mib", "0"), ("--direct-reads",)], ids=["fills", "plain", "direct-reads"]
)
def test_a_mirror_failing_mid_fill_is_read_from_the_primary(tmp_path: Path, native_only, flags) -> None:
    """Errors, short reads and a hang (past --mirror-timeout) on the mirror while page-cache readers
    go through fills (or without them; or read calls come direct, read through the drives' page
    caches): every byte the primary's, the failures counted."""
    with through_faultfs(tmp_path, "--mirror-timeout", "1", *flags) as (primary, mnt, control):
        shards = sorted(primary.glob("*.safetensors"))
        for fault in ("ok", "eio", "short", "hang"):
            control.write_text(fault)
            before = stats(mnt)
            for p in shards:
                drop_file_cache(mnt / p.name)
                assert (mnt / p.name).read_bytes() == p.read_bytes(), (fault, p.name)
            after = stats(mnt)
            if not flags:
                assert after["fills"]["fills_started"] > before["fills"]["fills_started"]
            if fault != "ok":
                assert (
                    after["fallbacks"] > before["fallbacks"]
                    or after["replicas"][1]["health"]["state"] != "up"
                )
            control.write_text("ok")
        read_all(mnt, primary)


def page_reader(f, at: int, got: dict[int, bytes]) -> threading.Thread:
    """A thread (not started) that reads the page at `at` of f into got[at]: a request of its own."""
    return threading.Thread(target=lambda: got.update({at: os.pread(f.fileno(), PAGE, at)}))


@contextmanager
def faulty_fused(tmp_path: Path, fused: tuple[Path, ...], flags: tuple[str, ...], mode: str) -> Iterator:
    """A fused model mounted with its mirror served by faultfs, the file's cache dropped, then the
    mirror set to `mode`: (the mount, the file through it, faultfs' control file)."""
    primary, source, model = fused
    control = tmp_path / "control"
    with (
        faulty_mirror(source, tmp_path / "faulty", control),
        mounted(primary, [tmp_path / "faulty"], tmp_path / "mnt", *flags) as m,
    ):
        via = m.path / model.name
        drop_file_cache(via)
        control.write_text(mode)
        yield m, via, control


def wait_for(what, deadline_s: float = 10) -> None:
    deadline = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.02)


def test_fills_read_only_what_the_page_cache_lacks(fused, tmp_path: Path, native_only) -> None:
    """A reader holds the file open (so the daemon has its view of it); an expert read whole, then
    512 KiB of its first extent evicted: the next fill (a lead of 1 MiB from there) reads what was
    evicted only."""
    primary, mirror, model = fused
    want = model.read_bytes()
    spans = extents_of(model, ExpertKey("blk", 0, 3))
    with mounted(primary, [mirror], tmp_path / "mnt", *UNTIMED) as m:
        via = m.path / model.name
        drop_file_cache(via)
        with open(via, "rb", buffering=0) as f:
            wait_for(lambda: fills_of(m)["views_open"] == 1)
            first = -(-spans[0][0] // PAGE) * PAGE
            for s, e in spans:
                f.seek(s)
                assert f.read(e - s) == want[s:e]
            settled(m)
            hole = first + (256 << 10)
            os.posix_fadvise(f.fileno(), hole, 512 << 10, os.POSIX_FADV_DONTNEED)
            before = fills_of(m)
            f.seek(hole)
            assert f.read(PAGE) == want[hole : hole + PAGE]
            after = settled(m)
            read = after["bytes_read"] - before["bytes_read"]
            cached = after["bytes_left_as_cached"] - before["bytes_left_as_cached"]
            assert read <= 0.6 * LEAD and cached >= 0.4 * LEAD, (read, cached)
            for s, e in spans:
                f.seek(s)
                assert f.read(e - s) == want[s:e]
        assert fills_of(m)["view_error"] == 0
        wait_for(lambda: fills_of(m)["views_open"] == 0)  # the view goes with the reader


@pytest.mark.parametrize("how", ["colifs", "umount"])
def test_a_closed_reader_leaves_the_mount_free_to_unmount(fused, tmp_path: Path, native_only, how) -> None:
    """The daemon's views pin a clone of the mount, never the mount: right after a reader closes the
    file, `colifs umount` (or umount(8)) succeeds, every time, and the daemon exits."""
    primary, mirror, model = fused
    want = model.read_bytes()
    for i in range(8):
        with mounted(primary, [mirror], tmp_path / f"mnt{i}", *UNTIMED) as m:
            via = m.path / model.name
            with open(via, "rb") as f:
                wait_for(lambda: fills_of(m)["views_open"] == 1)
                f.seek(len(want) // 2)
                assert f.read(PAGE) == want[len(want) // 2 : len(want) // 2 + PAGE]
            pid = m.stats()["pid"]
            if how == "colifs":
                out = run_colifs("umount", str(m.path))
            else:
                out = subprocess.run(["umount", str(m.path)], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            wait_for(lambda pid=pid: _zombie(pid))


def _zombie(pid: int) -> bool:
    """Gone, or exited and not yet waited for."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


@pytest.mark.daemon_warns(r"no answer", r"timeout", r"back in use")
def test_a_mirror_put_in_a_hung_removed_ones_place_gets_fill_readers_of_its_own(
    tmp_path: Path, native_only
) -> None:
    """The mirror's drive (faultfs) hangs every read while fills read experts: the fill threads of
    its drive are stuck in it. Its removal says calls are left there (exit 6); a directory added in
    its place reads the fills that follow on readers of its own: it takes no timeout, stays up and
    reads its share; every byte the primary's. Before, the stuck threads were the slot's: the new
    mirror's pieces queued behind them, and each request waited the mirror timeout and counted it
    against the new mirror."""
    primary, source, model = fused_model(tmp_path, 4, 1024)
    control, faulty, new = tmp_path / "control", tmp_path / "faulty", tmp_path / "new"
    shutil.copytree(source, new)
    want = model.read_bytes()
    experts = [extents_of(model, ExpertKey("blk", L, e)) for L in range(4) for e in range(4)]
    flags = (*UNTIMED, "--mirror-timeout", "0.5")
    with faulty_mirror(source, faulty, control), mounted(primary, [faulty], tmp_path / "mnt", *flags) as m:
        via = m.path / model.name
        drop_file_cache(via)
        control.write_text("hang")
        try:
            with open(via, "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                for spans in experts[:4]:  # 12 pieces each on the mirror: all 8 of its readers stuck
                    a = spans[1][0] + 5 * PAGE
                    f.seek(a)
                    assert f.read(PAGE) == want[a : a + PAGE]
            out = run_colifs("mirror", "remove", str(m.path), str(faulty), "--timeout", "1")
            assert out.returncode == 6 and "calls are still inside its drive" in out.stderr, out
            out = run_colifs("mirror", "add", str(m.path), str(new), "--weight", "1")
            assert out.returncode == 0, out
            # The slot was down (the hung drive's timeouts): the directory in it is checked first.
            wait_for(lambda: m.stats()["replicas"][1]["health"]["state"] == "up")
            before, fills = m.stats()["replicas"][1], fills_of(m)
            with open(via, "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                for spans in experts[8:]:
                    for s, e in spans:
                        f.seek(s)
                        assert f.read(e - s) == want[s:e]
            after = settled(m)
            assert after["fills_started"] > fills["fills_started"], after  # fills ran: the test holds
            now = m.stats()["replicas"][1]
            assert now["path"] == str(new) and now["health"]["state"] == "up", now
            assert before["health"]["timeouts"] == now["health"]["timeouts"] == 0, (before, now)  # its own
            assert after["requests_given_up"] == fills["requests_given_up"], (fills, after)
            assert now["bytes_served"] > before["bytes_served"] + (4 << 20), (before, now)
        finally:
            control.write_text("ok")  # the stuck reads return
        calls_returned(m)


@pytest.mark.daemon_warns(r"no answer", r"timeout")
def test_a_page_cache_read_waiting_on_a_hung_mirror_is_answered_once_it_is_removed(
    tmp_path: Path, native_only
) -> None:
    """No mirror timeout: a buffered read of an expert's extent waits for its fill's pieces on the
    mirror, whose drive (faultfs) hangs every read. Removing the mirror orphans those pieces: the
    read gets the primary's bytes at once. Before, it waited for as long as the drive hung."""
    primary, source, model = fused_model(tmp_path, 2, 1024)
    control, faulty = tmp_path / "control", tmp_path / "faulty"
    want = model.read_bytes()
    s, e = extents_of(model, ExpertKey("blk", 0, 1))[1]
    flags = (*UNTIMED, "--mirror-timeout", "0")
    with faulty_mirror(source, faulty, control), mounted(primary, [faulty], tmp_path / "mnt", *flags) as m:
        via = m.path / model.name
        drop_file_cache(via)
        got: list[bytes] = []

        def read() -> None:
            with open(via, "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                f.seek(s)
                got.append(f.read(e - s))

        control.write_text("hang")
        reader = threading.Thread(target=read)
        reader.start()
        try:
            time.sleep(1)
            assert reader.is_alive() and fills_of(m)["fills_started"] >= 1, fills_of(m)
            out = run_colifs("mirror", "remove", str(m.path), str(faulty), "--timeout", "1")
            assert out.returncode == 6, out
            reader.join(5)
            assert not reader.is_alive()
            assert got == [want[s:e]]
        finally:
            control.write_text("ok")  # the stuck reads return
            reader.join(10)
