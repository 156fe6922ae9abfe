"""Usage learned by the mount: counted per key and file, saved, merged, read back."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from colifs.formats.layout import ExpertKey
from colifs.usage import USAGE_NAME, load
from tests.helpers import expert_spans, mounted, read_experts, run_colifs


@pytest.mark.mounts
def test_the_mount_counts_saves_at_unmount_and_merges_runs(model) -> None:
    primary, mirror, mnt = model
    ranges = expert_spans(primary)
    hot = sorted(ranges)[:3]
    usage_file = primary / USAGE_NAME
    for run in (1, 2):
        with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
            assert USAGE_NAME not in os.listdir(m.path)  # colifs' own file is not part of the model
            served = read_experts(m.path, ranges, hot, times=2)
            assert m.stats()["usage"]["file"] == str(usage_file)
        # `colifs umount` returned: the daemon has saved and exited
        data = load(str(usage_file))
        assert data.runs == run
        for k in hot:
            key_bytes = sum(e - s for _, s, e in ranges[k])
            got = data.keys[k][0]
            assert got == 2 * run * key_bytes, k
        assert not any(k in data.keys for k in sorted(ranges)[3:])  # never read: not counted
        assert sum(b for b, _ in data.files.values()) == run * served
    raw = json.loads(usage_file.read_text())
    assert raw["format"] == "colifs-usage" and "page-cache" in raw["note"]


@pytest.mark.mounts
def test_usage_is_saved_periodically_and_can_be_moved_or_turned_off(model, tmp_path: Path) -> None:
    primary, mirror, mnt = model
    ranges = expert_spans(primary)
    elsewhere = tmp_path / "u" / "usage.json"
    elsewhere.parent.mkdir()
    with mounted(
        primary, [mirror], mnt, "--weights", "1,1", "--usage-file", str(elsewhere), "--usage-interval", "0.3"
    ) as m:
        read_experts(m.path, ranges, sorted(ranges)[:2])
        deadline = time.monotonic() + 10
        while not elsewhere.exists():  # saved while still mounted
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert m.stats()["usage"]["last_saved"] is not None
    assert not (primary / USAGE_NAME).exists()
    with mounted(primary, [mirror], mnt, "--weights", "1,1", "--no-usage") as m:
        read_experts(m.path, ranges, sorted(ranges)[:2])
        assert m.stats()["usage"]["file"] is None
    assert not (primary / USAGE_NAME).exists()
    out = run_colifs("mount", str(primary), str(mirror), str(mnt), "--usage-file", str(mirror / "u.json"))
    assert out.returncode == 32 and "never writes to a mirror" in out.stderr and not os.listdir(mnt)


@pytest.mark.mounts
def test_a_quiet_interval_loses_neither_the_run_nor_the_reads(model, tmp_path: Path) -> None:
    """Saves come every 0.2 s, the first reads only after several of them: the usage file still
    counts this mount as one run, with every byte read."""
    primary, mirror, mnt = model
    ranges = expert_spans(primary)
    target = tmp_path / "usage.json"
    with mounted(
        primary, [mirror], mnt, "--weights", "1,1", "--usage-file", str(target), "--usage-interval", "0.2"
    ):
        time.sleep(1.0)  # ~5 intervals with nothing served
        nbytes = read_experts(mnt, ranges, sorted(ranges)[:3])
    usage = load(str(target))
    assert usage.runs == 1
    assert sum(b for b, _ in usage.keys.values()) == nbytes


@pytest.mark.daemon_warns("cannot save")
@pytest.mark.mounts
def test_a_usage_file_that_cannot_be_written_warns_once_and_loses_nothing(model, tmp_path: Path) -> None:
    primary, mirror, mnt = model
    ranges = expert_spans(primary)
    where = tmp_path / "gone"
    where.mkdir()
    target = where / "usage.json"
    args = ("--weights", "1,1", "--usage-file", str(target), "--usage-interval", "0.2")
    with mounted(primary, [mirror], mnt, *args) as m:
        where.rmdir()  # its directory vanishes: every save fails
        served = 0
        for _ in range(5):
            served += read_experts(m.path, ranges, sorted(ranges)[:2])
            time.sleep(0.2)
        st = m.stats()
        assert st["usage"]["last_error"] and st["usage"]["last_saved"] is None
        assert sum("cannot save" in w for w in st["recent_warnings"]) == 1
        where.mkdir()  # back: the next save writes everything counted meanwhile
    assert sum(b for b, _ in load(str(target)).files.values()) == served


@pytest.mark.daemon_warns("not valid JSON")
@pytest.mark.mounts
def test_a_corrupt_usage_file_is_left_alone(model) -> None:
    primary, mirror, mnt = model
    bad = primary / USAGE_NAME
    bad.write_text("{ not json")
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        assert "not valid JSON" in m.stderr and "not updated this run" in m.stderr
        read_experts(m.path, expert_spans(primary), [ExpertKey("model.layers", 1, 0)])
    assert bad.read_text() == "{ not json"  # nothing lost: the user decides
    shutil.rmtree(mnt, ignore_errors=True)


@pytest.mark.daemon_warns("cannot be written there")
@pytest.mark.mounts
def test_a_read_only_primary_is_one_warning_at_mount(tmp_path: Path) -> None:
    import subprocess

    from colifs.synth import write_checkpoint

    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32M", "tmpfs", str(ro)], check=True)
    try:
        write_checkpoint(str(ro / "m"), "deepseek", layers=1, experts=4, hidden=128, inter=64, shards=1)
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        with mounted(ro / "m", [], tmp_path / "mnt") as m:
            assert "cannot be written there (read-only?)" in m.stderr
            assert m.stats()["usage"]["saving"] is False
            (m.path / "model-00001-of-00001.safetensors").read_bytes()
            assert "cannot save" not in " ".join(m.stats()["recent_warnings"])
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
