"""The read path without a mount: `await ops.read(...)` on ColiFS with a fault-injecting I/O layer."""

from __future__ import annotations

import errno
import logging
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio

from colifs.assemble import Assembly
from colifs.health import FAILURES_TO_DOWN
from colifs.pyfuse3.fs import ColiFS
from colifs.pyfuse3.reader import Reader
from colifs.pyfuse3.workers import DriveWorkers, Waiting, gather
from colifs.stats import Stats
from tests.fakeio import FaultyIO
from tests.helpers import assembled, ops_of, run_ops


@dataclass(frozen=True)
class Rig:
    """A mount's object graph as `serve` assembles it (pyfuse3 engine), never mounted."""

    asm: Assembly
    io: FaultyIO

    @property
    def ops(self) -> ColiFS:
        return ops_of(self.asm)

    @property
    def reader(self) -> Reader:
        return self.asm.engine.reader  # type: ignore[attr-defined]

    @property
    def stats(self) -> Stats:
        return self.asm.stats


def make_ops(
    primary: Path, mirror: Path, weights: list[float], io: FaultyIO | None = None, **cfg: Any
) -> Rig:
    io = io or FaultyIO()
    return Rig(assembled(primary.parent, primary, [mirror], weights, io, **cfg), io)


def run(rig: Rig, fn: Callable) -> object:
    return run_ops(rig.asm, fn)


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
    rig = make_ops(primary, mirror, [1, 1])
    ops, io = rig.ops, rig.io
    run(rig, lambda: read_ranges(ops, primary, 200))
    assert io.reads[str(primary)] > 50 and io.reads[str(mirror)] > 50
    assert rig.stats.fallbacks == 0
    assert rig.reader.open_files() == 0  # every descriptor closed on release


@pytest.mark.parametrize("fault", ["eio", "short", "open"])
def test_failing_mirror_falls_back_then_leaves_the_routing(model, fault, caplog) -> None:
    primary, mirror, _ = model
    rig = make_ops(primary, mirror, [1, 3])
    ops, io = rig.ops, rig.io
    io.fail(str(mirror), fault)
    with caplog.at_level(logging.WARNING, logger="colifs"):
        run(rig, lambda: read_ranges(ops, primary, 100))
    # The rig's copies are directories on one disk: the mount says so (one warning, tested apart).
    messages = [r.getMessage() for r in caplog.records if "are on one drive" not in r.getMessage()]
    per_file = [m for m in messages if "reading from the primary instead" in m]
    down = [m for m in messages if "failures in a row" in m]
    assert len(down) == 1  # taken out once (nothing checks it again without a mount)
    assert 1 <= len(per_file) <= len(shard_inodes(ops))
    assert len({m.split(":")[0] for m in per_file}) == len(per_file)  # at most one per file
    assert len(per_file) + len(down) == len(messages)
    assert rig.stats.bytes_served[1] == 0
    health = rig.reader.health[1]
    assert not health.up and health.in_a_row >= FAILURES_TO_DOWN
    if fault == "open":
        assert rig.stats.fallbacks == 0  # never routed there at all
    else:
        # after FAILURES_TO_DOWN failures no read goes there: 300 reads, a handful of fallbacks
        assert FAILURES_TO_DOWN <= rig.stats.fallbacks < 10
        assert rig.stats.read_errors[1] == rig.stats.fallbacks == health.errors


def test_down_mirror_comes_back_after_a_check_read_passes(model) -> None:
    primary, mirror, _ = model
    rig = make_ops(primary, mirror, [1, 1])
    ops, io = rig.ops, rig.io
    reader = rig.reader
    io.fail(str(mirror), "eio")

    async def go() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.watch)
            await read_ranges(ops, primary, 20)
            assert not reader.health[1].up
            before, checked = io.reads[str(mirror)], reader.health[1].checks
            with trio.fail_after(5):  # the first check, 1 s after it went down, fails: back-off 2 s
                while reader.health[1].checks < 1:
                    await trio.sleep(0.05)
            assert reader.health[1].checks == 1 and not reader.health[1].up
            assert io.reads[str(mirror)] == before + 1 - checked  # only the check read went there
            io.fail(str(mirror), None)
            with trio.fail_after(4):
                while not reader.health[1].up:
                    await trio.sleep(0.05)
            served = rig.stats.bytes_served[1]
            await read_ranges(ops, primary, 20, seed=2)
            assert rig.stats.bytes_served[1] > served  # routed there again
            nursery.cancel_scope.cancel()

    run(rig, go)
    d = rig.stats.as_dict(list(ops.files.values()))["replicas"][1]["health"]
    assert d["state"] == "up" and d["times_down"] == 1 and d["checks"] == 2 and d["errors"] >= 4


def test_hung_mirror_read_is_reissued_on_the_primary_and_its_buffer_never_reused(model) -> None:
    """A hung read that finally lands writes 0xEE into the buffer it was given: never seen."""
    primary, mirror, _ = model
    rig = make_ops(primary, mirror, [1, 1], threads_per_drive=4, mirror_timeout=0.2)
    ops, io, stats = rig.ops, rig.io, rig.stats
    io.fail(str(mirror), "hang")

    async def go() -> None:
        t0 = trio.current_time()
        await read_ranges(ops, primary, 10)  # each read touching the mirror waits 0.2 s, then the primary
        assert trio.current_time() - t0 < 10
        assert not rig.reader.health[1].up
        assert rig.reader.health[1].timeouts >= FAILURES_TO_DOWN
        io.fail(str(mirror), None)  # the hung reads land now, writing 0xEE into their old buffers
        await read_ranges(ops, primary, 100, seed=3)  # compared byte by byte

    run(rig, go)
    assert stats.fallbacks >= FAILURES_TO_DOWN and stats.bytes_served[1] == 0


def test_hung_mirror_open_times_out_and_its_late_descriptor_is_closed(model) -> None:
    primary, mirror, _ = model
    release = threading.Event()

    class SlowOpen(FaultyIO):
        def open(self, path: str) -> int:
            if path.startswith(str(mirror)):
                release.wait()
            return super().open(path)

    rig = make_ops(primary, mirror, [1, 1], SlowOpen(), threads_per_drive=4, mirror_timeout=0.2)
    ops, io = rig.ops, rig.io
    ino, rel = next(iter(shard_inodes(ops).items()))

    async def go() -> None:
        fi = await ops.open(ino, os.O_RDONLY, None)
        want = (primary / rel).read_bytes()
        assert bytes(await ops.read(fi.fh, 0, len(want))) == want
        assert io.reads.get(str(mirror), 0) == 0  # the open timed out: the file is read without the mirror
        fds_before = set(os.listdir("/proc/self/fd"))
        release.set()
        with trio.fail_after(5):  # the late open lands and is closed
            while not set(os.listdir("/proc/self/fd")) <= fds_before:
                await trio.sleep(0.05)
        await ops.release(fi.fh)

    run(rig, go)
    assert rig.reader.health[1].timeouts == 1


def test_primary_error_is_eio_and_the_mount_keeps_serving(model) -> None:
    primary, mirror, _ = model
    rig = make_ops(primary, mirror, [1, 0.000001])
    ops, io = rig.ops, rig.io
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

    run(rig, go)
    assert rig.stats.read_errors[0] == 1


def test_write_paths_are_erofs_without_a_mount(model) -> None:
    primary, mirror, _ = model
    rig = make_ops(primary, mirror, [1, 1])
    ops = rig.ops
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

    run(rig, go)


def test_concurrent_opens_get_distinct_handles(model) -> None:
    primary, mirror, _ = model
    rig = make_ops(primary, mirror, [1, 1])
    ops = rig.ops
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

    run(rig, go)
    assert rig.reader.open_files() == 0


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


def test_time_alone_counts_what_o_direct_readers_wait_for_on_one_drive(model) -> None:
    """A hung mirror: an O_DIRECT opener's read waits on the mirror alone (the primary's pieces
    are read) until its timeout; that time is the mirror's, once, and the late read, when it lands,
    counts nothing more. A page-cache opener's reads count no time alone."""
    primary, mirror, _ = model
    rig = make_ops(primary, mirror, [1, 1], threads_per_drive=4, mirror_timeout=0.3)
    ops, io, waiting = rig.ops, rig.io, rig.reader.waiting
    ino, rel = max(shard_inodes(ops).items(), key=lambda x: (primary / x[1]).stat().st_size)
    want = (primary / rel).read_bytes()

    async def read_span(flags: int) -> None:
        fi = await ops.open(ino, flags, None)
        assert bytes(await ops.read(fi.fh, 0, len(want))) == want  # experts on both drives
        await ops.release(fi.fh)

    async def go() -> None:
        await read_span(os.O_RDONLY)  # a page-cache reader counts nothing
        assert waiting.seconds() == [0.0, 0.0] and waiting.pending == [0, 0]
        assert io.reads[str(mirror)] > 0
        io.fail(str(mirror), "hang")
        await read_span(os.O_RDONLY | os.O_DIRECT)
        alone = waiting.seconds()
        assert 0.25 < alone[1] < 1.0 and alone[0] < 0.25, alone  # about the timeout, on the mirror
        assert waiting.pending == [0, 0]  # the read given up on holds nobody up
        io.fail(str(mirror), None)  # the late reads land now
        with trio.fail_after(5):
            while rig.reader.workers[1].busy:
                await trio.sleep(0.01)
        assert waiting.pending == [0, 0] and waiting.seconds()[1] == alone[1]

    run(rig, go)


def test_waiting_adds_time_only_to_a_drive_pending_alone() -> None:
    now = [0.0]
    waiting = Waiting(3, clock=lambda: now[0])

    def at(t: float, drive: int, delta: int) -> None:
        now[0] = t
        waiting.change(drive, delta)

    at(0.0, 0, 1)  # 0 alone from 0 to 1
    at(1.0, 1, 1)  # both pending 1..2: nobody alone
    at(2.0, 0, -1)  # 1 alone 2..5
    at(5.0, 2, 1)
    at(5.5, 1, -1)  # 2 alone 5.5..6
    at(6.0, 2, -1)
    now[0] = 9.0  # nothing pending since
    assert waiting.seconds() == [1.0, 3.0, 0.5]
    waiting.grow()
    at(10.0, 3, 1)
    now[0] = 10.25
    assert waiting.seconds() == [1.0, 3.0, 0.5, 0.25]


def test_a_cancellation_waits_for_the_primary_not_for_a_hung_mirror() -> None:
    """Shutdown cancels a request whose mirror read hangs (its timeout far off): the request ends
    once the primary's read is done, not when the mirror answers (trio asks the wait only once),
    and both reads are settled."""
    import time

    release = threading.Event()
    primary, mirror = DriveWorkers("primary", 1), DriveWorkers("mirror", 1, timeout=30)
    settled: list[int] = []

    async def go() -> float:
        t0 = time.monotonic()
        with trio.move_on_after(0.1):
            calls = [(primary, time.sleep, (0.3,)), (mirror, release.wait, ())]
            await gather(calls, None, settled.append)
        return time.monotonic() - t0

    threading.Timer(3.0, release.set).start()
    took = trio.run(go)
    assert 0.25 < took < 2.0, took  # the primary's 0.3 s, not the mirror's 3 s
    assert sorted(settled) == [0, 1]
    release.set()
    primary.close()
    mirror.close()
