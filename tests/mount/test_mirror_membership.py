"""A mirror taken away while the mount serves (`colifs mirror remove`) and brought back (`colifs
mirror add`): readers never see an error or a wrong byte, the daemon keeps no descriptor on the
removed mirror's drive (it unmounts), the mirror back takes traffic again, bad input is one line."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import (
    calls_returned,
    daemon_files,
    force_unmount,
    mounted,
    read_direct,
    refuse,
    run_colifs,
    shards,
    streaming,
)
from tests.mount.test_faults import daemon_fds, daemon_fds_back_to, faulty_mirror, setup_model

pytestmark = pytest.mark.mounts  # every test here runs on both engines


def mirror_bytes(m) -> int:
    return m.stats()["replicas"][1]["bytes_served"]


def held_there(pid: int, root: Path) -> list[str]:
    """The daemon's descriptors inside `root`."""
    return [target for target in daemon_files(pid).values() if target.startswith(f"{root}/")]


@pytest.fixture
def drive(model, tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """(primary, mirror, mountpoint) with the mirror on a file system of its own (a tmpfs: its
    drive), so that a test can unmount it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    primary, copied, mnt = model
    mirror = tmp_path / "drive"
    mirror.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "colifs-test", str(mirror)], check=True)
    try:
        shutil.copytree(copied, mirror, dirs_exist_ok=True)
        yield primary, mirror, mnt
    finally:
        subprocess.run(["umount", "-l", str(mirror)], capture_output=True)


def test_a_mirror_removed_under_eight_readers_keeps_no_descriptor_and_its_drive_unmounts(drive) -> None:
    primary, mirror, mnt = drive
    want = {p.name: p.read_bytes() for p in shards(primary)}
    saved = mirror.parent / "saved"
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        pid = m.stats()["pid"]
        with streaming(mnt, want, 8) as (errors, rounds):
            deadline = time.monotonic() + 20
            while mirror_bytes(m) == 0 or min(rounds) < 1:
                assert time.monotonic() < deadline and not errors, (rounds, errors[:1])
                time.sleep(0.05)
            assert held_there(pid, mirror)  # reading from it: the test proves something
            out = run_colifs("mirror", "remove", str(mnt), str(mirror))
            assert out.returncode == 0, out.stderr
            said = f"mirror {mirror} removed: 3 files no longer read from it"
            assert out.stdout.startswith(said), out.stdout
            assert held_there(pid, mirror) == []
            shutil.copytree(mirror, saved)
            assert subprocess.run(["umount", str(mirror)], capture_output=True).returncode == 0  # not busy
            after = mirror_bytes(m)
            time.sleep(0.5)
            done = list(rounds)
            while min(r - d for r, d in zip(rounds, done, strict=True)) < 1:  # a whole round after it
                assert not errors and time.monotonic() < deadline + 20, (rounds, errors[:1])
                time.sleep(0.05)
        assert not errors, errors[0]
        st = m.stats()
        assert mirror_bytes(m) == after  # nothing read from it since
        assert st["replicas"][1]["health"]["state"] == "removed"
        assert st["reload"]["mirror_change"]["command"] == "remove"
        assert all(f["replicas"] == [str(primary)] for f in st["files"].values())
        assert "REMOVED" in (mnt / ".colifs" / "stats").read_text()
        prom = run_colifs("stats", str(mnt), "--prometheus").stdout
        families = {f.name: f for f in text_string_to_metric_families(prom)}
        assert [x.value for x in families["colifs_mirror_removed"].samples] == [1]

        # The drive back (its copies are new files: validated anew), the mirror with it.
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "colifs-test", str(mirror)], check=True)
        shutil.copytree(saved, mirror, dirs_exist_ok=True)
        out = run_colifs("mirror", "add", str(mnt), str(mirror), "--weight", "2")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"mirror {mirror} added: 3 files served from it"), out.stdout
        st = m.stats()
        assert st["replicas"][1]["health"]["state"] == "up"
        assert st["replicas"][1]["weight"] == 2
        before = mirror_bytes(m)
        for name, data in want.items():
            assert read_direct(mnt / name, 0, len(data)) == data
        assert mirror_bytes(m) > before  # it takes traffic again
        assert st["replicas"][1]["read_errors"] == 0  # reads in flight as it left: re-read, no error


def test_readers_stream_through_a_stage_a_reload_a_removal_and_an_add(model) -> None:
    """`colifs stage` fills an empty mirror that a live mount uses (and has it reload: the staged
    copies serve), then the mirror is removed and added back, three times, a reload between:
    four readers never see an error or a wrong byte."""
    primary, _, mnt = model
    mirror = primary.parent / "empty"
    mirror.mkdir()
    want = {p.name: p.read_bytes() for p in shards(primary)}
    out = run_colifs("mount", str(primary), str(mirror), str(mnt), "--weights", "1,1")
    assert out.returncode == 0, out.stderr
    try:
        with streaming(mnt, want, 4) as (errors, rounds):
            staged = run_colifs("stage", str(primary), str(mirror), "--budget", "1T", "-q")
            assert staged.returncode == 0, staged.stderr
            assert f"{mnt} reloaded, mirror {mirror}: 3 files added" in staged.stdout, staged.stdout
            for _ in range(3):
                out = run_colifs("mirror", "remove", str(mnt), str(mirror))
                assert out.returncode == 0, out.stderr
                st = json.loads((mnt / ".colifs" / "stats.json").read_text())
                assert held_there(st["pid"], mirror) == []
                assert run_colifs("reload", str(mnt)).stdout.startswith(f"mirror {mirror}: removed")
                out = run_colifs("mirror", "add", str(mnt), str(mirror))
                assert out.returncode == 0 and "3 files served" in out.stdout, out.stderr
            time.sleep(0.3)
        assert not errors, errors[0]
        assert min(rounds) >= 1, rounds
        st = json.loads((mnt / ".colifs" / "stats.json").read_text())
        # A read in flight on the mirror when it left is read from the primary: not its error.
        assert st["replicas"][1]["read_errors"] == 0 and st["replicas"][1]["bytes_served"] > 0
        assert all(f["vouched_by_receipt"] == [str(mirror)] for f in st["files"].values())
    finally:
        run_colifs("umount", str(mnt))
        force_unmount(mnt)


def test_bad_mirror_commands_are_one_line_and_the_mount_serves_on(model, tmp_path: Path) -> None:
    primary, mirror, mnt = model
    other = tmp_path / "other"
    other.mkdir()
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        refuse(["mirror", "remove", str(mnt), str(primary)], 2, "is the primary")
        refuse(["mirror", "remove", str(mnt), str(other)], 2, "is not a mirror of this mount")
        refuse(["mirror", "add", str(mnt), str(mirror)], 2, "is a mirror of this mount already")
        refuse(["mirror", "add", str(mnt), str(primary)], 2, "is the primary")
        refuse(["mirror", "add", str(mnt), str(other)], 2, "not a replica")  # it would join as a new one
        refuse(["mirror", "add", str(mnt), str(mirror), "--weight", "-1"], 2, "--weight must be")
        refuse(["mirror", "remove", str(tmp_path), str(mirror)], 3, "is not a colifs mount")
        plan = run_colifs("plan", str(primary), str(mirror), "--budget", "1T")
        assert plan.returncode == 0 and f"served by: {mnt}" in plan.stdout, plan.stdout
        assert run_colifs("mirror", "remove", str(mnt), str(mirror)).returncode == 0
        plan = run_colifs("plan", str(primary), str(mirror), "--budget", "1T")
        assert plan.returncode == 0 and "served by" not in plan.stdout, plan.stdout  # removed: not served
        refuse(["mirror", "remove", str(mnt), str(mirror)], 2, "was removed already")
        # Not a replica any more: the directory now holds something else.
        real = mirror.with_name("real")
        mirror.rename(real)
        mirror.mkdir()
        (mirror / shards(real)[0].name).write_bytes(b"not a shard")
        try:
            refuse(["mirror", "add", str(mnt), str(mirror)], 2, "not a replica")
            assert m.stats()["replicas"][1]["health"]["state"] == "removed"
        finally:
            shutil.rmtree(mirror)
            real.rename(mirror)
        assert run_colifs("mirror", "add", str(mnt), str(mirror)).returncode == 0
        for p in shards(primary):
            assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes()
        assert m.stats()["replicas"][1]["health"]["state"] == "up"


def test_one_of_two_mirrors_removed_under_readers_while_the_other_serves_on(model, tmp_path: Path) -> None:
    """The other mirror's reads of the same files go on all along: they must not keep the removed
    mirror's descriptors open."""
    primary, mirror, mnt = model
    second = tmp_path / "third"
    shutil.copytree(mirror, second)
    want = {p.name: p.read_bytes() for p in shards(primary)}
    with mounted(primary, [mirror, second], mnt, "--weights", "1,1,1") as m:
        with streaming(mnt, want, 4) as (errors, rounds):
            deadline = time.monotonic() + 20
            while min(rounds) < 1:
                assert time.monotonic() < deadline and not errors, (rounds, errors[:1])
                time.sleep(0.05)
            out = run_colifs("mirror", "remove", str(mnt), str(mirror), "--timeout", "20")
            assert out.returncode == 0, out.stderr
            pid = m.stats()["pid"]
            assert held_there(pid, mirror) == [] and held_there(pid, second)
            before = m.stats()["replicas"][2]["bytes_served"]
            done = list(rounds)
            while min(r - d for r, d in zip(rounds, done, strict=True)) < 1:
                assert not errors and time.monotonic() < deadline + 20, (rounds, errors[:1])
                time.sleep(0.05)
        assert not errors, errors[0]
        st = m.stats()
        assert st["replicas"][2]["bytes_served"] > before  # the other mirror serves on
        assert [r["health"]["state"] for r in st["replicas"][1:]] == ["removed", "up"]


def test_a_new_directory_takes_a_removed_mirrors_place_while_readers_stream(model, tmp_path: Path) -> None:
    """The old mirror's drive failed, a new one holds a copy elsewhere: remove, add the new one (its
    weight measured), readers never see an error; the old directory is never opened again."""
    primary, mirror, mnt = model
    new = tmp_path / "new"
    shutil.copytree(mirror, new)
    want = {p.name: p.read_bytes() for p in shards(primary)}
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        with streaming(mnt, want, 4) as (errors, rounds):
            assert run_colifs("mirror", "remove", str(mnt), str(mirror)).returncode == 0
            out = run_colifs("mirror", "add", str(mnt), str(new))
            assert out.returncode == 0, out.stderr
            assert out.stdout.startswith(f"mirror {new} added: 3 files served from it"), out.stdout
            st = m.stats()
            before = st["replicas"][1]["bytes_served"]
            done = list(rounds)
            deadline = time.monotonic() + 30
            while min(r - d for r, d in zip(rounds, done, strict=True)) < 1:
                assert not errors and time.monotonic() < deadline, (rounds, errors[:1])
                time.sleep(0.05)
            assert held_there(st["pid"], mirror) == [] and held_there(st["pid"], new)
        assert not errors, errors[0]
        st = m.stats()
        assert st["replicas"][1]["path"] == str(new) and st["replicas"][1]["bytes_served"] > before
        assert st["reload"]["mirror_change"]["measured_vs_primary"] > 0
        assert all(f["replicas"] == [str(primary), str(new)] for f in st["files"].values())
        assert run_colifs("reload", str(mnt)).stdout.startswith(f"mirror {new}: 0 files added, 0 dropped")


@pytest.mark.daemon_warns(r"changed since mount")
def test_a_copy_dropped_as_changed_while_its_file_stays_open_is_closed_by_a_removal(model) -> None:
    """A mirror copy found changed stops serving, but its file stays open (a server holds it):
    the engine still holds that copy's descriptor, and the removal must close it too."""
    primary, mirror, mnt = model
    shard = shards(mirror)[0]
    st0 = shard.stat()
    want = (primary / shard.name).read_bytes()
    buf = mmap.mmap(-1, len(want))
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        fd = os.open(mnt / shard.name, os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.preadv(fd, [buf], 0) == len(want) and buf[:] == want
            pid = m.stats()["pid"]
            assert any(p.endswith(shard.name) for p in held_there(pid, mirror))
            os.utime(shard, ns=(st0.st_atime_ns, st0.st_mtime_ns + 10**9))  # changed under the mount
            deadline = time.monotonic() + 20
            while m.stats()["files"][shard.name]["replicas"] != [str(primary)]:
                assert time.monotonic() < deadline, "the changed copy was not dropped"
                assert os.preadv(fd, [buf], 0) == len(want) and buf[:] == want
            os.utime(shard, ns=(st0.st_atime_ns, st0.st_mtime_ns))  # as it was (the snapshot check)
            out = run_colifs("mirror", "remove", str(mnt), str(mirror), "--timeout", "10")
            assert out.returncode == 0, out.stderr
            assert held_there(pid, mirror) == []
            assert os.preadv(fd, [buf], 0) == len(want) and buf[:] == want
        finally:
            os.close(fd)


def test_mirrors_join_a_mount_of_the_primary_alone_while_readers_stream(model, tmp_path: Path) -> None:
    """Mounted without a mirror; one joins, then a second: each takes traffic at once, the readers
    never see an error; then one leaves again."""
    primary, mirror, mnt = model
    second = tmp_path / "third"
    shutil.copytree(mirror, second)
    want = {p.name: p.read_bytes() for p in shards(primary)}

    def served(m) -> list[int]:
        return [r["bytes_served"] for r in m.stats()["replicas"]]

    def a_round_more(rounds: list[int], errors: list) -> None:
        done, deadline = list(rounds), time.monotonic() + 30
        while min(r - d for r, d in zip(rounds, done, strict=True)) < 1:
            assert not errors and time.monotonic() < deadline, (rounds, errors[:1])
            time.sleep(0.05)

    with mounted(primary, [], mnt, "--weights", "1") as m:
        with streaming(mnt, want, 4) as (errors, rounds):
            a_round_more(rounds, errors)
            out = run_colifs("mirror", "add", str(mnt), str(mirror), "--weight", "1")
            assert out.returncode == 0 and out.stdout.startswith(f"mirror {mirror} added: 3 files"), out
            a_round_more(rounds, errors)
            assert served(m)[1] > 0  # the new mirror serves
            out = run_colifs("mirror", "add", str(mnt), str(second), "--weight", "1")
            assert out.returncode == 0, out.stderr
            before = served(m)
            a_round_more(rounds, errors)
            after = served(m)
            assert after[1] > before[1] and after[2] > before[2]
            assert run_colifs("mirror", "remove", str(mnt), str(mirror)).returncode == 0
            a_round_more(rounds, errors)
        assert not errors, errors[0]
        st = m.stats()
        assert [r["path"] for r in st["replicas"]] == [str(primary), str(mirror), str(second)]
        assert [r["health"]["state"] for r in st["replicas"][1:]] == ["removed", "up"]
        assert all(f["replicas"] == [str(primary), str(second)] for f in st["files"].values())
        prom = run_colifs("stats", str(mnt), "--prometheus").stdout
        families = {f.name: f for f in text_string_to_metric_families(prom)}
        assert len(families["colifs_served_bytes"].samples) == 3
        assert held_there(st["pid"], mirror) == []


def mirror_offset(mnt: Path, name: str, size: int, start: int = 64 << 10) -> int:
    """A 4 KiB block of `name` from `start` on that the mirror (the mount's only one) serves whole now."""
    for off in range(start, size - 8192, 64 << 10):
        ends = [json.loads(os.getxattr(mnt / name, f"user.colifs.route.{x}")) for x in (off, off + 4095)]
        if all(e["drive"] == "mirror" for e in ends):
            return off
    raise AssertionError(f"no block of {name} on the mirror")


@pytest.mark.daemon_warns(r"no answer")
def test_a_mirror_put_in_a_hung_removed_ones_place_never_waits_for_it(tmp_path: Path) -> None:
    """The mirror's drive (faultfs) hangs a read's open, with one drive thread: the removal says the
    call is still inside the drive (exit 6: it cannot be unmounted yet). A directory added in its
    place serves at once, every read from it, none waiting behind the hung open (before, its reads
    queued behind it, timed out and fell back), and is removed again at once. Once the drive
    answers, the call returns and nothing of it is left: no descriptor there, no call, the daemon's
    descriptors as before."""
    primary, source = setup_model(tmp_path)
    control, faulty, new = tmp_path / "control", tmp_path / "faulty", tmp_path / "new"
    shutil.copytree(source, new)
    want = {p.name: p.read_bytes() for p in shards(primary)}
    flags = ("--weights", "1,1", "--threads-per-drive", "1", "--mirror-timeout", "0.5")
    with faulty_mirror(source, faulty, control), mounted(primary, [faulty], tmp_path / "mnt", *flags) as m:
        pid = m.stats()["pid"]
        fds0 = daemon_fds(pid)
        name = sorted(want)[0]
        off = mirror_offset(m.path, name, len(want[name]))
        control.write_text("hang-open")
        try:
            assert read_direct(m.path / name, off, 4096) == want[name][off : off + 4096]  # after 0.5 s
            out = run_colifs("mirror", "remove", str(m.path), str(faulty), "--timeout", "1")
            assert out.returncode == 6 and "1 calls are still inside its drive" in out.stderr, out
            assert m.stats()["reload"]["calls_left_behind"] == [{"path": str(faulty), "calls": 1}]

            out = run_colifs("mirror", "add", str(m.path), str(new), "--weight", "1")
            assert out.returncode == 0 and out.stdout.startswith(f"mirror {new} added: 3 files"), out
            before = m.stats()
            for _ in range(2):
                for p, data in want.items():
                    assert read_direct(m.path / p, 0, len(data)) == data
            after = m.stats()
            assert after["replicas"][1]["path"] == str(new)
            assert after["replicas"][1]["bytes_served"] > before["replicas"][1]["bytes_served"]
            assert after["fallbacks"] == before["fallbacks"]  # no read of it waited and gave up
            assert after["replicas"][1]["health"]["timeouts"] == before["replicas"][1]["health"]["timeouts"]
            assert after["replicas"][1]["health"]["state"] == "up"

            out = run_colifs("mirror", "remove", str(m.path), str(new), "--timeout", "5")
            assert out.returncode == 0, out  # nothing of it waits for the old drive's call either
            assert held_there(pid, new) == []
            assert m.stats()["reload"]["calls_left_behind"] == [{"path": str(faulty), "calls": 1}]
        finally:
            control.write_text("ok")  # the hung open returns
        calls_returned(m)
        assert held_there(pid, faulty) == []
        assert daemon_fds_back_to(pid, len(fds0)) == fds0


@pytest.mark.daemon_warns(r"no answer")
def test_a_read_queued_behind_a_hung_call_is_served_once_its_mirror_is_removed(
    tmp_path: Path, engine: str
) -> None:
    """One drive thread, no mirror timeout: a read's open hangs in the mirror's drive (faultfs), and
    a second read's job queues behind it, waiting with it. The removal ends the queued job (its copy
    is out): the second read gets its bytes from the primary at once, while the first waits for its
    call. Before, it waited for as long as the drive hung."""
    if engine == "pyfuse3":
        pytest.skip("a drive generation's queue is the native engine's")
    primary, source = setup_model(tmp_path)
    control, faulty = tmp_path / "control", tmp_path / "faulty"
    want = {p.name: p.read_bytes() for p in shards(primary)}
    flags = ("--weights", "1,1", "--threads-per-drive", "1", "--mirror-timeout", "0")
    with faulty_mirror(source, faulty, control), mounted(primary, [faulty], tmp_path / "mnt", *flags) as m:
        name = sorted(want)[0]
        first = mirror_offset(m.path, name, len(want[name]))
        second = mirror_offset(m.path, name, len(want[name]), first + (64 << 10))
        got: dict[int, bytes] = {}

        def read(off: int) -> threading.Thread:
            t = threading.Thread(target=lambda: got.update({off: read_direct(m.path / name, off, 4096)}))
            t.start()
            time.sleep(0.5)
            return t

        control.write_text("hang-open")
        try:
            hung, queued = read(first), read(second)
            assert hung.is_alive() and queued.is_alive()
            out = run_colifs("mirror", "remove", str(m.path), str(faulty), "--timeout", "1")
            assert out.returncode == 6, out
            queued.join(5)
            assert not queued.is_alive() and got[second] == want[name][second : second + 4096]
            assert hung.is_alive()
        finally:
            control.write_text("ok")  # the hung open returns
        hung.join(10)
        assert got[first] == want[name][first : first + 4096]
