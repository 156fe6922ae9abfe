"""A mirror that fails while mounted: served from a fault-injecting FUSE mirror.

Every byte read through colifs must stay the primary's, whatever the mirror does.
"""

from __future__ import annotations

import concurrent.futures
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from colifs.synth import write_checkpoint
from tests.helpers import ROOT, daemon_files, force_unmount, is_mounted, read_direct, run_colifs

FAULTFS = str(ROOT / "tests" / "faultfs.py")

pytestmark = pytest.mark.mounts  # every test here runs on both engines


@contextmanager
def faulty_mirror(source: Path, mnt: Path, control: Path) -> Iterator[subprocess.Popen]:
    control.write_text("ok")
    mnt.mkdir()
    proc = subprocess.Popen([sys.executable, FAULTFS, str(source), str(mnt), str(control)])
    try:
        deadline = time.monotonic() + 20
        while not (is_mounted(mnt) and os.listdir(mnt)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait()
        force_unmount(mnt)


@contextmanager
def colifs_on(
    primary: Path, mirror: Path, mnt: Path, *extra: str, weights: str | None = "1,1"
) -> Iterator[Path]:
    """Mounted with `weights` (None: none given, the mount probes the drives)."""
    mnt.mkdir()
    given = [] if weights is None else ["--weights", weights]
    out = run_colifs("mount", str(primary), str(mirror), str(mnt), *given, *extra)
    assert out.returncode == 0, out.stderr
    try:
        yield mnt
    finally:
        run_colifs("umount", str(mnt))
        force_unmount(mnt)


def stats(mnt: Path) -> dict:
    return json.loads((mnt / ".colifs" / "stats.json").read_text())


def wait_until_up(mnt: Path, within: float = 35.0) -> float:
    """Seconds until the mirror is back in use (check reads run after a back-off of at most 30 s)."""
    t0 = time.monotonic()
    while stats(mnt)["replicas"][1]["health"]["state"] != "up":
        assert time.monotonic() - t0 < within, stats(mnt)["replicas"][1]["health"]
        time.sleep(0.1)
    return time.monotonic() - t0


def read_all(mnt: Path, primary: Path) -> None:
    for p in sorted(primary.glob("*.safetensors")):
        assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes(), p.name


def setup_model(tmp_path: Path) -> tuple[Path, Path]:
    primary, source = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "deepseek", layers=2, experts=16, hidden=512, inter=512, shards=3)
    shutil.copytree(primary, source)
    return primary, source


@contextmanager
def through_faultfs(tmp_path: Path, *flags: str) -> Iterator[tuple[Path, Path, Path]]:
    """The test model mounted with its mirror served by faultfs: (primary, mountpoint, control)."""
    primary, source = setup_model(tmp_path)
    control = tmp_path / "control"
    with (
        faulty_mirror(source, tmp_path / "faulty", control),
        colifs_on(primary, tmp_path / "faulty", tmp_path / "mnt", *flags) as mnt,
    ):
        yield primary, mnt, control


def test_a_mirror_that_starts_failing_mid_run(tmp_path: Path) -> None:
    with through_faultfs(tmp_path) as (primary, mnt, control):
        read_all(mnt, primary)
        first = stats(mnt)
        assert first["fallbacks"] == 0 and first["replicas"][1]["bytes_served"] > 0
        for fault, word in (("eio", "read error"), ("short", "short read")):
            control.write_text(fault)
            before = stats(mnt)
            read_all(mnt, primary)  # the right bytes, every one
            after = stats(mnt)
            assert after["fallbacks"] > before["fallbacks"]
            assert after["replicas"][1]["bytes_served"] == before["replicas"][1]["bytes_served"]
            assert after["replicas"][1]["read_errors"] > before["replicas"][1]["read_errors"]
            assert word in after["replicas"][1]["last_error"]
            warned = [w for w in after["recent_warnings"] if "reading from the primary instead" in w]
            names = [p.name for p in primary.glob("*.safetensors")]
            per_file = [n for n in names for w in warned if f" {n}: mirror" in w]
            assert per_file and len(per_file) == len(set(per_file))  # at most one each
            # failures in a row took it out of the routing: its reads go to the primary
            health = after["replicas"][1]["health"]
            assert health["state"] == "down" and word in health["last_error"]
            assert sum("failures in a row" in w for w in after["recent_warnings"]) == health["times_down"]
            table = run_colifs("stats", str(mnt)).stdout
            assert "down (next check in" in table and word in table
            assert ", DOWN)" in (mnt / ".colifs" / "stats").read_text()
            read_all(mnt, primary)
            again = stats(mnt)["replicas"][1]["health"]
            assert again["errors"] <= health["errors"] + again["checks"]  # only check reads touched it
            control.write_text("ok")
            back_after = wait_until_up(mnt)
            before = stats(mnt)
            read_all(mnt, primary)
            after = stats(mnt)
            assert after["replicas"][1]["bytes_served"] > before["replicas"][1]["bytes_served"]  # used again
            assert after["fallbacks"] == before["fallbacks"]
            assert any("check read passed" in w for w in after["recent_warnings"])
            print(f"\n{fault}: mirror back in use {back_after:.1f} s after it healed")


def test_mirror_reads_given_up_on_are_never_read(tmp_path: Path, engine: str) -> None:
    """One drive thread on the mirror, whose reads hang, and eight O_DIRECT readers at once: each
    request gives up on its mirror piece after 0.5 s and reads the primary. Once the mirror answers
    again, the pieces still queued for requests that gave up are skipped, not read (they would
    queue in front of new reads and hold their buffers)."""
    if engine == "pyfuse3":
        pytest.skip("the pyfuse3 engine cancels a read given up on before it starts")
    with through_faultfs(tmp_path, "--mirror-timeout", "0.5", "--threads-per-drive", "1") as (
        primary,
        mnt,
        control,
    ):
        read_all(mnt, primary)
        control.write_text("hang")
        shards = sorted(primary.glob("*.safetensors"))
        wanted = [(p, (k * 3 + 1) << 20) for k in range(4) for p in shards[:2]]

        def read_one(p: Path, off: int) -> bool:
            return read_direct(mnt / p.name, off, 1 << 20) == p.read_bytes()[off : off + (1 << 20)]

        with concurrent.futures.ThreadPoolExecutor(len(wanted)) as pool:
            assert all(pool.map(lambda w: read_one(*w), wanted))
        control.write_text("ok")  # the hung read lands; what was queued behind it is stale
        deadline = time.monotonic() + 10
        while stats(mnt)["late_reads_skipped"] == 0:
            assert time.monotonic() < deadline, stats(mnt)
            time.sleep(0.05)
        read_all(mnt, primary)


def test_a_hung_mirror_read_is_reissued_on_the_primary(tmp_path: Path) -> None:
    with through_faultfs(tmp_path, "--mirror-timeout", "0.5") as (primary, mnt, control):
        read_all(mnt, primary)
        control.write_text("hang")
        t0 = time.monotonic()
        read_all(mnt, primary)  # the first reads wait 0.5 s for the mirror, then the primary answers
        hung = time.monotonic() - t0
        health = stats(mnt)["replicas"][1]["health"]
        assert health["state"] == "down" and health["timeouts"] >= 3
        assert "no answer within 0.5 s" in health["last_error"]
        t0 = time.monotonic()
        read_all(mnt, primary)  # down: nothing waits for it any more
        down = time.monotonic() - t0
        assert stats(mnt)["replicas"][1]["health"]["timeouts"] <= health["timeouts"] + 1  # a check, maybe
        control.write_text("ok")  # the hung reads land; the mirror passes a check and is back
        back_after = wait_until_up(mnt)
        before = stats(mnt)["replicas"][1]["bytes_served"]
        read_all(mnt, primary)
        assert stats(mnt)["replicas"][1]["bytes_served"] > before
        print(
            f"\nhung mirror: read_all {hung:.2f} s while timing out, {down:.2f} s once down; "
            f"back {back_after:.1f} s after it healed"
        )


def test_a_hung_mirror_open_holds_up_no_read_open_or_close(tmp_path: Path) -> None:
    """The mirror's opens hang: reads fall back after the timeout, and opening and closing the
    same files again never waits for the hung open."""
    with through_faultfs(tmp_path, "--mirror-timeout", "0.3") as (primary, mnt, control):
        control.write_text("hang-open")

        def passes() -> float:
            slowest = 0.0
            for _ in range(3):  # each pass opens, reads and closes every shard again
                for p in sorted(primary.glob("*.safetensors")):
                    t0 = time.monotonic()
                    assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes(), p.name
                    slowest = max(slowest, time.monotonic() - t0)
            return slowest

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            done = pool.submit(passes)
            try:
                slowest = done.result(timeout=30)
            finally:
                control.write_text("ok")  # releases the hung opens, and a test that would hang
        st = stats(mnt)
        assert st["replicas"][1]["health"]["timeouts"] >= 1  # the hung opens were noticed
        assert slowest < 3.0, slowest  # a timeout or two per file, never a wait for the open


def test_reads_given_up_on_leave_no_descriptor_once_the_mirror_answers(tmp_path: Path) -> None:
    """One mirror thread, its reads hung: a read waits on the thread, the next queues behind it,
    both are given up on and the file is closed. The late reads keep their files open (a
    descriptor closed under a late read could get its number reused by another open, /dev/fuse
    say, before the read's pread). When the mirror answers, the late reads end and the
    daemon holds no more descriptors than before."""
    flags = ("--mirror-timeout", "0.3", "--threads-per-drive", "1", "--routing", "expert")
    with through_faultfs(tmp_path, *flags) as (primary, mnt, control):
        pid = stats(mnt)["pid"]
        fds0 = len(daemon_fds(pid))
        control.write_text("hang")
        for p in sorted(primary.glob("*.safetensors")):
            read_all_of = read_direct(mnt / p.name, 0, p.stat().st_size)  # opens, reads, closes
            assert read_all_of == p.read_bytes(), p.name
        assert stats(mnt)["replicas"][1]["health"]["timeouts"] >= 2

        time.sleep(0.5)  # the releases arrive
        assert len(daemon_fds(pid)) > fds0  # held by the late reads, not closed under them
        control.write_text("ok")  # the stuck read lands; the queued ones run after it
        time.sleep(1)
        held = daemon_fds_back_to(pid, fds0)
        assert len(held) == fds0, held


def test_a_mirror_whose_checks_hang_holds_up_no_other_mirrors_comeback(tmp_path: Path) -> None:
    """Two mirrors, both down; the first one's check reads hang (with --mirror-timeout 0 a check
    may take 30 s), the second heals: it is back within seconds, not after the hung check."""
    primary, source = setup_model(tmp_path)
    a, b = tmp_path / "control-a", tmp_path / "control-b"
    with (
        faulty_mirror(source, tmp_path / "fa", a),
        faulty_mirror(source, tmp_path / "fb", b),
    ):
        (tmp_path / "mnt").mkdir()
        mirrors = (str(tmp_path / "fa"), str(tmp_path / "fb"))
        args = ("--weights", "1,1,1", "--mirror-timeout", "0", "--routing", "expert")
        out = run_colifs("mount", str(primary), *mirrors, str(tmp_path / "mnt"), *args)
        assert out.returncode == 0, out.stderr
        mnt = tmp_path / "mnt"
        try:
            a.write_text("eio")
            read_all(mnt, primary)
            assert stats(mnt)["replicas"][1]["health"]["state"] == "down"
            a.write_text("hang")  # its next check read (after a 1 s back-off) never answers
            b.write_text("eio")
            read_all(mnt, primary)
            assert stats(mnt)["replicas"][2]["health"]["state"] == "down"
            time.sleep(1.5)  # the first mirror's check is hanging by now
            b.write_text("ok")
            t0 = time.monotonic()
            while stats(mnt)["replicas"][2]["health"]["state"] != "up":
                assert time.monotonic() - t0 < 8, stats(mnt)["replicas"][2]["health"]
                time.sleep(0.1)
            assert stats(mnt)["replicas"][1]["health"]["state"] == "down"
            read_all(mnt, primary)
        finally:
            a.write_text("ok")  # the hung check returns
            run_colifs("umount", str(mnt))
            force_unmount(mnt)


def test_a_mirror_close_that_blocks_holds_up_no_open_of_the_file(tmp_path: Path, engine: str) -> None:
    """Closing a mirror copy can block (a FUSE or NFS mirror's flush): the daemon closes it
    without the file's lock (native) or off the loop thread (pyfuse3), so the next open and read
    of that file go on meanwhile."""
    with through_faultfs(tmp_path) as (primary, mnt, control):
        name = sorted(p.name for p in primary.glob("*.safetensors"))[0]
        read_all(mnt, primary)
        control.write_text("hang-flush")
        size = (primary / name).stat().st_size
        assert read_direct(mnt / name, 0, size) == (primary / name).read_bytes()  # then closed:
        time.sleep(0.5)  # its release closes the mirror copy, whose flush hangs
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            again = pool.submit(read_direct, mnt / name, 0, size)
            try:
                assert again.result(timeout=5) == (primary / name).read_bytes()
            finally:
                control.write_text("ok")


def daemon_threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_check_reads_on_a_hung_mirror_leave_one_thread_behind_not_one_each(tmp_path: Path) -> None:
    """The mirror's reads hang for good: once it is down, each check read times out. Only the
    first leaves a thread stuck in the mirror; the next ones wait for that thread and time out
    without starting another (before: one more thread per check, until the daemon's shared
    thread limiter ran dry and could no longer unmount)."""
    with through_faultfs(tmp_path, "--mirror-timeout", "0.3") as (primary, mnt, control):
        pid = stats(mnt)["pid"]
        control.write_text("hang")
        read_all(mnt, primary)  # right bytes, from the primary, as the mirror times out

        def health() -> dict:
            return stats(mnt)["replicas"][1]["health"]

        deadline = time.monotonic() + 30
        while health()["checks"] < 1:
            assert time.monotonic() < deadline, health()
            time.sleep(0.1)
        threads = daemon_threads(pid)
        while health()["checks"] < 4:  # back-offs of 1, 2, 4 s
            assert time.monotonic() < deadline, health()
            time.sleep(0.1)
        assert health()["state"] == "down"
        assert daemon_threads(pid) <= threads + 1, (threads, daemon_threads(pid))
        control.write_text("ok")


def test_a_mirror_that_vanishes_while_files_are_open(tmp_path: Path) -> None:
    primary, source = setup_model(tmp_path)
    with (
        faulty_mirror(source, tmp_path / "faulty", tmp_path / "control") as proc,
        colifs_on(primary, tmp_path / "faulty", tmp_path / "mnt") as mnt,
    ):
        files = sorted(primary.glob("*.safetensors"))
        held = [os.open(mnt / p.name, os.O_RDONLY | os.O_DIRECT) for p in files]  # colifs keeps them open
        try:
            read_all(mnt, primary)
            proc.send_signal(signal.SIGKILL)  # the mirror's filesystem is gone
            proc.wait()
            read_all(mnt, primary)  # still the right bytes, from the primary
            st = stats(mnt)
            assert st["fallbacks"] > 0 and st["replicas"][1]["read_errors"] > 0
        finally:
            for fd in held:
                os.close(fd)
        read_all(mnt, primary)  # reopened: the mirror cannot be opened, the primary serves


def test_a_mirror_mounted_again_while_files_stay_open_serves_again(tmp_path: Path) -> None:
    """The mirror's filesystem is mounted again (a USB re-plug, NFS, a restarted FUSE mirror) while
    the model stays open: the descriptors colifs holds fail, fresh opens work. Its reads fall back,
    the mirror goes down, a check read passes and it comes back up, and then its copies are opened
    again: it serves and stays up (it used to keep the dead descriptors and flap until the files
    were closed)."""
    primary, source = setup_model(tmp_path)
    control = tmp_path / "control"
    with (
        faulty_mirror(source, tmp_path / "faulty", control),
        colifs_on(primary, tmp_path / "faulty", tmp_path / "mnt") as mnt,
    ):
        files = sorted(primary.glob("*.safetensors"))
        held = [os.open(mnt / p.name, os.O_RDONLY | os.O_DIRECT) for p in files]  # colifs keeps them open
        try:
            read_all(mnt, primary)
            control.write_text("stale")
            read_all(mnt, primary)  # the right bytes: the mirror's failures fall back
            down = stats(mnt)["replicas"][1]
            assert down["read_errors"] > 0 and down["health"]["state"] == "down", down
            wait_until_up(mnt)
            before = stats(mnt)["replicas"][1]
            for _ in range(5):
                read_all(mnt, primary)
            after = stats(mnt)["replicas"][1]
            assert after["health"]["state"] == "up", after["health"]
            assert after["read_errors"] == before["read_errors"], (before, after)
            assert after["bytes_served"] > before["bytes_served"]
        finally:
            for fd in held:
                os.close(fd)


def daemon_fds(pid: int) -> list[str]:
    """What the descriptors other than /dev/fuse point at (the native engine clones one per FUSE
    thread, as load starts threads)."""
    return sorted(target for target in daemon_files(pid).values() if target != "/dev/fuse")


def daemon_fds_back_to(pid: int, count: int, within: float = 10.0) -> list[str]:
    """`daemon_fds` once there are `count` of them again, or after `within` s. FUSE releases arrive
    just after the last close, and a down mirror's check read holds a descriptor for a moment: a
    count is judged once it came back, not at one look."""
    deadline = time.monotonic() + within
    while len(held := daemon_fds(pid)) != count and time.monotonic() < deadline:
        time.sleep(0.1)
    return held


def daemon_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:")) * 1024


def test_soak_32_readers_while_the_mirror_flips(tmp_path: Path) -> None:
    """Bounded in CI (COLIFS_SOAK_SECONDS, default 20); longer by setting it. The mirror flips
    between healthy, EIO, short reads and hung reads."""
    import mmap as mmap_mod
    import random

    seconds = float(os.environ.get("COLIFS_SOAK_SECONDS", "20"))
    primary, source = setup_model(tmp_path)
    control = tmp_path / "control"
    want = {p.name: p.read_bytes() for p in sorted(primary.glob("*.safetensors"))}
    with (
        faulty_mirror(source, tmp_path / "faulty", control),
        # a short timeout, so that the 0.4 s hangs below do time out (given-up reads, fresh buffers)
        colifs_on(primary, tmp_path / "faulty", tmp_path / "mnt", "--mirror-timeout", "0.2") as mnt,
    ):
        pid = stats(mnt)["pid"]
        fds0, rss0 = len(daemon_fds(pid)), daemon_rss(pid)
        stop = time.monotonic() + seconds
        counts = {"reads": 0, "bytes": 0, "mismatches": 0}
        errors: list[BaseException] = []
        lock = threading.Lock()

        def flip() -> None:
            modes = (
                ["ok"] * 3 + ["eio"] + ["ok"] * 3 + ["short"] + ["ok"] * 3 + ["hang"]
            )  # back up between faults
            k = 0
            while time.monotonic() < stop:
                control.write_text(modes[k % len(modes)])
                k += 1
                time.sleep(0.4)
            control.write_text("ok")

        def reader(k: int) -> None:
            rng = random.Random(k)
            try:
                while time.monotonic() < stop:
                    name = rng.choice(list(want))
                    data, path = want[name], mnt / name
                    off = rng.randrange(len(data))
                    size = rng.choice([1, 4096, 65536, 1 << 20, rng.randrange(1, 3 << 20)])
                    how = k % 3
                    if how == 0:
                        with open(path, "rb") as f:
                            got = os.pread(f.fileno(), size, off)
                    elif how == 1:
                        with (
                            open(path, "rb") as f,
                            mmap_mod.mmap(f.fileno(), 0, prot=mmap_mod.PROT_READ) as mm,
                        ):
                            got = mm[off : off + size]
                    else:
                        got = read_direct(path, off, size)
                    with lock:
                        counts["reads"] += 1
                        counts["bytes"] += len(got)
                        counts["mismatches"] += got != data[off : off + size]
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=flip)] + [
            threading.Thread(target=reader, args=(k,)) for k in range(32)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        held = daemon_fds_back_to(pid, fds0)
        fds1, rss1 = len(held), daemon_rss(pid)
        st = stats(mnt)
        health = st["replicas"][1]["health"]
        print(
            f"\nsoak {seconds:g} s: {counts['reads']} reads, {counts['bytes'] / 1e9:.2f} GB, "
            f"{counts['mismatches']} mismatches, fallbacks {st['fallbacks']}, mirror timeouts "
            f"{health['timeouts']}, times down {health['times_down']}, "
            f"daemon fds {fds0} -> {fds1}, RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB"
        )
        assert errors == [] and counts["mismatches"] == 0
        assert counts["reads"] > 1000 and st["fallbacks"] > 0 and health["timeouts"] > 0
        assert fds1 == fds0, held  # every descriptor opened for the readers was closed again
        assert rss1 - rss0 < 200 * 2**20  # bounded: at most the buffer pool (128 x 1 MiB) and caches


@pytest.mark.parametrize("change", ["rewritten in place", "truncated", "replaced (new inode)"])
def test_a_mirror_file_changed_after_mount_is_never_served(tmp_path: Path, change: str) -> None:
    primary, mirror = setup_model(tmp_path)
    target = sorted(primary.glob("*.safetensors"))[0]
    other = tmp_path / "other"
    with colifs_on(primary, mirror, tmp_path / "mnt") as mnt:
        held = os.open(mnt / target.name, os.O_RDONLY | os.O_DIRECT)  # open before the change
        try:
            read_all(mnt, primary)
            m = mirror / target.name
            stamp = m.stat().st_mtime_ns
            if change == "rewritten in place":
                with open(m, "r+b") as f:  # same size, same inode, other bytes after the header
                    f.seek(m.stat().st_size // 2)
                    f.write(os.urandom(1 << 20))
                os.utime(m, ns=(stamp + 10**9, stamp + 10**9))
            elif change == "truncated":
                os.truncate(m, m.stat().st_size // 2)
            else:
                other.write_bytes(os.urandom(m.stat().st_size))
                os.replace(other, m)
            before = stats(mnt)["replicas"][1]["bytes_served"]
            data = target.read_bytes()
            for off in range(0, len(data), 1 << 20):  # through the handle opened before the change
                buf = mmap.mmap(-1, 1 << 20)
                n = os.preadv(held, [buf], off)
                assert bytes(buf[:n]) == data[off : off + n]
            read_all(mnt, primary)  # and through new opens
            st = stats(mnt)
            entry = st["files"][target.name]
            if change != "replaced (new inode)":  # a renamed-over copy: the open handle still reads
                assert entry["replicas"] == [str(primary)]  # the old, unchanged inode (right bytes)
                assert "changed since mount" in entry["note"]
                assert any(target.name in w and "changed since mount" in w for w in st["recent_warnings"])
            read_all(mnt, primary)
            assert stats(mnt)["replicas"][1]["bytes_served"] >= before  # other files still mirrored
        finally:
            os.close(held)
        read_all(mnt, primary)  # after the last close the file is reopened: the change is seen
        st = stats(mnt)
        assert st["files"][target.name]["replicas"] == [str(primary)]
        assert "changed since mount" in st["files"][target.name]["note"]


def rewrite_in_place_keeping_mtime(path: Path) -> None:
    """Every byte after the safetensors header inverted, on the same inode, its size kept and its
    mtime put back: what `rsync --inplace -t`, `cp -p` onto the file or `touch -r` leave. Only the
    ctime, which user space cannot set, tells."""
    st = path.stat()
    with open(path, "r+b") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
        f.seek(start)
        data = f.read()
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = path.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert now.st_ctime_ns != st.st_ctime_ns


def test_a_mirror_copy_rewritten_in_place_with_its_mtime_restored_is_never_served(tmp_path: Path) -> None:
    """Same device, inode, size and mtime, other bytes: the copy's ctime moved, so it is dropped for
    its file, which reads the primary's bytes; the other files stay mirrored."""
    primary, mirror = setup_model(tmp_path)
    target, other = sorted(primary.glob("*.safetensors"))[:2]
    with colifs_on(primary, mirror, tmp_path / "mnt") as mnt:
        read_all(mnt, primary)
        assert stats(mnt)["replicas"][1]["bytes_served"] > 0  # the mirror serves, the test proves something
        rewrite_in_place_keeping_mtime(mirror / target.name)
        before = stats(mnt)["replicas"][1]["bytes_served"]
        data = target.read_bytes()
        for _ in range(3):
            assert read_direct(mnt / target.name, 0, len(data)) == data
        st = stats(mnt)
        assert st["replicas"][1]["bytes_served"] == before  # none of that file from the mirror
        entry = st["files"][target.name]
        assert entry["replicas"] == [str(primary)] and "changed since mount" in entry["note"], entry
        assert "ctime" in entry["note"], entry
        assert read_direct(mnt / other.name, 0, other.stat().st_size) == other.read_bytes()
        assert stats(mnt)["replicas"][1]["bytes_served"] > before  # the other files still mirrored


def test_a_failing_primary_is_eio_and_the_mount_keeps_serving(tmp_path: Path) -> None:
    """The primary itself through the fault-injecting FUSE: EIO to the caller, logged, and the
    same files read fine again once the drive answers."""
    primary, source = setup_model(tmp_path)
    control = tmp_path / "control"
    with (
        faulty_mirror(primary, tmp_path / "faulty", control),
        colifs_on(tmp_path / "faulty", source, tmp_path / "mnt") as mnt,
    ):
        name = sorted(p.name for p in primary.glob("*.safetensors"))[0]
        read_all(mnt, primary)
        control.write_text("eio")
        with pytest.raises(OSError) as e:
            read_direct(mnt / name, 0, 1 << 20)  # the header is always the primary's
        assert e.value.errno == 5
        st = stats(mnt)
        assert st["replicas"][0]["read_errors"] >= 1 and "read error" in st["replicas"][0]["last_error"]
        assert any("primary read error" in w for w in st["recent_warnings"])
        control.write_text("ok")
        read_all(mnt, primary)  # still mounted, still right


@contextmanager
def slow_drives(tmp_path: Path) -> Iterator[tuple[Path, list[Path]]]:
    """The test model on two faultfs drives slowed to 30 and 10 MB/s: (its source, the drives). Slow
    enough that faultfs' own CPU, on a busy machine, does not slow them further."""
    source, copy = setup_model(tmp_path)
    slow = [tmp_path / "slow-primary", tmp_path / "slow-mirror"]
    controls = [tmp_path / "control-primary", tmp_path / "control-mirror"]
    with faulty_mirror(source, slow[0], controls[0]), faulty_mirror(copy, slow[1], controls[1]):
        for control, mb in zip(controls, (30, 10), strict=True):
            control.write_text(f"slow {mb}")
        yield source, slow


def test_slow_drives_probed_at_mount_get_the_small_readahead(tmp_path: Path, engine: str) -> None:
    """Without weights the mount probes the drives: the native engine's readahead is 32 KiB when they
    read below 600 MB/s together (llama.cpp's mmap decode on slow drives), and stats.json says why.
    A readahead given stays; the pyfuse3 engine keeps its own default."""
    with slow_drives(tmp_path) as (_, slow):
        for flags, want in (([], 32 if engine == "native" else 512), (["--readahead-kb", "128"], 128)):
            with colifs_on(*slow, tmp_path / "mnt", "--probe-seconds", "0.5", *flags, weights=None) as mnt:
                st = stats(mnt)
                together = sum(r["weight"] for r in st["replicas"])
                assert st["weights_source"] == "probed" and together < 200, st["probe"]
                chosen = st["kernel"]["read_ahead_chosen"]
                if flags:
                    assert chosen == "given"
                elif engine == "native":
                    assert chosen == f"the drives probed at {together:.4g} MB/s together, below 600", chosen
                else:
                    assert chosen == "the default"
                if os.geteuid() == 0:  # the readahead is a sysfs knob
                    assert st["kernel"]["read_ahead_kb"] == want, st["kernel"]
            mnt.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="the readahead is a sysfs knob")
def test_a_mount_with_weights_takes_the_readahead_of_the_speed_its_drives_deliver(
    tmp_path: Path, engine: str
) -> None:
    """Weights given and no drive timed (--probe-seconds 0), so the mount starts at the default
    readahead; once both drives, slowed to 30 and 10 MB/s, were read saturated for a while, the native
    engine's readahead for later opens is 32 KiB, and stats.json says it was measured. The pyfuse3
    engine keeps its own. (Timed at mount: test_probe_and_knobs.)"""
    with slow_drives(tmp_path) as (source, slow):
        with colifs_on(*slow, tmp_path / "mnt", "--probe-seconds", "0", weights="3,1") as mnt:
            first = stats(mnt)["kernel"]
            assert first["read_ahead_kb"] == (128 if engine == "native" else 512), first
            t0, seconds = time.monotonic(), 30 if engine == "native" else 6
            while time.monotonic() - t0 < seconds and stats(mnt)["kernel"]["read_ahead_kb"] != 32:
                read_all(mnt, source)  # both drives busy: every byte still the primary's
            st = stats(mnt)
        if engine == "native":
            assert st["kernel"]["read_ahead_kb"] == 32, (st["kernel"], st["balance"])
            chosen = st["kernel"]["read_ahead_chosen"]
            assert chosen.startswith("the drives measured saturated at "), chosen
            together = sum(st["balance"]["saturated_mb_per_s"])
            assert 25 < together < 60, st["balance"]  # 40 MB/s, as faultfs counts it
        else:
            assert st["kernel"] == first, st["kernel"]


@contextmanager
def watching(mnt: Path) -> Iterator[dict]:
    """stats.json's balance every 0.2 s while the block runs: the mirror's time alone, and the reason
    of every change (one look after each read_all would miss a change that another replaced)."""
    seen: dict = {"alone": [], "whys": set()}
    done = threading.Event()

    def look() -> None:
        while not done.wait(0.2):
            balance = stats(mnt)["balance"]
            seen["alone"].append(balance["alone"][1])
            seen["whys"].add(balance["last_change"]["why"].split(":")[0])

    t = threading.Thread(target=look)
    t.start()
    try:
        yield seen
    finally:
        done.set()
        t.join()


def test_a_mirror_that_slows_down_loses_its_share_while_serving(tmp_path: Path, engine: str) -> None:
    """Mounted with equal weights; the mirror slows to 4 MB/s mid-run: within seconds the weights in
    force follow what each drive delivers (no remount), and every byte stays the primary's. Both
    engines do so by default, because their O_DIRECT reader waits on the mirror alone (stats.json
    balance.alone, the reason of the last change)."""
    with through_faultfs(tmp_path) as (primary, mnt, control), watching(mnt) as seen:
        assert stats(mnt)["balance"]["adaptive"] and stats(mnt)["replicas"][1]["weight_share"] == 0.5
        control.write_text("slow 4")
        t0, shares = time.monotonic(), []
        while time.monotonic() - t0 < 60:  # a read_all takes seconds: ends as soon as the share is down
            read_all(mnt, primary)  # the right bytes, every one, through every change
            shares.append(stats(mnt)["balance"]["shares"][1])
            if shares[-1] < 0.1:
                break
        took = time.monotonic() - t0
        alone, whys = max(seen["alone"], default=0.0), seen["whys"]
        after = stats(mnt)
        assert after["balance"]["shares"][1] < 0.1, (
            shares,
            after["balance"]["last_change"],
            after["balance"]["utilization"],
        )
        assert after["balance"]["changes"] >= 1
        assert len(after["balance"]["alone"]) == 2
        assert alone > 0.05, shares  # the reader waited on the slowed mirror alone
        assert "time alone" in whys, whys  # and that moved the split
        assert after["replicas"][1]["measured_mb_per_s"] < 20 < after["replicas"][0]["measured_mb_per_s"]
        assert after["replicas"][1]["weight_share"] == after["balance"]["shares"][1]
        assert after["fallbacks"] == 0  # slow is not failed: nothing was re-read
        last = after["balance"]["last_change"]
        assert last["at"] and (last["shares_before"] == [0.5, 0.5] or after["balance"]["changes"] > 1)
        assert "measured" in run_colifs("stats", str(mnt)).stdout
        assert "colifs_drive_waited_alone_ratio{" in run_colifs("stats", str(mnt), "--prometheus").stdout
        print(f"\nmirror share {shares} in {took:.1f} s: {after['balance']}")


def test_queue_routing_with_fixed_weights_keeps_the_weights_as_mounted(tmp_path: Path, engine: str) -> None:
    """`--routing queue --fixed-weights`: backlogs spill, the weights stay as mounted; the drives are
    measured and shown all the same."""
    if engine == "pyfuse3":
        pytest.skip("--routing queue is the native engine's")
    with through_faultfs(tmp_path, "--routing", "queue", "--fixed-weights") as (primary, mnt, control):
        control.write_text("slow 8")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4:
            read_all(mnt, primary)
        after = stats(mnt)
        assert not after["balance"]["adaptive"] and after["balance"]["changes"] == 0
        assert after["balance"]["shares"] == [0.5, 0.5]
        assert after["balance"]["measured_mb_per_s"][1] < 20  # still measured and shown


def test_fixed_weights_keep_a_slow_mirrors_share(tmp_path: Path) -> None:
    """--fixed-weights (fstab fixed_weights): the split stays as mounted whatever the drives do:
    a slowed mirror keeps its half of the bytes (nothing spilled, no weight moved), every byte the
    primary's. What the default routing does instead is the next test."""
    with through_faultfs(tmp_path, "--fixed-weights") as (primary, mnt, control):
        assert stats(mnt)["routing"] == "stripe"
        control.write_text("slow 16")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda _: read_all(mnt, primary), range(2)))
        after = stats(mnt)
        control.write_text("ok")
        served = [r["bytes_served"] for r in after["replicas"]]
        assert after["replicas"][1].get("bytes_spilled", 0) == 0 and after["balance"]["changes"] == 0
        assert 0.3 < served[1] / sum(served) < 0.7, served  # about half, as the weights 1,1 say
        assert after["fallbacks"] == 0


def test_one_reader_with_wrong_weights_follows_the_measured_speeds(tmp_path: Path, engine: str) -> None:
    """Weights 1,1, the mirror slowed to 8 MB/s, ONE O_DIRECT reader: its many requests in flight
    queue on both drives alike, so only the drives' measured speeds (colifs.balance, every second)
    tell the mirror's backlog from the primary's: once measured, the mirror's pieces go to the
    primary (the queue routing before measured speeds kept the split at 1:1). With the weights
    fixed, so that the spill alone is seen (by default the weights move too)."""
    if engine == "pyfuse3":
        pytest.skip("--routing queue is the native engine's")
    with through_faultfs(tmp_path, "--routing", "queue", "--fixed-weights") as (primary, mnt, control):
        control.write_text("slow 8")

        def read_for(seconds: float) -> dict:
            stop = time.monotonic() + seconds
            while time.monotonic() < stop:
                read_all(mnt, primary)
            return stats(mnt)

        before = read_for(3)  # the speeds are measured meanwhile
        after = read_for(3)
        served = [
            a["bytes_served"] - b["bytes_served"]
            for a, b in zip(after["replicas"], before["replicas"], strict=True)
        ]
        assert served[1] < 0.25 * sum(served), (served, after["balance"], after["replicas"])
        assert after["replicas"][1]["bytes_spilled"] > before["replicas"][1]["bytes_spilled"]
        assert after["fallbacks"] == 0 and after["balance"]["changes"] == 0  # the weights stayed 1,1
        control.write_text("ok")


def test_queue_routing_spills_a_slow_mirrors_backlog_to_the_primary(tmp_path: Path, engine: str) -> None:
    """--routing queue, weights 1,1, the mirror slowed to 4 MB/s and 8 O_DIRECT readers: the routes
    give the mirror half the bytes; the pieces queued behind its backlog go to the primary instead,
    with no remount and no re-read, and every byte stays the primary's (the weights fixed, so that
    the spill alone is seen)."""
    if engine == "pyfuse3":
        pytest.skip("--routing queue is the native engine's")
    with through_faultfs(tmp_path, "--routing", "queue", "--fixed-weights") as (primary, mnt, control):
        assert stats(mnt)["routing"] == "queue" and stats(mnt)["replicas"][1]["weight_share"] == 0.5
        control.write_text("slow 4")
        stop = time.monotonic() + 4

        def reader(_: int) -> int:
            rounds = 0
            while time.monotonic() < stop:
                read_all(mnt, primary)
                rounds += 1
            return rounds

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            rounds = sum(pool.map(reader, range(8)))
        after = stats(mnt)
        served = [r["bytes_served"] for r in after["replicas"]]
        assert 0 < served[1] < 0.2 * sum(served), (served, rounds)
        assert after["replicas"][1]["bytes_spilled"] > after["replicas"][0]["bytes_spilled"]
        assert after["fallbacks"] == 0 and after["balance"]["changes"] == 0  # the weights stayed 1,1
        print(f"\nmirror {served[1] / sum(served):.1%} of {sum(served) / 1e6:.0f} MB in {rounds} rounds")
