"""`colifs mirror add` judges a directory as `colifs mount` judges its mirrors, and a copy that
joins while the mount serves (mirror add, reload) proves its bytes before it serves.

Judged by the client before it asks and by the daemon again (asked directly here, past the
client): never the mount point or anything under it (the mount would read itself), not even by
a symlink per file; not the primary nor a live mirror by another path (a bind mount); a Hugging
Face cache repository is its snapshot. The proof (colifs.proof): size and header are public, so
the daemon compares the copies' bytes with the primary's (sampled, `--deep`: every byte) and
nothing a client sends makes it skip that; a deep proof stops with the command's timeout or the
unmount.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from colifs.client import _alive
from colifs.control import ask
from colifs.errors import QuietError
from tests.helpers import is_mounted, mounted, read_direct, refuse, run_colifs, shards
from tests.mount.test_faults import faulty_mirror, setup_model
from tests.mount.test_stores import hf_repo

pytestmark = pytest.mark.mounts  # every test here runs on both engines


def read_all_right(mnt: Path, primary: Path) -> None:
    for p in shards(primary):
        assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes(), p.name


def asked_directly(m, path: Path, **extra: object) -> QuietError:
    """The daemon's own answer to a mirror-add request, past the client's checks."""
    request = {"command": "mirror-add", "path": str(path), "wait": 20, **extra}
    with pytest.raises(QuietError) as e:
        st = m.stats()
        ask(st["pid"], st["uid"], request, 30, also=st.get("control_socket"))
    return e.value


def corrupt_data(path: Path) -> None:
    """Other bytes in the data, the size and header as they were (a new file, as a copy tool makes)."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    for at in range(start, len(data), 4096):
        data[at] ^= 0x5A
    new = path.with_name(path.name + ".tmp")
    new.write_bytes(bytes(data))
    new.replace(path)


@contextlib.contextmanager
def bound(source: Path, at: Path) -> Iterator[Path]:
    at.mkdir()
    subprocess.run(["mount", "--bind", str(source), str(at)], check=True)
    try:
        yield at
    finally:
        subprocess.run(["umount", "-l", str(at)], capture_output=True)


def test_the_mount_point_or_a_path_into_it_is_never_a_mirror(model, tmp_path: Path) -> None:
    """`colifs mirror add /mnt/m /mnt/m` used to validate through the mount and have the daemon
    read its own mount. A symlink to it, a directory of symlinks into it, the directory holding it:
    each refused, by the client and by the daemon, and the mount serves on, from the primary."""
    primary, _, mnt = model
    links, to_mnt = tmp_path / "links", tmp_path / "to-mnt"
    links.mkdir()
    to_mnt.symlink_to(mnt)
    for p in primary.iterdir():
        (links / p.name).symlink_to(mnt / p.name)  # per file: only resolving each file finds it
    with mounted(primary, [], mnt, "--weights", "1") as m:
        refuse(
            ["mirror", "add", str(mnt), str(mnt)],
            2,
            f"{mnt} is the mount point: the mount would read its own",
        )
        refuse(
            ["mirror", "add", str(mnt), str(to_mnt)], 2, "is the mount point: the mount would read its own"
        )
        refuse(["mirror", "add", str(mnt), str(mnt.parent)], 2, f"mountpoint {mnt} is inside {mnt.parent}")
        refuse(["mirror", "add", str(mnt), str(links)], 2, "not a replica")
        for path in (mnt, to_mnt, mnt.parent):
            said = asked_directly(m, path)
            assert said.exit_code == 2 and "mount" in str(said), said
        said = asked_directly(m, links)
        assert said.exit_code == 2 and "not a replica" in str(said)
        st = m.stats()
        assert [r["path"] for r in st["replicas"]] == [str(primary)] and st["reload"]["mirror_change"] == {}
        read_all_right(mnt, primary)
        assert m.stats()["replicas"][0]["bytes_served"] > 0


def test_the_primary_or_a_live_mirror_by_another_path_is_refused(model, tmp_path: Path) -> None:
    """The same directory by a bind mount: refused as it is by its own path (it would join as one
    more mirror, the same drive twice, or the primary as its own mirror)."""
    if os.geteuid() != 0:
        pytest.skip("bind mounts need root")
    primary, mirror, mnt = model
    with (
        bound(mirror, tmp_path / "mirror-again") as again,
        bound(primary, tmp_path / "primary-again") as primary_again,
        mounted(primary, [mirror], mnt, "--weights", "1,1") as m,
    ):
        refuse(["mirror", "add", str(mnt), str(again)], 2, "is a mirror of this mount already")
        refuse(["mirror", "add", str(mnt), str(primary_again)], 2, "is the primary of this mount")
        assert "a mirror of this mount already" in str(asked_directly(m, again))
        assert "is the primary" in str(asked_directly(m, primary_again))
        assert [r["path"] for r in m.stats()["replicas"]] == [str(primary), str(mirror)]
        read_all_right(mnt, primary)


def test_a_hugging_face_repository_joins_as_its_snapshot(tmp_path: Path) -> None:
    """As at mount: a cache repository directory serves the snapshot its ref names."""
    from colifs.synth import write_checkpoint

    src = tmp_path / "src"
    write_checkpoint(str(src), "deepseek", layers=2, experts=8, hidden=128, inter=64, shards=2)
    primary = hf_repo(tmp_path / "hub1", src)
    second = hf_repo(tmp_path / "hub2", src)
    snapshot = next((second / "snapshots").iterdir())
    mnt = tmp_path / "mnt"
    with mounted(primary, [], mnt, "--weights", "1") as m:
        out = run_colifs("mirror", "add", str(mnt), str(second), "--weight", "1")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"mirror {snapshot} added: 2 files served from it"), out.stdout
        st = m.stats()
        assert st["replicas"][1]["path"] == str(snapshot) and st["revision"] == "main"
        for p in shards(src):
            assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes()
        assert m.stats()["replicas"][1]["bytes_served"] > 0


@pytest.mark.daemon_warns(r"not used: data differs")
def test_copies_whose_bytes_differ_never_serve_whatever_the_client_asks(model, tmp_path: Path) -> None:
    """Same size, same header, other bytes: the mount used to add them and serve their bytes."""
    primary, mirror, mnt = model
    names = [p.name for p in shards(mirror)]
    forged = tmp_path / "forged"
    shutil.copytree(mirror, forged)
    for name in names:
        corrupt_data(forged / name)
    with mounted(primary, [], mnt, "--weights", "1") as m:
        refuse(["mirror", "add", str(mnt), str(forged)], 2, "none of its 3 copies holds the primary's bytes")
        for extra in ({}, {"deep": False}, {"deep": "no"}, {"proof": "none"}):  # nothing turns it off
            said = asked_directly(m, forged, **extra)
            assert said.exit_code == 2 and "none of its 3 copies" in str(said), said
        assert len(m.stats()["replicas"]) == 1
        assert m.stats()["reload"]["proof"]["refused_count"] == 3
        shutil.rmtree(forged)
        shutil.copytree(mirror, forged)
        corrupt_data(forged / names[1])  # one bad copy of three
        out = run_colifs("mirror", "add", str(mnt), str(forged), "--weight", "1")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(
            f"mirror {forged} added: 2 files served from it, sampled ranges compared"
        )
        assert f"not used: {names[1]}: data differs" in out.stdout
        st = m.stats()
        assert st["files"][names[1]]["replicas"] == [str(primary)]
        assert st["reload"]["mirror_change"]["proof"]["refused"].keys() == {names[1]}
        for _ in range(3):
            read_all_right(mnt, primary)
        assert m.stats()["replicas"][1]["bytes_served"] > 0  # the good copies serve


@pytest.mark.daemon_warns(r"not used: data differs", r"changed since mount")
def test_a_reload_never_serves_a_copy_replaced_by_other_bytes(model) -> None:
    """A copy replaced after mount by a file with the same size and header (a staging tool, or
    whoever can write the mirror): the reload used to take it back by its header."""
    primary, mirror, mnt = model
    name = shards(mirror)[0].name
    saved = (mirror / name).read_bytes()
    st0 = (mirror / name).stat()
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        corrupt_data(mirror / name)
        try:
            out = run_colifs("reload", str(mnt))
            assert out.returncode == 0, out.stderr
            assert "1 refused (not the primary's bytes)" in out.stdout, out.stdout
            assert m.stats()["files"][name]["replicas"] == [str(primary)]
            for _ in range(3):
                read_all_right(mnt, primary)
        finally:
            (mirror / name).write_bytes(saved)  # as it was, for the unchanged-mirror check
            os.utime(mirror / name, ns=(st0.st_atime_ns, st0.st_mtime_ns))
        out = run_colifs("reload", str(mnt))
        assert out.returncode == 0 and "1 files added" in out.stdout, out.stdout  # proven now: back
        assert m.stats()["files"][name]["replicas"] == [str(primary), str(mirror)]


@pytest.mark.daemon_warns(r"refuses O_DIRECT", r"not proven")
def test_a_deep_proof_compares_every_byte_and_stops_with_the_timeout_or_the_unmount(tmp_path: Path) -> None:
    """A mirror on a drive reading 2 MB/s: `--deep` would take a minute. Its --timeout ends it
    (nothing changed, the proof stopped), and so does an unmount while it runs: neither waits for it."""
    primary, source = setup_model(tmp_path)
    slow, mnt = tmp_path / "slow", tmp_path / "mnt"
    control = tmp_path / "control"
    with faulty_mirror(source, slow, control), mounted(primary, [], mnt, "--weights", "1") as m:
        control.write_text("slow 2")
        t0 = time.monotonic()
        out = run_colifs("mirror", "add", str(mnt), str(slow), "--deep", "--timeout", "3")
        took = time.monotonic() - t0
        assert out.returncode == 7 and "not proven against the primary (every byte) within" in out.stderr, out
        assert took < 12, took
        st = m.stats()
        proof = st["reload"]["proof"]
        assert proof["mode"] == "deep" and proof["outcome"].startswith("stopped"), proof
        assert 0 < proof["bytes_done"] < proof["bytes"] and proof["bytes"] >= sum(
            p.stat().st_size for p in shards(primary)
        )
        assert len(st["replicas"]) == 1  # nothing changed

        command = ["mirror", "add", str(mnt), str(slow), "--deep", "--timeout", "300"]
        adding = subprocess.Popen(
            [sys.executable, "-m", "colifs", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 20
            while not (p := m.stats()["reload"]["proof"])["bytes_done"] or p["outcome"] != "running":
                assert time.monotonic() < deadline, p
                time.sleep(0.2)
            pid = m.stats()["pid"]
            t0 = time.monotonic()
            out = run_colifs("umount", str(mnt), timeout=30)
            assert out.returncode == 0, out.stderr
            assert time.monotonic() - t0 < 10 and not is_mounted(mnt)
            assert not _alive(pid)  # `colifs umount` returns once the daemon exited
            _, err = adding.communicate(timeout=30)
            assert adding.returncode != 0 and "Traceback" not in err, err
        finally:
            if adding.poll() is None:
                adding.kill()
                adding.wait()


@pytest.mark.daemon_warns(r"its file's lock is held", r"refuses O_DIRECT", r"missing")
def test_a_reload_waiting_on_a_hung_primary_open_leaves_the_loop_on_time(tmp_path: Path) -> None:
    """The primary served by a filesystem whose opens hang: a reader's open holds its file's lock
    in the native engine, and a reload that drops the mirror's copy of that file needs the lock.
    The reload returns, the loop keeps its time (health checks, signals, the control socket), and
    the change lands once the open returns."""
    primary, source = setup_model(tmp_path)
    name = shards(primary)[0].name
    hung, mnt = tmp_path / "hung", tmp_path / "mnt"
    control = tmp_path / "control"
    with (
        faulty_mirror(primary, hung, control),
        mounted(hung, [source], mnt, "--weights", "1,1", "--no-usage") as m,
    ):
        control.write_text("hang-open-direct")
        opener = subprocess.Popen([sys.executable, "-c", f"open({str(mnt / name)!r}, 'rb').read(1)"])
        try:
            time.sleep(1.0)  # its open waits in the primary's
            assert opener.poll() is None
            aside = tmp_path / "aside"
            (source / name).rename(aside)  # the mirror's copy gone: the reload drops it
            out = run_colifs("reload", str(mnt), "--timeout", "30")
            assert out.returncode == 0, out.stderr
            worst = m.stats()["loop"]["late_ms_recent"]
            time.sleep(2.0)
            worst = max(worst, m.stats()["loop"]["late_ms_recent"])
            assert worst < 500, worst  # the loop ran on while the open hung
            assert opener.poll() is None
            control.write_text("ok")
            assert opener.wait(timeout=20) == 0
            deadline = time.monotonic() + 10
            while m.stats()["files"][name]["replicas"] != [str(hung)]:
                assert time.monotonic() < deadline, m.stats()["files"][name]
                time.sleep(0.1)
            aside.rename(source / name)
            for p in shards(primary):
                assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes()
        finally:
            control.write_text("ok")
            if opener.poll() is None:
                opener.kill()
            with contextlib.suppress(FileNotFoundError):
                (tmp_path / "aside").rename(source / name)
        assert json.loads((mnt / ".colifs" / "stats.json").read_text())["replicas"][0]["read_errors"] == 0
