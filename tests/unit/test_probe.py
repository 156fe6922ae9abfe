"""colifs.probe.read_wait: a drive's wait before its bytes flow (colifs.depth decides fills on it),
the median of reads placed where the mount's probe did not just read (a cache under the drive could
answer those at once)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from colifs import probe
from colifs.catalogue import build_files
from colifs.replicas import Replica
from colifs.synth import write_checkpoint
from colifs.tree import Tree

GB = 10**9


def _timed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, waits_us: list[float]) -> float | None:
    """read_wait over one file whose reads take `waits_us`, in that order, by a clock of its own."""
    path = tmp_path / "shard"
    path.write_bytes(bytes(1 << 20))
    monkeypatch.setattr(probe, "wait_targets", lambda replica, files, count: [(str(path), 0)] * count)
    monkeypatch.setattr(probe, "_open", lambda p: (os.open(p, os.O_RDONLY), True))
    ticks = iter(t for w in waits_us for t in (0.0, w * 1e-6))
    monkeypatch.setattr(probe, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    return probe.read_wait(Replica(0, str(tmp_path), 1.0), [], reads=len(waits_us))


def test_the_wait_is_the_median_of_the_reads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _timed(monkeypatch, tmp_path, [90, 40, 300, 41, 55]) == pytest.approx(55e-6)


def test_a_few_reads_a_cache_answers_do_not_move_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An SSD's read waits ~100 us; four of sixteen answered by a cache at once (the least would say
    5 us, and fills would stay off)."""
    assert _timed(monkeypatch, tmp_path, [100.0] * 12 + [5.0] * 4) == pytest.approx(100e-6)


def _files(sizes: list[int]) -> list:
    """Model files of these sizes, their data from 1 MiB on (what _targets reads of a ServedFile)."""
    return [
        SimpleNamespace(
            relpath=f"m-{i}.gguf", size=n, copies=(0,), layout=SimpleNamespace(data_start=1 << 20)
        )
        for i, n in enumerate(sizes)
    ]


@pytest.mark.parametrize("sizes", [[8 * GB], [16 * GB], [5 * GB] * 8, [600 * GB // 160] * 160])
def test_the_reads_are_where_the_probe_did_not_read(sizes: list[int]) -> None:
    """Where the files leave room (one GGUF of 8-16 GB, shards of 3.75-5 GB): every read outside the
    probe's pieces, inside the file's data."""
    replica, files = Replica(0, "/m", 1.0), _files(sizes)
    probed = probe._targets(replica, files, probe.PROBE_TARGETS)
    timed = probe.wait_targets(replica, files, 16)
    size = {os.path.join("/m", f.relpath): f.size for f in files}
    assert len(timed) == 16 and len(set(timed)) == 16
    for path, off in timed:
        assert 1 << 20 <= off <= size[path] - probe.BLOCK and off % probe.BLOCK == 0
        assert not any(p == path and a <= off < a + probe.PIECE for p, a in probed), (path, off)


def test_where_little_room_is_left_the_reads_take_it_first() -> None:
    """A 6 GB GGUF: the probe's pieces cover four fifths of it."""
    replica, files = Replica(0, "/m", 1.0), _files([6 * GB])
    probed = probe._targets(replica, files, probe.PROBE_TARGETS)
    timed = probe.wait_targets(replica, files, 16)
    outside = [not any(a <= off < a + probe.PIECE for _, a in probed) for _, off in timed]
    assert len(timed) == 16 and any(outside) and outside == sorted(outside, reverse=True)


def test_where_the_probe_read_everything_the_reads_are_its_places(tmp_path: Path) -> None:
    """A model smaller than the probe's pieces leaves no other place."""
    write_checkpoint(str(tmp_path), layers=2, experts=4, hidden=256, inter=256, shards=2)
    replica = Replica(0, str(tmp_path), 1.0)
    files = list(build_files(Tree(str(tmp_path)), [replica]).values())
    assert probe.wait_targets(replica, files, 16) == probe._targets(replica, files, 16)


def test_no_model_file_no_wait(tmp_path: Path) -> None:
    assert probe.read_wait(Replica(0, str(tmp_path), 1.0), []) is None
