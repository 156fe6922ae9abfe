"""A drive with latency for the benchmark rigs: every read waits a fixed latency, then its bytes leave
at the drive's rate, and reads overlap (contrib/bench/latency_drive.c). A throttled loop device is a
bandwidth cap that gives one request in flight the whole drive; this gives it what a real NVMe
gives: a fraction that grows with the queue depth.

    python contrib/bench/latency_drive.py [--mb-per-s 900] [--bdp-kb 560] [--gb 1]

(the command line checks one drive against the model with fio at queue depths 1-16 and prints the
curve). A drive is scaled from a real one by its bandwidth-delay product: a 7 GB/s NVMe whose reads
wait ~80 us holds ~560 KB in flight, a 3 GB/s one at ~90 us ~270 KB; at the rates two cores can
run the latency is that product over the rate (900 MB/s and 560 KB: 622 us; one 128 KiB read in
flight gets 19% of the drive, 16 in flight all of it).

The latency the model promises is the one a reader sees: the server's own round trip (loop
device, FUSE, the reply's copy: ~0.1-0.2 ms on this machine) is measured when the drive is made
and taken off what the server waits.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE = Path(__file__).with_name("latency_drive.c")
BLOCK = 4096
BDP_KB = (560, 270)  # a 7 GB/s NVMe at ~80 us, a 3 GB/s one at ~90 us


def latency_us(mb_per_s: float, bdp_kb: float) -> float:
    """The latency of a drive of this rate holding `bdp_kb` in flight at full speed."""
    return bdp_kb * 1e3 / (mb_per_s * 1e6) * 1e6


def model_mb_per_s(depth: int, size: int, lat_us: float, mb_per_s: float) -> float:
    """What `depth` reads of `size` bytes in flight get: min(rate, depth * size / (latency + size / rate))."""
    one = size / (lat_us * 1e-6 + size / (mb_per_s * 1e6))
    return min(mb_per_s * 1e6, depth * one) / 1e6


def binary() -> Path:
    """The server, compiled once per version of its source (in the temporary directory)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    out = Path(tempfile.gettempdir(), f"colifs-latency-drive-{digest}")
    if not out.exists():
        flags = subprocess.run(
            ["pkg-config", "--cflags", "--libs", "fuse3"], check=True, capture_output=True, text=True
        ).stdout.split()
        tmp = out.with_suffix(f".{os.getpid()}")
        subprocess.run(
            ["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(tmp), str(SOURCE), *flags, "-lpthread"],
            check=True,
        )
        tmp.rename(out)
    return out


class LatencyDrive:
    """One drive: the server over an image in /dev/shm and a loop device with direct I/O over its
    "disk" (`self.loop`). No latency nor rate until `set()`, so filling it is quick. `close()`
    undoes whatever was done."""

    def __init__(self, work: Path, name: str, size_gb: float) -> None:
        self.image = Path("/dev/shm", f"colifs-bench-{os.getpid()}-{name}.img")
        self.dir = work / f"{name}.drive"
        self.loop: str | None = None
        self.server: subprocess.Popen | None = None
        self.overhead_us = 0.0
        self.latency_us = self.mb_per_s = 0.0
        try:
            self._start(size_gb)
        except BaseException:
            self.close()
            raise

    def _start(self, size_gb: float) -> None:
        subprocess.run(["truncate", "-s", f"{int(size_gb * 1024)}M", str(self.image)], check=True)
        self.dir.mkdir()
        self.server = subprocess.Popen([str(binary()), str(self.image), str(self.dir), "0", "0"])
        deadline = time.monotonic() + 10
        while not (self.dir / "params").exists():
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"latency_drive did not start on {self.dir}")
            time.sleep(0.02)
        self.loop = subprocess.run(
            ["losetup", "-f", "--show", "--direct-io=on", str(self.dir / "disk")],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        if Path(f"/sys/block/{self.devname}/loop/dio").read_text().strip() != "1":
            raise RuntimeError(f"{self.loop}: no direct I/O over {self.dir}/disk")
        self.overhead_us = self._round_trip_us()

    @property
    def devname(self) -> str:
        assert self.loop is not None
        return os.path.basename(self.loop)

    def _round_trip_us(self, n: int = 300) -> float:
        """The median time of one 4 KiB O_DIRECT read of the loop device at depth 1 (with no
        latency set: what the server's path costs before it waits at all)."""
        fd = os.open(self.loop, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, BLOCK)
        try:
            times = []
            for i in range(n):
                t = time.perf_counter()
                os.preadv(fd, [buf], (i * 7919 % 4096) * BLOCK)
                times.append(time.perf_counter() - t)
            return statistics.median(times) * 1e6
        finally:
            os.close(fd)
            buf.close()

    def set(self, latency_us: float | None = None, mb_per_s: float | None = None) -> None:
        """The latency a reader sees and the rate, from now on (either may be left as it is). The
        server's wait is the latency less its own round trip, corrected twice by what a 4 KiB read
        at depth 1 then takes (a sleeping thread wakes later than one that does not sleep)."""
        if latency_us is not None:
            self.latency_us = latency_us
        if mb_per_s is not None:
            self.mb_per_s = mb_per_s
        if not self.latency_us:
            self._write(0)
            return
        wait = self.latency_us - self.overhead_us
        for _ in range(2):
            self._write(wait)
            transfer = BLOCK / (self.mb_per_s * 1e6) * 1e6 if self.mb_per_s else 0
            wait -= self._round_trip_us(100) - (self.latency_us + transfer)
        self._write(wait)

    def _write(self, wait_us: float) -> None:
        (self.dir / "params").write_text(f"latency_us={max(0, round(wait_us))} mb_per_s={self.mb_per_s:g}\n")

    def stats(self) -> dict[str, int]:
        """reads, bytes, busy_ns (a read in flight), depth_ns (reads in flight, integrated)."""
        v = (self.dir / "stats").read_text().split()
        return {v[i]: int(v[i + 1]) for i in range(0, len(v), 2)}

    def server_pid(self) -> int:
        assert self.server is not None
        return self.server.pid

    def close(self) -> None:
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], capture_output=True)
            self.loop = None
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
            self.server = None
        if self.dir.exists():
            subprocess.run(["fusermount3", "-u", "-z", str(self.dir)], capture_output=True)
            with contextlib.suppress(OSError):
                self.dir.rmdir()
        self.image.unlink(missing_ok=True)


def make_ext4(dev: str) -> None:
    """ext4 on a rig's drive, every table written now: no lazy init writing behind a measurement."""
    subprocess.run(["mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", dev], check=True)


def fio_curve(
    path: Path,
    lat_us: float,
    mb_per_s: float,
    size: int = 128 << 10,
    seconds: float = 3,
    depths: tuple[int, ...] = (1, 2, 4, 8, 16),
) -> list[dict]:
    """fio's random O_DIRECT reads of `path` at queue depths 1-16 against the model's figures, with
    the share of the host's CPU time its hypervisor took meanwhile (a neighbour's load: it slows
    the drive's server, fio and the kernel between them, and no model holds through it)."""
    rows = []
    for depth in depths:
        before = cpu_times()
        out = subprocess.run(
            ["fio", "--name=curve", f"--filename={path}", "--rw=randread", f"--bs={size}", "--direct=1",
             "--ioengine=io_uring", f"--iodepth={depth}", f"--runtime={seconds:g}", "--time_based",
             "--output-format=json"],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        read = json.loads(out)["jobs"][0]["read"]
        got = read["bw_bytes"] / 1e6
        want = model_mb_per_s(depth, size, lat_us, mb_per_s)
        after = cpu_times()
        total = sum(after) - sum(before)
        rows.append({"depth": depth, "mb_per_s": got, "model": want, "ratio": got / want,
                     "latency_us": read["clat_ns"]["mean"] / 1e3,
                     "steal": (after[7] - before[7]) / total if total else 0.0})  # fmt: skip
    return rows


def cpu_times() -> list[int]:
    """/proc/stat's first line: the jiffies of all CPUs by state (user ... steal at 7 ...)."""
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:]]


def main() -> int:
    p = argparse.ArgumentParser(description="check one latency drive against its model with fio")
    p.add_argument("--mb-per-s", type=float, default=900)
    p.add_argument("--bdp-kb", type=float, default=BDP_KB[0], help="bytes in flight at full speed (KB)")
    p.add_argument("--gb", type=float, default=1, help="the file fio reads (GB)")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("latency_drive: needs root (mount, losetup)", file=sys.stderr)
        return 2
    lat = latency_us(args.mb_per_s, args.bdp_kb)
    work = Path(tempfile.mkdtemp(prefix="colifs-latency-"))
    drive = None
    fs = work / "fs"
    try:
        drive = LatencyDrive(work, "check", args.gb + 0.3)
        make_ext4(drive.loop)
        fs.mkdir()
        subprocess.run(["mount", drive.loop, str(fs)], check=True)
        subprocess.run(["dd", "if=/dev/urandom", f"of={fs}/f", "bs=1M", f"count={int(args.gb * 1000)}",
                        "status=none", "conv=fsync"], check=True)  # fmt: skip
        drive.set(lat, args.mb_per_s)
        print(f"drive: {args.mb_per_s:g} MB/s, latency {lat:.0f} us ({args.bdp_kb:g} KB in flight at full "
              f"speed); the server's own round trip {drive.overhead_us:.0f} us")  # fmt: skip
        print(f"{'depth':>5} {'fio MB/s':>9} {'model':>7} {'ratio':>6} {'mean latency us':>16}")
        for r in fio_curve(fs / "f", lat, args.mb_per_s):
            print(f"{r['depth']:>5} {r['mb_per_s']:>9.1f} {r['model']:>7.1f} {r['ratio']:>6.3f} "
                  f"{r['latency_us']:>16.0f}")  # fmt: skip
        return 0
    finally:
        subprocess.run(["umount", str(fs)], capture_output=True)
        if drive is not None:
            drive.close()
        subprocess.run(["rm", "-rf", str(work)], capture_output=True)


if __name__ == "__main__":
    raise SystemExit(main())
