"""colifs.probe.read_wait: a drive's wait before its bytes flow is the least of its timed reads,
since a busy host only adds to a read's wait (colifs.depth decides fills on it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from colifs import probe
from colifs.replicas import Replica


def _timed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, waits_us: list[float]) -> float | None:
    """read_wait over one file whose reads take `waits_us`, in that order, by a clock of its own."""
    path = tmp_path / "shard"
    path.write_bytes(bytes(1 << 20))
    monkeypatch.setattr(probe, "_targets", lambda replica, files, count: [(str(path), 0)] * count)
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
