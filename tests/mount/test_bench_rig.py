"""The engine benchmarks' rig (contrib/bench/dual_drive.py Rig): `unlimited()` takes every limit off
both drives for a block (a mount's ceiling: the `ceiling` configuration) and gives back the rates
and latencies they had, on drives with latency and on blkio-capped ones."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "contrib" / "bench"))
from dual_drive import Rig, settle

RATES = (300.0, 100.0)


@contextlib.contextmanager
def made(tmp_path: Path, latency: bool) -> Iterator[Rig]:
    """Two RAM-backed drives at RATES, gone again afterwards."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse") or not Path("/sys/fs/cgroup/blkio").is_dir():
        pytest.skip("needs root, /dev/fuse and cgroup v1 blkio (mount, losetup, throttles)")
    r = Rig(tmp_path, image_gb=0.3, ram=True, latency=latency)
    try:
        r.throttle(*RATES)
        yield r
    finally:
        r.close()
    assert not any(Path("/dev/shm").glob(f"colifs-bench-{os.getpid()}-*")), "an image was left behind"


@pytest.fixture(params=["latency", "blkio"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    with made(tmp_path, request.param == "latency") as r:
        yield r


@pytest.fixture
def latency_rig(tmp_path: Path) -> Iterator[Rig]:
    with made(tmp_path, True) as r:
        yield r


def limits(rig: Rig) -> list:
    """What caps each drive: its latency and rate, or the blkio rules on its device."""
    if rig.latency_drives:
        return [(d.latency_us, d.mb_per_s) for d in rig.latency_drives]
    assert rig.cgroup is not None
    return sorted((rig.cgroup / "blkio.throttle.read_bps_device").read_text().split("\n"))


def read_seconds(path: Path, mib: int = 48) -> float:
    """One O_DIRECT reader, 4 MiB at a time, through the fast drive's filesystem, caches dropped
    first."""
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    t = time.perf_counter()
    subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=4M", f"count={mib // 4}", "iflag=direct", "status=none"],
        check=True,
    )
    return time.perf_counter() - t


def test_unlimited_takes_the_limits_off_and_gives_them_back(rig: Rig) -> None:
    before = limits(rig)
    with rig.unlimited():
        during = [(d.dir / "params").read_text().strip() for d in rig.latency_drives] or limits(rig)
    assert limits(rig) == before and rig.rates == RATES
    if rig.latency_drives:
        assert during == ["latency_us=0 mb_per_s=0"] * 2
        assert all(lat > 0 for lat, _ in before) and [mb for _, mb in before] == list(RATES)
    else:
        rules = sorted(f"{d} {int(mb * 1e6)}" for d, mb in zip(devnos(rig), RATES, strict=True))
        assert before == ["", *rules]
        assert during == [""]  # no rule left on either device


def test_a_drive_with_latency_reads_at_its_rate_again_after_unlimited(latency_rig: Rig) -> None:
    """What the drive model serves, measured (not on blkio: a throttle lets an idle drive burst)."""
    rig = latency_rig
    fast = rig.mounts[0] / "f"
    subprocess.run(["dd", "if=/dev/urandom", f"of={fast}", "bs=1M", "count=48", "status=none"], check=True)
    settle()  # written back, and no page of it cached on the way to the drive
    floor = 48 * 2**20 / (RATES[0] * 1e6)  # the least time the fast drive's rate allows
    assert read_seconds(fast) >= 0.9 * floor
    with rig.unlimited():  # the best of three: a busy host (CI) slows the drive's own FUSE server
        quick = [read_seconds(fast) for _ in range(3)]
    assert read_seconds(fast) >= 0.9 * floor
    assert min(quick) < 0.5 * floor, (quick, floor)


def devnos(rig: Rig) -> list[str]:
    return [Path(f"/sys/block/{d}/dev").read_text().strip() for d in rig.devnames()]
