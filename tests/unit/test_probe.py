"""colifs.probe.read_wait: a drive's wait before its bytes flow is the least of its timed reads,
since a busy host only adds to a read's wait (colifs.depth decides fills on it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from colifs import probe
from colifs.catalogue import build_files
from colifs.replicas import Replica
from colifs.synth import write_checkpoint
from colifs.tree import Tree


def _timed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, waits_us: list[float]) -> float | None:
    """read_wait over one file whose reads take `waits_us`, in that order, by a clock of its own."""
    path = tmp_path / "shard"
    path.write_bytes(bytes(1 << 20))
    monkeypatch.setattr(probe, "wait_targets", lambda replica, files, count: [(str(path), 0)] * count)
    monkeypatch.setattr(probe, "_open", lambda p: (os.open(p, os.O_RDONLY), True))
    ticks = iter(t for w in waits_us for t in (0.0, w * 1e-6))
    monkeypatch.setattr(probe.time, "perf_counter", lambda: next(ticks))
    return probe.read_wait(Replica(0, str(tmp_path), 1.0), [], reads=len(waits_us))


def test_the_wait_is_the_least_of_the_reads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _timed(monkeypatch, tmp_path, [90, 40, 300, 41, 55]) == pytest.approx(40e-6)


def test_a_busy_host_that_slows_most_reads_does_not_move_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A VM's noisy phase: 20 of 24 reads held up (the median would say 500 us)."""
    waits = [500.0] * 20 + [35.0, 38.0, 36.0, 37.0]
    assert _timed(monkeypatch, tmp_path, waits) == pytest.approx(35e-6)


def test_no_model_file_no_wait(tmp_path: Path) -> None:
    assert probe.read_wait(Replica(0, str(tmp_path), 1.0), []) is None


def test_the_wait_is_timed_where_the_probe_did_not_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A cache (a VM host's, the drive's own) could answer a block the probe just read at once: the
    least wait would be the cache's, and fills would stay off on an NVMe. Pieces of 64 KiB here,
    so that this small model's files hold room for both."""
    monkeypatch.setattr(probe, "PIECE", 64 << 10)
    write_checkpoint(str(tmp_path), layers=2, experts=16, hidden=512, inter=512, shards=2)
    replica = Replica(0, str(tmp_path), 1.0)
    files = list(build_files(Tree(str(tmp_path)), [replica]).values())
    probed = probe._targets(replica, files, probe.PROBE_TARGETS)
    timed = probe.wait_targets(replica, files, 24)
    assert len(timed) == 24 and len(probed) == probe.PROBE_TARGETS
    for path, off in timed:
        assert not any(p == path and a <= off < a + probe.PIECE for p, a in probed), (path, off)


def test_where_the_probe_read_everything_the_wait_reads_there_too(tmp_path: Path) -> None:
    write_checkpoint(str(tmp_path), layers=2, experts=4, hidden=256, inter=256, shards=2)
    replica = Replica(0, str(tmp_path), 1.0)
    files = list(build_files(Tree(str(tmp_path)), [replica]).values())
    assert probe.wait_targets(replica, files, 24) == probe._targets(replica, files, 24)
