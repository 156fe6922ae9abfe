"""The benchmark rigs' drive with latency (contrib/bench/latency_drive.py): fio's random O_DIRECT reads
at queue depths 1-16 get what the model says, min(rate, depth * size / (latency + size / rate)),
within 10%; a rate changed while it serves holds from then on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "contrib" / "bench"))
from latency_drive import LatencyDrive, fio_curve, latency_us, make_ext4, model_mb_per_s

MB_PER_S, BDP_KB = 300.0, 270.0  # the slow drive of the rigs: 900 us


def test_the_model_is_the_bandwidth_delay_product() -> None:
    assert latency_us(900, 560) == pytest.approx(622.2, abs=0.1)
    lat = latency_us(MB_PER_S, BDP_KB)
    one = model_mb_per_s(1, 128 << 10, lat, MB_PER_S)
    assert one == pytest.approx(131072 / (lat * 1e-6 + 131072 / 300e6) / 1e6)
    assert 0.3 < one / MB_PER_S < 0.35  # one 128 KiB read in flight: a third of this drive
    assert model_mb_per_s(16, 128 << 10, lat, MB_PER_S) == MB_PER_S  # deep enough: all of it


@pytest.fixture
def drive(tmp_path: Path) -> Iterator[tuple[LatencyDrive, Path]]:
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse (mount, losetup)")
    if not shutil.which("fio"):
        pytest.skip("fio is missing (apt-get install fio)")
    d = LatencyDrive(tmp_path, "test", 0.5)
    fs = tmp_path / "fs"
    try:
        assert d.loop is not None
        make_ext4(d.loop)
        fs.mkdir()
        subprocess.run(["mount", d.loop, str(fs)], check=True)
        fill = ["dd", "if=/dev/urandom", f"of={fs}/f", "bs=1M", "count=200", "status=none", "conv=fsync"]
        subprocess.run(fill, check=True)
        yield d, fs / "f"
    finally:
        subprocess.run(["umount", str(fs)], capture_output=True)
        d.close()
    assert not Path(f"/dev/shm/colifs-bench-{os.getpid()}-test.img").exists()


def test_fio_at_depths_1_to_16_gets_what_the_model_says(drive) -> None:
    d, path = drive
    lat = latency_us(MB_PER_S, BDP_KB)
    d.set(lat, MB_PER_S)
    rows = fio_curve(path, lat, MB_PER_S, seconds=1.5)
    assert [r["depth"] for r in rows] == [1, 2, 4, 8, 16]

    # The model is the most the drive gives; a busy host only takes from it (CI measured 0.899
    # once, 0.893 twice in a row another time, 0.65-0.87 at every depth a third time), so a depth
    # measured short is measured again after a pause, up to four times, and the best run counts: a
    # drive that misses its model misses it every time. No run gives more than the model, whatever
    # the host; a host whose hypervisor takes the CPU (steal) at every depth still short is no test.
    def again(r: dict) -> dict:
        runs = fio_curve(path, lat, MB_PER_S, seconds=1.5, depths=(r["depth"],))
        return max(r, *runs, key=lambda x: x["ratio"])

    for _ in range(4):
        if all(r["ratio"] >= 0.90 for r in rows):
            break
        time.sleep(2)
        rows = [again(r) if r["ratio"] < 0.90 else r for r in rows]
    assert all(r["ratio"] <= 1.10 for r in rows), rows
    short = [r for r in rows if r["ratio"] < 0.90]
    if short and all(r["steal"] >= 0.05 for r in short):
        pytest.skip(f"the host's hypervisor took {min(r['steal'] for r in short):.0%}+ of the CPU "
                    f"at every short depth: no drive model holds through that ({short})")  # fmt: skip
    assert not short, rows
    assert rows[-1]["mb_per_s"] > 2.5 * rows[0]["mb_per_s"]  # depth, not the cap, decides at depth 1
    stats = d.stats()
    assert stats["reads"] > 0 and stats["depth_ns"] > stats["busy_ns"] > 0


def test_a_drive_that_slows_while_serving(drive) -> None:
    d, path = drive
    lat = latency_us(MB_PER_S, BDP_KB)
    d.set(lat, MB_PER_S)
    d.set(mb_per_s=100)  # its latency stays
    assert d.latency_us == lat
    (deep,) = fio_curve(path, lat, 100, seconds=1.5, depths=(16,))
    assert 0.90 <= deep["ratio"] <= 1.10, deep
