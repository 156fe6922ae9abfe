"""Reload while serving (`colifs reload`, SIGHUP): mirrors checked again, copies added and dropped,
no reader disturbed. Every mirror ends as it was at mount (a copy is moved away and back, as
`colifs stage` publishes one by a rename), so `mounted` still checks it was never written."""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import (
    HOT,
    force_unmount,
    learn_usage,
    mounted,
    read_direct,
    refuse,
    run_colifs,
    shards,
    skewed_model,
    streaming,
)

pytestmark = pytest.mark.mounts  # every test here runs on both engines


def reload(mnt: Path) -> list[str]:
    out = run_colifs("reload", str(mnt))
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def mirror_bytes(m) -> int:
    return m.stats()["replicas"][1]["bytes_served"]


def test_a_copy_staged_while_mounted_serves_after_a_reload(model) -> None:
    primary, mirror, mnt = model
    shard = shards(mirror)[0]
    aside = shard.with_name(shard.name + ".aside")
    shard.rename(aside)  # a partial mirror at mount
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        size = shard.stat().st_size if shard.exists() else aside.stat().st_size
        assert m.stats()["files"][shard.name]["replicas"] == [str(primary)]
        before = mirror_bytes(m)
        assert read_direct(mnt / shard.name, 0, size) == (primary / shard.name).read_bytes()
        assert mirror_bytes(m) == before  # not on the mirror: all from the primary

        aside.rename(shard)  # staged, as `colifs stage` publishes a copy
        lines = reload(mnt)
        assert lines == [f"mirror {mirror}: 1 files added, 0 dropped, 3 model files served"], lines
        st = m.stats()
        assert st["files"][shard.name]["replicas"] == [str(primary), str(mirror)]
        assert st["reload"]["count"] == 1 and st["reload"]["last"]["mirrors"][0]["added"] == [shard.name]
        shown = run_colifs("stats", str(mnt)).stdout
        assert "reloads 1; last at" in shown and f"{mirror} +1 -0" in shown, shown
        prom = run_colifs("stats", str(mnt), "--prometheus").stdout
        families = {f.name: f for f in text_string_to_metric_families(prom)}
        assert [x.value for x in families["colifs_reloads"].samples] == [1]
        files = {x.labels["replica"]: x.value for x in families["colifs_model_files"].samples}
        assert files == {"primary": 3, "mirror": 3}
        before = mirror_bytes(m)
        assert read_direct(mnt / shard.name, 0, size) == (primary / shard.name).read_bytes()
        assert mirror_bytes(m) > before  # the new copy takes its share

        shard.rename(aside)  # and taken away again: dropped, the mirror as it was at mount
        assert reload(mnt) == [f"mirror {mirror}: 0 files added, 1 dropped, 2 model files served"]
        before = mirror_bytes(m)
        assert read_direct(mnt / shard.name, 0, size) == (primary / shard.name).read_bytes()
        assert mirror_bytes(m) == before
        assert m.stats()["fallbacks"] == 0
    aside.rename(shard)


@pytest.mark.daemon_warns(r"header differs")
def test_a_reload_that_finds_a_changed_copy_drops_only_that_file(model) -> None:
    primary, mirror, mnt = model
    first, *others = shards(mirror)
    original = first.with_name(first.name + ".orig")
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        data = bytearray(first.read_bytes())
        data[9] ^= 0x20  # the same size, a header that differs
        first.rename(original)
        first.write_bytes(bytes(data))
        try:
            assert reload(mnt) == [f"mirror {mirror}: 0 files added, 1 dropped, 2 model files served"]
            files = m.stats()["files"]
            assert files[first.name]["replicas"] == [str(primary)]
            assert "header differs" in files[first.name]["note"]
            assert all(files[p.name]["replicas"] == [str(primary), str(mirror)] for p in others)
            for p in shards(primary):
                assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes()
        finally:
            original.replace(first)
        assert reload(mnt) == [f"mirror {mirror}: 1 files added, 0 dropped, 3 model files served"]


@pytest.mark.daemon_warns(r"changed since mount", r"header differs")
def test_readers_stream_through_many_reloads_and_get_every_byte(model, tmp_path: Path) -> None:
    """Four readers (O_DIRECT and mmap) read every file over and over while 50 reloads come and go;
    between them a mirror copy is swapped (a rename, as `colifs stage` publishes) for one with a
    different header, then for the original again: no reader error, every byte right, and the
    original copy serves once it is back."""
    primary, mirror, mnt = model
    shard = shards(mirror)[-1]
    original, bad, swap = tmp_path / "original", tmp_path / "bad", mirror / ".swap"
    os.link(shard, original)
    data = bytearray(shard.read_bytes())
    data[9] ^= 0x20
    bad.write_bytes(bytes(data))
    want = {p.name: p.read_bytes() for p in shards(primary)}
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        with streaming(mnt, want, 4) as (errors, rounds):
            for i in range(50):
                os.link(bad if i % 2 == 0 else original, swap)
                swap.replace(shard)
                reload(mnt)
        assert not errors, errors[0]
        st = m.stats()
        assert st["reload"]["count"] == 50 and min(rounds) >= 1, rounds
        assert st["files"][shard.name]["replicas"] == [str(primary), str(mirror)]  # the original, last
        before = mirror_bytes(m)
        assert read_direct(mnt / shard.name, 0, len(want[shard.name])) == want[shard.name]
        assert mirror_bytes(m) > before


def test_sighup_reloads_and_keeps_serving(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        os.kill(m.stats()["pid"], signal.SIGHUP)
        deadline = time.monotonic() + 30
        while m.stats()["reload"]["count"] == 0:
            assert time.monotonic() < deadline, "no reload after SIGHUP"
            time.sleep(0.05)
        last = m.stats()["reload"]["last"]
        assert last["mirrors"][0] == {
            "path": str(mirror),
            "checked": True,
            "removed": False,
            "added": [],
            "dropped": [],
            "busy": [],
            "refused": [],
            "model_files": 3,
        }
        for p in shards(primary):
            assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes()


CHANGED = "changed since mount; opens of it fail (EIO) until it is mounted again"


@pytest.mark.daemon_warns(r"the primary changed since mount")
def test_a_reload_says_when_the_primary_changed(model) -> None:
    primary, mirror, mnt = model
    first = shards(primary)[0]
    with mounted(primary, [mirror], mnt, "--weights", "1,1"):
        st = first.stat()
        os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        out = reload(mnt)
        assert out[-1] == f"primary {first.name}: {CHANGED}"
        with pytest.raises(OSError) as e:  # touched: not the file mounted, whatever its bytes
            read_direct(mnt / first.name, 0, 4096)
        assert e.value.errno == errno.EIO


def replaced_by_a_rename(path: Path) -> bytes:
    """`path` replaced as `hf download --local-dir` or rsync do: a new file of the same size and
    header, other tensor bytes, renamed over it. Its new bytes."""
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    new = data[:start] + bytes(b ^ 0xFF for b in data[start:])
    staged = path.with_name(f".{path.name}.part")
    staged.write_bytes(new)
    staged.replace(path)
    return new


def eio_once_released(path: Path, mounted_bytes: bytes) -> None:
    """Opens of `path` fail with EIO once the daemon saw the last open of the old file released
    (the kernel sends RELEASE a moment after close()); until then an open still shares the old
    file: every byte it reads must be that file's."""
    deadline = time.monotonic() + 10
    while True:
        try:
            got = read_direct(path, 0, len(mounted_bytes))
        except OSError as e:
            assert e.errno == errno.EIO, e
            return
        assert got == mounted_bytes  # never a byte of the new file, never a mix
        assert time.monotonic() < deadline, "opens of the replaced primary still succeed"
        time.sleep(0.05)


@pytest.mark.daemon_warns(r"the primary changed since mount")
def test_a_primary_replaced_by_a_rename_while_mounted_never_mixes_bytes(model) -> None:
    """A same-size shard with the same header replaced on the primary while mounted: an open held
    from before reads the file mounted to its end; once it is closed, opens fail with EIO and one
    warning, where the primary's pieces once came from the new file and the mirror's from the old
    copy; the other shards serve on. A reload says so, and drops the mirror's copy once that is
    replaced too (an rsync of the new file), never adding it."""
    primary, mirror, mnt = model
    target, *others = shards(primary)
    old = target.read_bytes()
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        for p in shards(primary):
            assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes()
        assert mirror_bytes(m) > 0  # both drives serve: a mix would show
        fd = os.open(mnt / target.name, os.O_RDONLY | os.O_DIRECT)
        try:
            new = replaced_by_a_rename(target)
            assert len(new) == len(old) and new != old
            buf = mmap.mmap(-1, len(old))
            assert os.preadv(fd, [buf], 0) == len(old) and buf[:] == old  # the file mounted, whole
        finally:
            os.close(fd)
        eio_once_released(mnt / target.name, old)
        for _ in range(3):
            with pytest.raises(OSError) as e:
                read_direct(mnt / target.name, 0, len(old))
            assert e.value.errno == errno.EIO
        st = m.stats()
        said = [w for w in st["recent_warnings"] if "the primary changed since mount" in w]
        assert len(said) == 1 and target.name in said[0], said
        assert "the primary changed since mount" in st["files"][target.name]["note"]
        for p in others:
            assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes()

        copy = mirror / target.name
        aside = copy.with_name(copy.name + ".orig")
        copy.rename(aside)
        copy.write_bytes(new)  # the mirror follows the primary: valid for the new file, not the old
        try:
            assert reload(mnt) == [
                f"mirror {mirror}: 0 files added, 1 dropped, 2 model files served",
                f"primary {target.name}: {CHANGED}",
            ]
            assert m.stats()["files"][target.name]["replicas"] == [str(primary)]
        finally:
            aside.replace(copy)  # the mirror as it was at mount


def test_stage_onto_a_mirror_a_mount_uses_makes_it_serve_the_new_copies(model) -> None:
    """`colifs plan` names the live mount that uses the mirror; `colifs stage` copies onto it and
    has that mount reload: the staged copies serve (vouched by the receipt), no remount."""
    primary, _, mnt = model
    mirror = primary.parent / "empty"
    mirror.mkdir()
    out = run_colifs("mount", str(primary), str(mirror), str(mnt), "--weights", "1,1")
    assert out.returncode == 0, out.stderr
    try:
        plan = run_colifs("plan", str(primary), str(mirror), "--budget", "1T")
        assert plan.returncode == 0 and f"served by: {mnt}" in plan.stdout, plan.stdout
        staged = run_colifs("stage", str(primary), str(mirror), "--budget", "1T", "-q")
        assert staged.returncode == 0, staged.stderr
        said = f"{mnt} reloaded, mirror {mirror}: 3 files added, 0 dropped, 3 model files served"
        assert said in staged.stdout, staged.stdout
        stats = mnt / ".colifs" / "stats.json"
        st = json.loads(stats.read_text())
        for p in shards(primary):
            assert st["files"][p.name]["replicas"] == [str(primary), str(mirror)]
            assert st["files"][p.name]["vouched_by_receipt"] == [str(mirror)]
        before = st["replicas"][1]["bytes_served"]
        for p in shards(primary):
            assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes()
        assert json.loads(stats.read_text())["replicas"][1]["bytes_served"] > before
    finally:
        run_colifs("umount", str(mnt))
        force_unmount(mnt)


def test_a_reload_that_completes_a_partial_mirror_routes_it_as_full(tmp_path: Path) -> None:
    """A partial mirror (the hot shards of a usage history) gets more than its plain weight for the
    files it holds; once a reload finds every shard there, the correction is gone and the weights
    in force are the plain ones again."""
    primary, ranges, hot, cold = skewed_model(tmp_path)
    learn_usage(primary, ranges, hot, cold, tmp_path / "learn")
    mirror = tmp_path / "m"
    mirror.mkdir()
    for name in HOT:
        shutil.copy2(primary / name, mirror / name)
    rest = [p for p in shards(primary) if p.name not in HOT]
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        partial = m.stats()["partial_mirror"]
        assert partial is not None and 0 < partial["coverage"][1] < 1
        assert m.stats()["reload"]["started"] == 0
        aside = tmp_path / "aside"
        aside.mkdir()
        for p in rest:  # staged while mounted: copied aside, published by a rename
            shutil.copy2(p, aside / p.name)
            (aside / p.name).rename(mirror / p.name)
        try:
            assert reload(m.path) == [
                f"mirror {mirror}: {len(rest)} files added, 0 dropped, 8 model files served"
            ]
            st = m.stats()
            assert st["partial_mirror"] is None and st["balance"]["shares"] == [0.5, 0.5]
        finally:
            for p in rest:
                (mirror / p.name).unlink()  # the mirror as it was at mount


def test_plan_and_reload_are_not_held_up_by_a_mount_that_does_not_answer(model) -> None:
    """A colifs mount whose daemon is stopped (SIGSTOP): `colifs plan` still answers, and says it
    could not ask that mount whether it uses the mirror; `colifs reload` gives up at its timeout
    (one line, exit 7)."""
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        pid = m.stats()["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            plan = run_colifs("plan", str(primary), str(mirror), "--budget", "1T")
            took = time.monotonic() - t0
            t0 = time.monotonic()
            refuse(["reload", str(mnt), "--timeout", "2"], 7, "did not reload within 2 s")
            waited = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert plan.returncode == 0 and took < 30, (took, plan.stderr)
        assert f"colifs: {mnt}: its daemon does not answer; not checked" in plan.stderr
        assert "served by" not in plan.stdout
        assert waited < 10, waited


def test_reload_of_what_is_not_a_mount_is_one_line(tmp_path: Path) -> None:
    refuse(["reload", str(tmp_path)], 3, "is not a colifs mount")
