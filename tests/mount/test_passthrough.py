"""--passthrough (native engine, FUSE passthrough): page-cache opens are read by the kernel from the
primary itself. The mode is the file's while any open of it lasts (the kernel's rule): an O_DIRECT
open of a file passed through is still served by the daemon, and a page-cache open of a file the
daemon serves is served too. Every byte is the primary's whatever the mix of opens."""

from __future__ import annotations

import errno
import mmap
import os
import random
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import drop_file_cache, fused_model, mounted, run_colifs

pytestmark = pytest.mark.mounts

PT = ("--weights", "1,1", "--passthrough")


@pytest.fixture
def fused(tmp_path: Path, engine: str) -> tuple[Path, Path, Path]:
    if engine == "pyfuse3":
        pytest.skip("passthrough is the native engine's")
    return fused_model(tmp_path, 2, 1024)


def served(m) -> int:
    return sum(r["bytes_served"] for r in m.stats()["replicas"])


def released(m) -> None:
    """Wait for the daemon to see every open of the mount closed: the kernel sends RELEASE a moment
    after close() returns, and until then the daemon holds the file in its open's mode."""
    deadline = time.monotonic() + 10
    while m.stats()["passthrough"]["file_opens_now"]:
        assert time.monotonic() < deadline, m.stats()["passthrough"]
        time.sleep(0.01)


def read_odirect(path: Path, off: int, size: int) -> bytes:
    """An O_DIRECT read into an unaligned buffer, as FUSE allows (os.pread's bytes are unaligned)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return os.pread(fd, size, off)
    finally:
        os.close(fd)


def test_page_cache_readers_read_the_primary_through_the_kernel(fused, tmp_path: Path) -> None:
    """mmap and buffered readers get the primary's bytes with no request to the daemon."""
    primary, mirror, model = fused
    want = model.read_bytes()
    with mounted(primary, [mirror], tmp_path / "mnt", *PT) as m:
        via = m.path / model.name
        drop_file_cache(via)
        with open(via, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert mm[:] == want
        with open(via, "rb", buffering=0) as f:
            assert f.read() == want
        released(m)
        pt = m.stats()["passthrough"]  # drop_file_cache opened it too
        assert pt == {
            "asked_at_init": 1,
            "page_cache_opens_passed_through": 3,
            "page_cache_opens_served": 0,
            "file_opens_now": 0,
            "direct_reads_at_init": 0,
        }
        assert served(m) == 0  # the daemon read nothing: in no per-drive count


def test_without_the_flag_page_cache_readers_are_served(fused, tmp_path: Path) -> None:
    primary, mirror, model = fused
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        via = m.path / model.name
        drop_file_cache(via)
        assert via.read_bytes() == model.read_bytes()
        assert m.stats()["passthrough"]["page_cache_opens_passed_through"] == 0
        assert all(r["bytes_served"] > 0 for r in m.stats()["replicas"])


def test_an_open_follows_the_mode_its_file_is_open_in(fused, tmp_path: Path) -> None:
    """O_DIRECT during a passed-through open: served (any buffer, both drives); a page-cache open
    during a served O_DIRECT open: served; once all close, a page-cache open passes through again."""
    primary, mirror, model = fused
    want = model.read_bytes()
    size = len(want)
    with mounted(primary, [mirror], tmp_path / "mnt", *PT) as m:
        via = m.path / model.name
        drop_file_cache(via)
        with open(via, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert read_odirect(via, 4096 + 512, size) == want[4096 + 512 :]
            assert served(m) >= size - 8192
            assert mm[: 1 << 20] == want[: 1 << 20]
        assert m.stats()["passthrough"]["page_cache_opens_passed_through"] == 2  # with drop_file_cache's

        released(m)
        fd = os.open(via, os.O_RDONLY | os.O_DIRECT)
        try:
            drop_file_cache(primary / model.name)
            before = served(m)
            with open(via, "rb", buffering=0) as f:
                assert f.read() == want
            assert served(m) > before  # the daemon served the page-cache reader
            assert m.stats()["passthrough"]["page_cache_opens_served"] == 1
        finally:
            os.close(fd)

        released(m)
        assert via.read_bytes() == want
        assert m.stats()["passthrough"]["page_cache_opens_passed_through"] == 3


def test_opens_of_every_kind_at_once_never_fail_nor_differ(fused, tmp_path: Path) -> None:
    """Eight threads open, read a random span and close, page-cache and O_DIRECT mixed: every open
    succeeds in one mode or the other (the kernel fails an open in the wrong one with EIO) and
    reads the primary's bytes. Each of six phases begins with one open held, a page-cache one (the
    file passes through) or an O_DIRECT one (the file is served), so both modes meet the mix."""
    primary, mirror, model = fused
    want = model.read_bytes()
    size = len(want)
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)
    with mounted(primary, [mirror], tmp_path / "mnt", *PT) as m:
        via = m.path / model.name

        def read_some(rnd: random.Random) -> None:
            off, n = rnd.randrange(size), rnd.randrange(1, 3 << 20)
            if rnd.random() < 0.5:
                got = read_odirect(via, off, n)
            else:
                with open(via, "rb") as f:
                    f.seek(off)
                    got = f.read(n)
            assert got == want[off : off + n], (off, n)

        def worker(index: int) -> None:
            rnd = random.Random(index)
            try:
                for phase in range(6):
                    barrier.wait()
                    if index == 0:
                        released(m)  # the last phase's opens are closed, also to the daemon
                        held = os.open(via, os.O_RDONLY | (os.O_DIRECT if phase % 2 else 0))
                    barrier.wait()
                    for _ in range(25):
                        read_some(rnd)
                    barrier.wait()
                    if index == 0:
                        os.close(held)
            except BaseException as e:
                errors.append(e)
                barrier.abort()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        pt = m.stats()["passthrough"]
        assert pt["page_cache_opens_passed_through"] >= 3 and pt["page_cache_opens_served"] >= 3, pt


@pytest.mark.daemon_warns(
    r"--passthrough: the kernel refused .* as a backing file", r"the primary has its own \.colifs"
)
def test_a_primary_the_kernel_refuses_to_pass_through_is_served(fused, tmp_path: Path) -> None:
    """A primary on a stacked filesystem (here another mount that passes through, so one level
    deep already) cannot back a passthrough open (ELOOP): one warning, and its opens are served."""
    primary, mirror, model = fused
    want = model.read_bytes()
    below = tmp_path / "below"
    with (
        mounted(primary, [], below, "--passthrough"),
        mounted(below, [mirror], tmp_path / "mnt", *PT, "--no-usage") as m,
    ):
        via = m.path / model.name
        for _ in range(2):
            with open(via, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                assert mm[:] == want
        pt = m.stats()["passthrough"]
        assert pt["page_cache_opens_passed_through"] == 0 and pt["page_cache_opens_served"] == 2, pt
        assert all(r["bytes_served"] > 0 for r in m.stats()["replicas"])


def test_a_mapping_passed_through_keeps_the_mount_in_use(fused, tmp_path: Path) -> None:
    """The kernel maps the primary's file itself, still through the mount's path: a model mapped
    and closed holds the mount, and `colifs umount` says so and leaves it serving."""
    primary, mirror, model = fused
    with mounted(primary, [mirror], tmp_path / "mnt", *PT) as m:
        with open(m.path / model.name, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            done = run_colifs("umount", str(m.path))
            assert done.returncode == 6 and f"maps {model.name}" in done.stderr, done
            assert mm[: 1 << 20] == model.read_bytes()[: 1 << 20]
        finally:
            mm.close()


@pytest.mark.daemon_warns(r"the primary changed since mount")
def test_a_primary_replaced_while_mounted_is_never_passed_through(fused, tmp_path: Path) -> None:
    """A model file replaced on the primary by a rename (same size, other bytes) after it was read
    passed through and closed: its next open fails with EIO; the kernel is never handed the new
    file to read."""
    primary, mirror, model = fused
    old = model.read_bytes()
    with mounted(primary, [mirror], tmp_path / "mnt", *PT) as m:
        via = m.path / model.name
        with open(via, "rb") as f:
            assert f.read() == old
        released(m)
        before = m.stats()["passthrough"]["page_cache_opens_passed_through"]
        staged = primary / ".m.gguf.part"
        staged.write_bytes(old[: len(old) // 2] + bytes(b ^ 0xFF for b in old[len(old) // 2 :]))
        staged.replace(model)
        for _ in range(2):
            with pytest.raises(OSError) as e:
                open(via, "rb").close()
            assert e.value.errno == errno.EIO
        assert m.stats()["passthrough"]["page_cache_opens_passed_through"] == before
