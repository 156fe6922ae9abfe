"""The read path without a mount: `await ops.read(...)` on ColiFS with a fault-injecting I/O layer."""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import pytest
import trio

from colifs.fakeio import FaultyIO
from colifs.fs import ColiFS
from colifs.mount import build_files
from colifs.reader import OpenFile, Reader
from colifs.replicas import Replica
from colifs.stats import Stats
from colifs.tree import Tree
from colifs.workers import DriveWorkers


def make_ops(primary: Path, mirror: Path, weights: list[float]) -> tuple[ColiFS, FaultyIO]:
    replicas = [Replica(0, str(primary), weights[0]), Replica(1, str(mirror), weights[1])]
    tree = Tree(str(primary))
    files = build_files(tree, replicas)
    stats = Stats(replicas, "test", "/nowhere")
    io = FaultyIO()
    workers = [DriveWorkers(f"d{r.index}", 2) for r in replicas]
    return ColiFS(tree, files, Reader(replicas, workers, io, stats), stats), io


def run(ops: ColiFS, fn: Callable) -> object:
    try:
        return trio.run(fn)
    finally:
        for w in ops.reader.workers:
            w.close()


def shard_inodes(ops: ColiFS) -> dict[int, str]:
    return {ino: f.relpath for ino, f in ops.files.items() if f.is_model}


async def read_ranges(ops: ColiFS, primary: Path, count: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    for ino, rel in shard_inodes(ops).items():
        want = (primary / rel).read_bytes()
        fi = await ops.open(ino, os.O_RDONLY, None)
        for _ in range(count):
            off = rng.randrange(len(want) + 10)
            size = rng.choice([1, 4096, 131072, 1 << 20, rng.randrange(1, 300000)])
            got = bytes(await ops.read(fi.fh, off, size))
            assert got == want[off : off + size], (rel, off, size)
        await ops.release(fi.fh)


def test_random_reads_are_exact_and_use_both_drives(model) -> None:
    primary, mirror, _ = model
    ops, io = make_ops(primary, mirror, [1, 1])
    run(ops, lambda: read_ranges(ops, primary, 200))
    assert io.reads[str(primary)] > 50 and io.reads[str(mirror)] > 50
    assert ops.stats.fallbacks == 0
    assert ops.reader._open == {}  # every descriptor closed on release


@pytest.mark.parametrize("fault", ["eio", "short", "open"])
def test_failing_mirror_falls_back_to_primary_with_one_warning_per_file(model, fault, caplog) -> None:
    primary, mirror, _ = model
    ops, io = make_ops(primary, mirror, [1, 3])
    io.fail(str(mirror), fault)
    with caplog.at_level(logging.WARNING, logger="colifs"):
        run(ops, lambda: read_ranges(ops, primary, 100))
    warnings = [r.getMessage() for r in caplog.records if "mirror" in r.getMessage()]
    assert len(warnings) == len(shard_inodes(ops))  # one per file, not one per read
    assert all("reading from the primary instead" in w for w in warnings)
    assert ops.stats.bytes_served[1] == 0
    if fault == "open":
        assert ops.stats.fallbacks == 0  # never routed there at all
    else:
        assert ops.stats.fallbacks > 50 and ops.stats.read_errors[1] == ops.stats.fallbacks


def test_primary_error_is_eio_and_the_mount_keeps_serving(model) -> None:
    primary, mirror, _ = model
    ops, io = make_ops(primary, mirror, [1, 0.000001])
    ino = next(iter(shard_inodes(ops)))

    async def go() -> None:
        fi = await ops.open(ino, os.O_RDONLY, None)
        io.fail(str(primary), "eio")
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.read(fi.fh, 0, 4096)
        assert e.value.errno == errno.EIO
        io.fail(str(primary), None)
        assert len(await ops.read(fi.fh, 0, 4096)) == 4096
        await ops.release(fi.fh)

    run(ops, go)
    assert ops.stats.read_errors[0] == 1


def test_write_paths_are_erofs_without_a_mount(model) -> None:
    primary, mirror, _ = model
    ops, _ = make_ops(primary, mirror, [1, 1])
    ino = next(iter(shard_inodes(ops)))

    async def go() -> None:
        for call in (
            ops.open(ino, os.O_WRONLY, None),
            ops.open(ino, os.O_RDWR, None),
            ops.write(1, 0, b"x"),
            ops.unlink(1, b"x", None),
            ops.mkdir(1, b"x", 0o755, None),
            ops.setattr(ino, None, None, None, None),
            ops.setxattr(ino, b"user.x", b"1", None),
            ops.rename(1, b"a", 1, b"b", 0, None),
            ops.create(1, b"x", 0o644, os.O_WRONLY, None),
        ):
            with pytest.raises(pyfuse3.FUSEError) as e:
                await call
            assert e.value.errno == errno.EROFS

    run(ops, go)


def test_concurrent_opens_get_distinct_handles(model) -> None:
    primary, mirror, _ = model
    ops, _ = make_ops(primary, mirror, [1, 1])
    inodes = list(shard_inodes(ops))
    handles: list[int] = []

    async def open_one(ino: int) -> None:
        handles.append((await ops.open(ino, os.O_RDONLY, None)).fh)

    async def go() -> None:
        async with trio.open_nursery() as nursery:
            for k in range(30):
                nursery.start_soon(open_one, inodes[k % len(inodes)])
        assert len(set(handles)) == 30
        for fh in handles:
            assert len(await ops.read(fh, 0, 100)) == 100
            await ops.release(fh)

    run(ops, go)
    assert ops.reader._open == {}


def test_stripe_plan_spreads_big_keys_by_chunk_and_keeps_small_keys_whole(tmp_path: Path) -> None:
    from colifs.layout import ExpertKey
    from colifs.routing import CHUNK
    from colifs.synth import write_checkpoint

    primary, mirror = tmp_path / "p", tmp_path / "m"
    # experts of 3 projections x 1 MiB (striped) and shared experts of 128 KiB (kept whole)
    write_checkpoint(str(primary), "deepseek", layers=1, experts=4, hidden=1024, inter=1024, shards=1)
    shutil.copytree(primary, mirror)
    plans = []
    for _ in range(2):
        ops, _ = make_ops(primary, mirror, [3, 1])
        ops.reader.striping = True
        f = next(f for f in ops.files.values() if f.is_model)
        of = OpenFile(f, [0, 1], [3.0, 1.0])
        lay = f.layout
        ends = [*lay.starts[1:], lay.size]
        plans.append([ops.reader.plan(of, s, e) for s, e in zip(lay.starts, ends, strict=True)])
        for k, s, e, runs, rot in zip(lay.keys, lay.starts, ends, plans[-1], f.stripes, strict=True):
            if isinstance(k, ExpertKey) and e - s >= CHUNK and rot >= 0:
                chunks = {(a // CHUNK, d) for a, b, d in runs}
                assert len({d for _, d in chunks}) == 2 or e - s < 4 * CHUNK  # both drives over 4 chunks
            if rot < 0:
                assert len(runs) == 1  # small keys whole on one drive
        for w in ops.reader.workers:
            w.close()
    assert plans[0] == plans[1]  # the same chunk goes to the same drive every time
    # bytes of the experts split about 3:1
    by_drive = [0, 0]
    for runs, k in zip(plans[0], lay.keys, strict=True):
        if isinstance(k, ExpertKey):
            for a, b, d in runs:
                by_drive[d] += b - a
    assert by_drive[1] / sum(by_drive) == pytest.approx(0.25, abs=0.06)


def test_stripe_plan_never_uses_a_drive_without_a_valid_copy(tmp_path: Path) -> None:
    from colifs.synth import write_checkpoint

    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "deepseek", layers=1, experts=4, hidden=1024, inter=1024, shards=1)
    mirror.mkdir()  # the mirror lacks the file
    ops, _ = make_ops(primary, mirror, [1, 1])
    ops.reader.striping = True
    f = next(f for f in ops.files.values() if f.is_model)
    assert f.replicas == (0,)
    of = OpenFile(f, [0, None], [1.0, 0.0])
    assert ops.reader.plan(of, 0, f.size) == [(0, f.size, 0)]
    for w in ops.reader.workers:
        w.close()


def test_closing_workers_does_not_wait_forever_for_a_hung_read() -> None:
    import threading
    import time

    release = threading.Event()
    workers = DriveWorkers("hung", 2)

    async def go() -> None:
        workers.submit(release.wait, (), lambda _: None)  # a read that never returns

    trio.run(go)
    t0 = time.monotonic()
    workers.close(timeout=0.5)
    assert time.monotonic() - t0 < 2
    release.set()
