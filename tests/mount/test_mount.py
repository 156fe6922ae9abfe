"""Real FUSE mounts through the real CLI: bytes, loaders, routing split, partial mirrors, read-only."""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import shutil
import signal
import struct
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from colifs.buffers import BLOCK
from colifs.layout import ExpertKey
from colifs.synth import FAMILIES, write_checkpoint
from tests.helpers import (
    COLIFS,
    expert_spans,
    force_unmount,
    is_mounted,
    mounted,
    read_direct,
    run_colifs,
    shards,
)

pytestmark = pytest.mark.mounts  # every test here runs on both engines


# -- bytes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backing", "routing"), [("direct", "stripe"), ("buffered", "stripe"), ("direct", "expert")]
)
def test_every_access_method_returns_the_primary_bytes(model, backing, routing) -> None:
    primary, mirror, mnt = model
    with mounted(
        primary, [mirror], mnt, "--weights", "1,1", "--backing-io", backing, "--routing", routing
    ) as m:
        rng = random.Random(7)
        for p in sorted(primary.iterdir()):
            want = p.read_bytes()
            via = mnt / p.name
            assert via.read_bytes() == want  # whole file, buffered
            with open(via, "rb", buffering=0) as f:  # random ranges crossing tensor boundaries
                for _ in range(50):
                    off = rng.randrange(len(want))
                    size = rng.randrange(1, 400_000)
                    assert os.pread(f.fileno(), size, off) == want[off : off + size]
            with open(via, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                for _ in range(50):  # page faults at random places, like llama.cpp
                    off = rng.randrange(len(want))
                    assert mm[off : off + 5000] == want[off : off + 5000]
            for _ in range(20):
                off = rng.randrange(len(want))
                size = rng.randrange(1, 3 << 20)
                assert read_direct(via, off, size) == want[off : off + size]
        st = m.stats()
        assert st["fallbacks"] == 0
        assert all(r["bytes_served"] > 0 for r in st["replicas"])


def test_o_direct_readers_aligning_to_st_blksize_read_what_they_need(model) -> None:
    """llama.cpp's direct-I/O load rounds every tensor read out to st_blksize: the mount reports the
    page size, as ext4 does, so it reads the same bytes through the mount as from the drive (at
    1 MiB it read 5% more, and each small tensor as a whole MiB)."""
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        spans = [s for per_key in expert_spans(primary).values() for s in per_key]
        before = sum(r["bytes_served"] for r in m.stats()["replicas"])
        asked = 0
        for name, start, end in spans[:20]:
            via = mnt / name
            align = os.stat(via).st_blksize
            assert align == BLOCK
            a, b = start // align * align, -(-end // align) * align  # what llama.cpp reads
            assert read_direct(via, a, b - a)[start - a : end - a] == (primary / name).read_bytes()[start:end]
            asked += end - start
        served = sum(r["bytes_served"] for r in m.stats()["replicas"]) - before
        assert asked <= served <= asked + 20 * 2 * BLOCK


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_safe_open_through_the_mount_gives_the_same_arrays(tmp_path: Path, family: str) -> None:
    primary, mirror, mnt = tmp_path / "p", tmp_path / "m", tmp_path / "mnt"
    write_checkpoint(str(primary), family, layers=2, experts=8, hidden=64, inter=64, shards=2)
    shutil.copytree(primary, mirror)
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        for p in shards(primary):
            with safe_open(p, "numpy") as a, safe_open(mnt / p.name, "numpy") as b:
                assert sorted(a.keys()) == sorted(b.keys())
                assert a.metadata() == b.metadata()
                for k in a.keys():  # noqa: SIM118 (safe_open is not iterable)
                    x, y = a.get_tensor(k), b.get_tensor(k)
                    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k
        assert all(r["bytes_served"] > 0 for r in m.stats()["replicas"])


# -- routing through the mount -------------------------------------------------------------------


def expert_ranges(root: Path) -> dict[tuple[str, ExpertKey], list[tuple[int, int]]]:
    """(file, key) → byte ranges of that expert in that file, from the headers (any model format)."""
    out: dict[tuple[str, ExpertKey], list[tuple[int, int]]] = {}
    for key, spans in expert_spans(root).items():
        for name, start, end in spans:
            out.setdefault((name, key), []).append((start, end))
    return out


def drive_of_each_expert(m, ranges) -> dict:
    """Read each expert through the mount and see which drive's counter moved.

    Run boundaries are snapped to 4 KiB (O_DIRECT straight into one buffer), so up to one block
    at each edge of an expert may come from its neighbour's drive; everything else from its own.
    """
    where = {}
    for (name, key), spans in sorted(ranges.items()):
        before = [r["bytes_served"] for r in m.stats()["replicas"]]
        for start, end in spans:
            read_direct(m.path / name, start, end - start)
        after = [r["bytes_served"] for r in m.stats()["replicas"]]
        moved = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b - a > 2 * BLOCK]
        assert len(moved) == 1, (key, before, after)  # one expert, one drive
        assert sum(after) - sum(before) - (after[moved[0]] - before[moved[0]]) < 2 * BLOCK
        where[name, key] = moved[0]
    return where


@pytest.fixture
def many_experts(tmp_path: Path):
    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "mixtral", layers=2, experts=64, hidden=128, inter=64, shards=2)
    shutil.copytree(primary, mirror)
    return primary, mirror, tmp_path


@pytest.mark.parametrize("weights", [(1, 1), (3, 1)])
def test_split_of_keys_and_bytes_follows_the_weights(many_experts, weights) -> None:
    primary, mirror, tmp = many_experts
    share = weights[1] / sum(weights)
    ranges = expert_ranges(primary)
    with mounted(
        primary, [mirror], tmp / "mnt", "--weights", ",".join(map(str, weights)), "--routing", "expert"
    ) as m:
        where = drive_of_each_expert(m, ranges)
        per_layer: dict[int, list[int]] = {}
        for (_, key), drive in where.items():
            per_layer.setdefault(key.layer, []).append(drive)
        for drives in per_layer.values():  # exact quota per layer: within one expert
            assert abs(sum(drives) - share * len(drives)) <= 1
        for p in shards(primary):  # every byte once, through O_DIRECT
            read_direct(m.path / p.name, 0, p.stat().st_size)
        st = m.stats()["replicas"]
        total = st[0]["bytes_served"] + st[1]["bytes_served"]
        # Tolerance: experts are split exactly; the few name-keyed tensors (attention, router,
        # embeddings; ~5% of the bytes) land by hash.
        assert st[1]["bytes_served"] / total == pytest.approx(share, abs=0.04)


def test_same_key_same_drive_across_two_mounts(many_experts) -> None:
    primary, mirror, tmp = many_experts
    ranges = expert_ranges(primary)
    runs = []
    for _ in range(2):
        with mounted(primary, [mirror], tmp / "mnt", "--weights", "3,1", "--routing", "expert") as m:
            runs.append(drive_of_each_expert(m, ranges))
    assert runs[0] == runs[1]


def test_two_mirrors_all_serve(tmp_path: Path) -> None:
    primary = tmp_path / "p"
    write_checkpoint(str(primary), "qwen3", layers=2, experts=32, hidden=64, inter=64, shards=2)
    mirrors = [tmp_path / "m1", tmp_path / "m2"]
    for m in mirrors:
        shutil.copytree(primary, m)
    with mounted(primary, mirrors, tmp_path / "mnt", "--weights", "1,1,1") as m:
        for p in shards(primary):
            assert read_direct(m.path / p.name, 0, p.stat().st_size) == p.read_bytes()
        st = m.stats()
        assert [r["role"] for r in st["replicas"]] == ["primary", "mirror", "mirror"]
        shares = [r["byte_share"] for r in st["replicas"]]
        assert all(s == pytest.approx(1 / 3, abs=0.08) for s in shares), shares
        assert (m.path / ".colifs" / "stats").read_text().startswith("MIRROR: primary ")
        assert " | mirror1 " in (m.path / ".colifs" / "stats").read_text()


# -- partial and divergent mirrors ---------------------------------------------------------------


@pytest.mark.daemon_warns("served without this mirror")
def test_partial_and_divergent_mirror_files_are_served_from_the_primary(tmp_path: Path) -> None:
    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "deepseek", layers=3, experts=8, hidden=64, inter=64, shards=4)
    shutil.copytree(primary, mirror)
    s1, s2, s3, s4 = (p.name for p in shards(primary))
    (mirror / s1).unlink()  # missing
    blob = bytearray((mirror / s2).read_bytes())  # same size, header differs
    i = blob.index(b'"pt"')
    blob[i + 1 : i + 3] = b"PT"
    (mirror / s2).write_bytes(blob)
    with open(mirror / s3, "ab") as f:  # size differs
        f.write(b"x")
    (mirror / "extra.safetensors").write_bytes(b"ignored")
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        for name, reason in ((s2, "header differs"), (s3, "size differs")):
            line = next(x for x in m.stderr.splitlines() if name in x)
            assert "warning" in line and str(mirror) in line and reason in line
        assert s1 not in m.stderr  # missing: a partial mirror, counted in the summary line
        assert f"mirror {mirror} (weight 1, 1/4 model files)" in m.stderr
        st = m.stats()
        assert st["files"][s4] == {
            "replicas": [str(primary), str(mirror)],
            "vouched_by_receipt": [],
            "note": "",
            "tensors_keyed": {"by name": 9, "expert, by its name": 48},
        }
        for name, reason in ((s1, "missing"), (s2, "header differs"), (s3, "size differs")):
            assert st["files"][name]["replicas"] == [str(primary)]
            assert reason in st["files"][name]["note"]
        assert "extra.safetensors" not in st["files"]
        assert not (m.path / "extra.safetensors").exists()
        for name in (s1, s2, s3):
            want = (primary / name).read_bytes()
            assert read_direct(m.path / name, 0, len(want)) == want
        assert m.stats()["replicas"][1]["bytes_served"] == 0  # nothing came from the bad copies
        want = (primary / s4).read_bytes()
        assert read_direct(m.path / s4, 0, len(want)) == want
        assert m.stats()["replicas"][1]["bytes_served"] > 0


@pytest.mark.daemon_warns("malformed header")
def test_malformed_primary_header_is_served_as_plain_bytes(model) -> None:
    primary, mirror, mnt = model
    bad = primary / "broken.safetensors"
    bad.write_bytes(struct.pack("<Q", 10**9) + b"{}" + os.urandom(1000))
    shutil.copy(bad, mirror / bad.name)
    with mounted(primary, [mirror], mnt) as m:
        line = next(x for x in m.stderr.splitlines() if "broken.safetensors" in x)
        assert "malformed header" in line and "over the 100000000-byte limit" in line
        assert (mnt / bad.name).read_bytes() == bad.read_bytes()
        assert m.stats()["files"]["broken.safetensors"]["replicas"] == [str(primary)]
        good = shards(primary)[0]
        assert read_direct(mnt / good.name, 0, good.stat().st_size) == good.read_bytes()


# -- the tree, read-only -------------------------------------------------------------------------


def test_tree_modes_times_symlinks_and_stable_inodes(model) -> None:
    primary, mirror, mnt = model
    (primary / "sub" / "deeper").mkdir(parents=True)
    (primary / "sub" / "deeper" / "tokenizer.json").write_text("{}")
    os.chmod(primary / "config.json", 0o664)
    first = shards(primary)[0]
    (primary / "latest.safetensors").symlink_to(first.name)
    inodes = []
    for _ in range(2):
        with mounted(primary, [mirror], mnt):
            # colifs' own usage file (written at the first unmount) is not shown
            listed = [n for n in os.listdir(primary) if n != ".colifs-usage.json"]
            assert sorted(os.listdir(mnt)) == sorted([*listed, ".colifs"])
            for p in [p for p in primary.rglob("*") if p.name != ".colifs-usage.json"]:
                via = mnt / p.relative_to(primary)
                a, b = p.lstat(), via.lstat()
                assert b.st_mode == a.st_mode & ~0o222
                assert (b.st_size, b.st_mtime_ns) == (a.st_size, a.st_mtime_ns)
                assert b.st_ino != a.st_ino
            link = mnt / "latest.safetensors"
            assert link.is_symlink() and os.readlink(link) == first.name
            assert link.read_bytes() == first.read_bytes()
            seen = [p for p in primary.rglob("*") if p.name != ".colifs-usage.json"]
            inodes.append({p.name: (mnt / p.relative_to(primary)).lstat().st_ino for p in seen})
    assert inodes[0] == inodes[1]


def test_every_write_path_is_erofs(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt):
        f = mnt / shards(primary)[0].name
        attempts = [
            lambda: os.open(f, os.O_RDWR),
            lambda: os.open(f, os.O_WRONLY | os.O_TRUNC),
            lambda: os.open(mnt / "new", os.O_WRONLY | os.O_CREAT),
            lambda: os.mkdir(mnt / "d"),
            lambda: os.unlink(f),
            lambda: os.rmdir(mnt / ".colifs"),
            lambda: os.rename(f, mnt / "x"),
            lambda: os.chmod(f, 0o777),
            lambda: os.truncate(f, 0),
            lambda: os.utime(f),
            lambda: os.setxattr(f, "user.x", b"1"),
            lambda: os.symlink("a", mnt / "l"),
            lambda: os.link(f, mnt / "h"),
            lambda: os.open(mnt / ".colifs" / "stats", os.O_WRONLY),
        ]
        for attempt in attempts:
            with pytest.raises(OSError) as e:
                attempt()
            assert e.value.errno == errno.EROFS, attempt


# -- stats and the CLI ---------------------------------------------------------------------------


def test_stats_are_current_and_the_cli_shows_them(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "9,3") as m:
        line = (mnt / ".colifs" / "stats").read_text()
        zero = "MIRROR: primary 0.00 GB (0 reads) | mirror 0.00 GB (0 reads) | fallbacks 0"
        assert line.rstrip(" \n") == zero
        assert line.endswith("\n")  # after the spaces that keep its size steady (see test_boundary)
        s = shards(primary)[1]
        read_direct(mnt / s.name, 0, s.stat().st_size)
        line = (mnt / ".colifs" / "stats").read_text()
        st = m.stats()
        reads = [r["reads"] for r in st["replicas"]]
        assert f"primary {st['replicas'][0]['bytes_served'] / 1e9:.2f} GB ({reads[0]} reads)" in line
        assert sum(r["bytes_served"] for r in st["replicas"]) == s.stat().st_size
        assert [r["weight"] for r in st["replicas"]] == [9.0, 3.0]
        assert st["weights_source"] == "given (--weights)"
        assert "weights given (--weights): primary" in m.stderr
        out = run_colifs("stats", str(mnt))
        assert out.returncode == 0 and "primary" in out.stdout and "fallbacks 0" in out.stdout
        out = run_colifs("stats", str(mnt), "--json")
        assert out.returncode == 0 and '"replicas"' in out.stdout


def test_coli_disk_weights_is_honoured(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, env={"COLI_DISK_WEIGHTS": "5,2"}) as m:
        st = m.stats()
        assert [r["weight"] for r in st["replicas"]] == [5.0, 2.0]
        assert st["weights_source"] == "given ($COLI_DISK_WEIGHTS)"


def test_umount_returns_once_the_daemon_is_gone(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt) as m:
        pid = m.stats()["pid"]
        out = run_colifs("umount", str(mnt))
        assert out.returncode == 0, out.stderr
        assert not is_mounted(mnt)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


# -- refusals ------------------------------------------------------------------------------------


def refuse(args: list[str], code: int, text: str, mnt: Path | None = None) -> None:
    out = run_colifs(*args)
    assert out.returncode == code, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colifs: error: ") and text in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    if mnt is not None:
        assert not is_mounted(mnt)


def test_bad_input_is_one_line_and_a_specific_exit_code(model, tmp_path: Path) -> None:
    primary, mirror, mnt = model
    p, m, t = str(primary), str(mirror), str(mnt)
    refuse(["mount", str(tmp_path / "nope"), m, t], 32, "does not exist", mnt)
    refuse(["mount", str(primary / "config.json"), m, t], 32, "is not a directory", mnt)
    (tmp_path / "alias").symlink_to(primary)
    refuse(["mount", p, str(tmp_path / "alias"), t], 32, "are the same directory", mnt)
    refuse(["mount", p, m, str(primary / "sub")], 32, "does not exist")
    (primary / "inner").mkdir()
    refuse(["mount", p, m, str(primary / "inner")], 32, "is inside", primary / "inner")
    (mnt / "file").write_text("x")
    refuse(["mount", p, m, t], 32, "is not empty", mnt)
    (mnt / "file").unlink()
    refuse(["mount", p, m, t, "--weights", "1"], 2, "1 given, 2 replicas", mnt)
    refuse(["mount", p, m, t, "--weights", "1,0"], 2, "positive", mnt)
    refuse(["mount", p], 2, "PRIMARY [MIRROR ...] MOUNTPOINT")
    refuse(["umount", t], 3, "is not a colifs mount")
    refuse(["stats", t], 3, "is not a colifs mount")


def test_a_second_mount_on_the_same_mountpoint_is_refused(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt):
        refuse(["mount", str(primary), str(mirror), str(mnt)], 32, "already a mount point")
        assert np.frombuffer(read_direct(mnt / "config.json", 0, 10), np.uint8).size == 10


def test_many_threads_opening_and_reading_at_once(model) -> None:
    primary, mirror, mnt = model
    files = shards(primary)
    want = {p.name: p.read_bytes() for p in files}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        rng = random.Random(k)
        try:
            for _ in range(20):
                name = rng.choice(list(want))
                off = rng.randrange(len(want[name]))
                assert read_direct(mnt / name, off, 1 << 20) == want[name][off : off + (1 << 20)]
        except BaseException as e:
            errors.append(e)

    with mounted(primary, [mirror], mnt):
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("when", ["mounted, not yet serving", "serving"])
def test_signal_to_a_foreground_mount_unmounts_cleanly(model, sig, when) -> None:
    primary, mirror, mnt = model
    proc = subprocess.Popen(
        [*COLIFS, "mount", "-f", "--no-probe", str(primary), str(mirror), str(mnt)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (is_mounted(mnt) if when.startswith("mounted") else (mnt / ".colifs").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.001)
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0, proc.stderr.read()
        assert not is_mounted(mnt)
    finally:
        proc.kill()
        force_unmount(mnt)


def test_umount_clears_a_stale_mount_whose_daemon_was_killed(model) -> None:
    primary, mirror, mnt = model
    out = run_colifs("mount", str(primary), str(mirror), str(mnt))
    assert out.returncode == 0, out.stderr
    try:
        pid = json.loads((mnt / ".colifs" / "stats.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(OSError) as e:
            os.listdir(mnt)
        assert e.value.errno == errno.ENOTCONN
        refuse(["mount", str(primary), str(mirror), str(mnt)], 32, "stale mount")
        out = run_colifs("umount", str(mnt))
        assert out.returncode == 0, out.stderr
        assert not is_mounted(mnt) and os.listdir(mnt) == []
    finally:
        force_unmount(mnt)


# -- probe and kernel knobs ----------------------------------------------------------------------


def test_without_weights_the_mount_probes_each_drive(model) -> None:
    """The suite's copies are directories on one filesystem: probed one at a time, each measured
    the whole drive, so they share its figure (one warning), and the weights split it evenly."""
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--probe-seconds", "0.5") as m:
        st = m.stats()
        assert st["weights_source"] == "probed"
        assert [p["path"] for p in st["probe"]] == [str(primary), str(mirror)]
        rates = [p["mb_per_s"] for p in st["probe"]]
        assert all(r > 0 for r in rates)
        half = float(f"{max(rates) / 2:.3g}")
        assert [r["weight"] for r in st["replicas"]] == [half, half]
        assert "probe: suggested: --weights" in m.stderr
        assert m.stderr.count("are on one drive") == 1, m.stderr


def test_no_probe_means_equal_weights(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--no-probe") as m:
        st = m.stats()
        assert st["weights_source"] == "default (equal)" and st["probe"] == []
        assert [r["weight"] for r in st["replicas"]] == [1.0, 1.0]


def test_probe_command_prints_a_table_and_suggested_weights(model) -> None:
    primary, mirror, _ = model
    out = run_colifs("probe", str(primary), str(mirror), "--seconds", "0.3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["replica", "path", "MB/s"]
    assert lines[1].startswith("primary") and lines[2].startswith("mirror")
    assert lines[1].endswith("one drive with mirror 1") and lines[2].endswith("one drive with the primary")
    assert lines[3].startswith("suggested: --weights ")
    a, b = lines[3].split()[-1].split(",")
    assert a == b, lines  # one drive: its figure split evenly
    assert "are on one drive" in out.stderr
    refuse(["probe", str(primary / "nope")], 2, "does not exist")


@pytest.mark.skipif(os.geteuid() != 0, reason="sysfs knobs need root")
def test_kernel_knobs_are_set_and_reported(model) -> None:
    primary, mirror, mnt = model
    with mounted(
        primary, [mirror], mnt, "--no-probe", "--readahead-kb", "1024", "--max-background", "32"
    ) as m:
        assert m.stats()["kernel"] == {
            "read_ahead_kb": 1024,
            "max_background": 32,
            "congestion_threshold": 24,
        }
    with mounted(primary, [mirror], mnt, "--no-probe", "--readahead-kb", "0", "--max-background", "0") as m:
        kernel = m.stats()["kernel"]
        assert kernel["read_ahead_kb"] not in (None, 1024, 4096) and kernel["max_background"] == 12


# -- GGUF ----------------------------------------------------------------------------------------


def assert_same_gguf(direct: Path, via: Path) -> None:
    """gguf's reader sees the same tensors both ways (its maps are gone on return: the mount is
    not held busy by them)."""
    import gguf

    a, b = gguf.GGUFReader(str(direct)), gguf.GGUFReader(str(via))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert x.tensor_type == y.tensor_type and bytes(x.data) == bytes(y.data), x.name


def test_gguf_models_through_the_mount(tmp_path: Path) -> None:

    from colifs.synth import write_gguf

    primary, mirror = tmp_path / "p", tmp_path / "m"
    primary.mkdir()
    write_gguf(
        str(primary / "qwen3-moe-Q8_0.gguf"),
        "qwen3moe",
        layers=2,
        experts=16,
        hidden=256,
        inter=128,
        qtype="Q8_0",
    )
    write_gguf(
        str(primary / "ds-F16.gguf"), "deepseek2", layers=2, experts=16, hidden=128, inter=128, qtype="F16"
    )
    shutil.copytree(primary, mirror)
    ranges = expert_ranges(primary)
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1", "--routing", "expert") as m:
        for p in sorted(primary.glob("*.gguf")):
            via = m.path / p.name
            assert_same_gguf(p, via)
            want = p.read_bytes()
            with open(via, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                assert mm[:] == want
        where = drive_of_each_expert(m, ranges)  # each expert slice of the fused tensors: one drive
        assert set(where.values()) == {0, 1}
        assert {k for _, k in where} >= {ExpertKey("blk", 1, e) for e in range(16)}
        assert m.stats()["files"]["ds-F16.gguf"]["replicas"] == [str(primary), str(mirror)]


@pytest.mark.daemon_warns("malformed header", "served without this mirror")
def test_bad_and_divergent_gguf_files(tmp_path: Path) -> None:
    from colifs.synth import write_gguf

    primary, mirror = tmp_path / "p", tmp_path / "m"
    primary.mkdir()
    write_gguf(str(primary / "good.gguf"), "qwen3moe", layers=1, experts=8, qtype="F16")
    good = (primary / "good.gguf").read_bytes()
    (primary / "cut.gguf").write_bytes(good[:100])  # header cut short
    (primary / "zero.gguf").write_bytes(b"")
    shutil.copytree(primary, mirror)
    blob = bytearray(good)  # same size, a byte of the metadata changed
    i = blob.index(b"qwen3moe")
    blob[i] = ord("Q")
    (mirror / "good.gguf").write_bytes(blob)
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        lines = m.stderr.splitlines()
        assert any("cut.gguf" in x and "malformed header" in x and "does not fit" in x for x in lines)
        assert any("zero.gguf" in x and "malformed header" in x and "bad magic" in x for x in lines)
        assert any("good.gguf" in x and "header differs" in x for x in lines)
        for name in ("cut.gguf", "zero.gguf", "good.gguf"):
            assert (m.path / name).read_bytes() == (primary / name).read_bytes()
            assert m.stats()["files"][name]["replicas"] == [str(primary)]
        assert m.stats()["replicas"][1]["bytes_served"] == 0


def test_split_gguf_files_are_each_parsed_and_routed(tmp_path: Path) -> None:

    from colifs.synth import write_gguf

    primary, mirror = tmp_path / "p", tmp_path / "m"
    primary.mkdir()
    write_gguf(str(primary / "model.gguf"), "qwen3moe", layers=4, experts=8, qtype="F16", split_max_tensors=7)
    parts = sorted(primary.glob("*.gguf"))
    assert len(parts) >= 3 and all("-of-" in p.name for p in parts)
    shutil.copytree(primary, mirror)
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        st = m.stats()
        for p in parts:
            assert st["files"][p.name]["replicas"] == [str(primary), str(mirror)]
            assert_same_gguf(p, m.path / p.name)
        assert all(r["bytes_served"] > 0 for r in m.stats()["replicas"])


def test_stripe_routing_reads_one_expert_from_both_drives(tmp_path: Path) -> None:
    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "mixtral", layers=1, experts=8, hidden=1024, inter=1024, shards=1)
    shutil.copytree(primary, mirror)
    ranges = expert_ranges(primary)
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "3,1", "--routing", "stripe") as m:
        assert m.stats()["routing"] == "stripe"
        for (name, _), spans in sorted(ranges.items())[:4]:  # experts of 3 x 2 MiB (fp16 1024 x 1024)
            before = [r["bytes_served"] for r in m.stats()["replicas"]]
            for s, e in spans:
                assert read_direct(m.path / name, s, e - s) == (primary / name).read_bytes()[s:e]
            after = [r["bytes_served"] for r in m.stats()["replicas"]]
            moved = [b - a for a, b in zip(before, after, strict=True)]
            assert all(x > 0 for x in moved)  # one expert, both drives
            assert moved[1] / sum(moved) == pytest.approx(0.25, abs=0.1)


def test_stats_show_reads_in_flight_per_drive(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        assert [r["in_flight"] for r in m.stats()["replicas"]] == [0, 0]  # idle: nothing queued
        p = shards(primary)[0]
        assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes()
        assert [r["in_flight"] for r in m.stats()["replicas"]] == [0, 0]  # every read accounted back


def test_times_before_1970_are_shown_as_they_are(model) -> None:
    """A file's mtime of 1.5 s before the epoch: a timespec's nanoseconds are never negative."""
    primary, mirror, mnt = model
    config = primary / "config.json"
    for ns in (-1_500_000_000, -86_400_000_000_001):
        os.utime(config, ns=(ns, ns))
        with mounted(primary, [mirror], mnt):
            assert (mnt / "config.json").stat().st_mtime_ns == ns
