"""Usage learned by the mount (issue 4, part 1): counted per key and file, saved, merged, read back."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import time
from pathlib import Path

import pytest

from colifs.formats import format_of
from colifs.layout import ExpertKey
from colifs.usage import USAGE_NAME, BadUsageFile, Usage, load, read_coli_usage, save
from tests.conftest import mounted, run_colifs


def expert_ranges(primary: Path) -> dict[ExpertKey, list[tuple[str, int, int]]]:
    """Where each expert's bytes are: (file, start, end) per tensor, from the headers."""
    out: dict[ExpertKey, list[tuple[str, int, int]]] = {}
    for p in sorted(primary.glob("*.safetensors")):
        fmt = format_of(p.name)
        assert fmt is not None
        _, _, layout = fmt.read(str(p))
        for s, e, k in layout.extents():
            if isinstance(k, ExpertKey):
                out.setdefault(k, []).append((p.name, s, e))
    return out


def read_experts(mnt: Path, ranges: dict, keys: list[ExpertKey], times: int = 1) -> int:
    """Read the experts' bytes through the mount with O_DIRECT (every byte reaches the daemon)."""
    fds: dict[str, int] = {}
    buf = mmap.mmap(-1, 1 << 22)
    n = 0
    try:
        for _ in range(times):
            for k in keys:
                for name, s, e in ranges[k]:
                    if name not in fds:
                        fds[name] = os.open(mnt / name, os.O_RDONLY | os.O_DIRECT)
                    got = os.preadv(fds[name], [memoryview(buf)[: e - s]], s)
                    assert got == e - s
                    n += got
    finally:
        for fd in fds.values():
            os.close(fd)
    return n


# -- the file ---------------------------------------------------------------------------------


def test_usage_round_trips_and_saves_add_up(tmp_path: Path) -> None:
    u = Usage(runs=1)
    u.count(ExpertKey("model.layers", 3, 7), 1000)
    u.count(ExpertKey("model.layers", 3, 7), 24)
    u.count("model.embed_tokens.weight", 4096)
    u.count_file("a.safetensors", 5120)
    path = str(tmp_path / USAGE_NAME)
    save(path, u)
    save(path, u)  # a second run (or a periodic save) adds to what the file holds
    back = load(path)
    assert back.keys[ExpertKey("model.layers", 3, 7)] == [2048, 4]
    assert back.keys["model.embed_tokens.weight"] == [8192, 2]
    assert back.files == {"a.safetensors": [10240, 2]} and back.runs == 2
    assert sorted(os.listdir(tmp_path)) == [USAGE_NAME]  # no temporary left behind


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"format": "colifs-usage", "version": 1, "runs": ' + "9" * 5000 + "}", "not valid JSON"),
        ("[]", "not a colifs usage file"),
        ('{"format": "colifs-usage", "version": 99}', "newer than this colifs reads"),
        ('{"format": "colifs-usage", "version": 1, "files": {"a": [1]}}', "malformed entry"),
        (
            '{"format": "colifs-usage", "version": 1, "experts": {"s": {"x": {"1": [1, 1]}}}}',
            "malformed entry",
        ),
    ],
)
def test_a_bad_usage_file_is_one_clear_error(tmp_path: Path, content: str, reason: str) -> None:
    path = tmp_path / USAGE_NAME
    path.write_text(content)
    with pytest.raises(BadUsageFile, match=reason):
        load(str(path))


def test_coli_usage_is_read_and_newer_versions_refused(tmp_path: Path) -> None:
    sizes = {ExpertKey("model.layers", 1, 2): 300, ExpertKey("model.layers", 0, 5): 100}
    path = tmp_path / ".coli_usage"
    path.write_text("-1 4 8\n-2 1 7\n1 2 10\n0 5 3\n3 7 4\n\n")
    u = read_coli_usage(str(path), sizes, "model.layers")
    assert u.keys == {ExpertKey("model.layers", 1, 2): [3000, 10], ExpertKey("model.layers", 0, 5): [300, 3]}
    for text, reason in [
        ("-2 2 7\n1 2 10\n", "version 2 is newer"),
        ("-1 4 8\n9 2 10\n", "outside 4 x 8"),
        ("1 2\n", "expected '<layer> <expert> <count>'"),
        ("a b c\n", "not numbers"),
        ("1 2 " + "9" * 5000 + "\n", "not numbers"),
    ]:
        path.write_text(text)
        with pytest.raises(BadUsageFile, match=reason):
            read_coli_usage(str(path), sizes, "model.layers")


# -- the mount --------------------------------------------------------------------------------


@pytest.mark.mounts
def test_the_mount_counts_saves_at_unmount_and_merges_runs(model) -> None:
    primary, mirror, mnt = model
    ranges = expert_ranges(primary)
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
    ranges = expert_ranges(primary)
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
    ranges = expert_ranges(primary)
    target = tmp_path / "usage.json"
    with mounted(
        primary, [mirror], mnt, "--weights", "1,1", "--usage-file", str(target), "--usage-interval", "0.2"
    ):
        time.sleep(1.0)  # ~5 intervals with nothing served
        nbytes = read_experts(mnt, ranges, sorted(ranges)[:3])
    usage = load(str(target))
    assert usage.runs == 1
    assert sum(b for b, _ in usage.keys.values()) == nbytes


@pytest.mark.mounts
def test_a_usage_file_that_cannot_be_written_warns_once_and_loses_nothing(model, tmp_path: Path) -> None:
    primary, mirror, mnt = model
    ranges = expert_ranges(primary)
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


@pytest.mark.mounts
def test_a_corrupt_usage_file_is_left_alone(model) -> None:
    primary, mirror, mnt = model
    bad = primary / USAGE_NAME
    bad.write_text("{ not json")
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        assert "not valid JSON" in m.stderr and "not updated this run" in m.stderr
        read_experts(m.path, expert_ranges(primary), [ExpertKey("model.layers", 1, 0)])
    assert bad.read_text() == "{ not json"  # nothing lost: the user decides
    shutil.rmtree(mnt, ignore_errors=True)


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
