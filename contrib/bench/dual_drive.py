"""The two-drive benchmark (run it through dual-drive.sh, as root).

Two loop-backed ext4 filesystems, throttled by a blkio cgroup (v1) to FAST and SLOW MB/s, each
holding the same synthetic MoE checkpoint. This process and everything it starts (readers, colifs
daemons) run inside the cgroup. With cold caches, the same `colifs bench` workload on:
  a) the primary directly, b) the mirror directly, c) both directly in parallel with the ideal
  split (the physical limit), d) colifs without a mirror, e) colifs with the mirror, probed
  weights, f) --weights FAST,SLOW, g) --weights 1,1 (wrong), h) a symmetric pair through colifs,
  and mmap / buffered readers through colifs (e's set-up) against O_DIRECT readers.
Prints a table with the ratios and the reads in flight per drive; cleans up on any exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from colifs.synth import write_checkpoint

COLIFS = [sys.executable, "-m", "colifs"]
CGROUP_ROOT = "/sys/fs/cgroup/blkio"


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


class Rig:
    """Loop devices, filesystems and the cgroup; `close()` undoes whatever was done."""

    def __init__(self, work: Path, image_gb: float) -> None:
        self.work = work
        self.loops: list[str] = []
        self.mounts: list[Path] = []
        self.cgroup: Path | None = None
        self.dirs = []
        for name in ("fast", "slow"):
            img = work / f"{name}.img"
            sh("truncate", "-s", f"{int(image_gb * 1024)}M", str(img))
            loop = sh("losetup", "-f", "--show", str(img))
            self.loops.append(loop)
            sh("mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop)
            d = work / name
            d.mkdir()
            sh("mount", loop, str(d))
            self.mounts.append(d)
            self.dirs.append(d / "model")

    def devnames(self) -> list[str]:
        return [os.path.basename(x) for x in self.loops]

    def throttle(self, fast_mb: float, slow_mb: float) -> None:
        if self.cgroup is None:
            self.cgroup = Path(CGROUP_ROOT) / f"colifs-bench-{os.getpid()}"
            self.cgroup.mkdir()
            (self.cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
        for loop, mb in zip(self.loops, (fast_mb, slow_mb), strict=True):
            devno = Path(f"/sys/block/{os.path.basename(loop)}/dev").read_text().strip()
            (self.cgroup / "blkio.throttle.read_bps_device").write_text(f"{devno} {int(mb * 1e6)}\n")

    def close(self) -> None:
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                Path(CGROUP_ROOT, "cgroup.procs").write_text(f"{os.getpid()}\n")
            for _ in range(50):
                try:
                    self.cgroup.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)  # a daemon that is still exiting keeps it busy
        for d in self.mounts:
            subprocess.run(["umount", str(d)], capture_output=True)
        for loop in self.loops:
            subprocess.run(["losetup", "-d", loop], capture_output=True)


@contextlib.contextmanager
def colifs_mount(dirs: list[Path], mnt: Path, *flags: str) -> Iterator[dict]:
    out = subprocess.run(
        [*COLIFS, "mount", *map(str, dirs), str(mnt), *flags], capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(out.stderr)
    try:
        yield json.loads((mnt / ".colifs" / "stats.json").read_text())
    finally:
        subprocess.run([*COLIFS, "umount", str(mnt)], capture_output=True)
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


def bench(dirs: list[Path], args: argparse.Namespace, devs: list[str], *extra: str) -> dict:
    cmd = [*COLIFS, "bench", *map(str, dirs), "--json", "--threads", str(args.threads)]
    cmd += ["--seconds", str(args.seconds), "--inflight", ",".join(devs), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fast", type=float, default=150, help="MB/s of the fast drive (default 150)")
    p.add_argument("--slow", type=float, default=50, help="MB/s of the slow drive (default 50)")
    p.add_argument("--symmetric", type=float, default=100, help="MB/s of each drive in h) (default 100)")
    p.add_argument("--threads", type=int, default=16, help="bench reader threads (default 16)")
    p.add_argument("--seconds", type=float, default=10, help="seconds per phase (default 10)")
    p.add_argument("--model-gb", type=float, default=2.0, help="checkpoint size (default 2)")
    p.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("dual-drive: needs root (loop devices, mounts, blkio cgroup)", file=sys.stderr)
        return 2
    if not os.path.isdir(CGROUP_ROOT):
        print(f"dual-drive: {CGROUP_ROOT} is missing (needs cgroup v1 blkio)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="colifs-dual-"))
    rig = None
    try:
        rig = Rig(work, image_gb=args.model_gb * 1.25 + 0.3)
        devs = rig.devnames()
        print(f"writing a {args.model_gb:g} GB checkpoint to both drives ...", file=sys.stderr)
        layers = max(1, round(args.model_gb * 1e9 / (64 * 3 * 1024 * 1024)))
        write_checkpoint(
            str(rig.dirs[0]), "deepseek", layers=layers, experts=64, hidden=1024, inter=1024, shards=8
        )
        shutil.copytree(rig.dirs[0], rig.dirs[1])
        sh("sync")
        mnt = work / "mnt"
        mnt.mkdir()
        f, s = args.fast, args.slow
        rig.throttle(f, s)
        res: dict[str, dict] = {}
        labels: dict[str, str] = {}
        a, b = rig.dirs

        def phase(key: str, label: str, dirs: list[Path], *extra: str) -> None:
            print(f"{key}) {label} ...", file=sys.stderr)
            labels[key] = label
            res[key] = bench(dirs, args, devs, *extra)

        phase("a", "primary directly", [a])
        phase("b", "mirror directly", [b])
        phase("c", "both directly, ideal split", [a, b], "--weights", f"{f:g},{s:g}")
        with colifs_mount([a], mnt, "--no-probe"):
            phase("d", "colifs, no mirror", [mnt])
        with colifs_mount([a, b], mnt) as st:
            probed = [r["weight"] for r in st["replicas"]]
            phase("e", "colifs, probed weights", [mnt])
            phase("e_mmap", "colifs, probed, mmap readers", [mnt], "--mmap")
            phase("e_buf", "colifs, probed, buffered readers", [mnt], "--buffered")
        with colifs_mount([a, b], mnt, "--weights", f"{f:g},{s:g}"):
            phase("f", f"colifs, --weights {f:g},{s:g}", [mnt])
        with colifs_mount([a, b], mnt, "--weights", "1,1"):
            phase("g", "colifs, --weights 1,1 (wrong)", [mnt])
        rig.throttle(args.symmetric, args.symmetric)
        phase("a2", f"one drive directly, both at {args.symmetric:g}", [a])
        with colifs_mount([a, b], mnt) as st2:
            probed_sym = [r["weight"] for r in st2["replicas"]]
            phase("h", "colifs, symmetric pair, probed", [mnt])

        print()
        print(
            f"drives: fast {f:g} MB/s, slow {s:g} MB/s (blkio throttle on loop-backed ext4); "
            f"{args.threads} readers, {args.seconds:g} s per phase, cold caches"
        )
        head = f"{'phase':<44} {'GB/s':>7} {'experts/s':>10} {'p50 ms':>7} {'p99 ms':>7}"
        print(f"{head} {'in flight fast/slow':>20}")
        for key, r in res.items():
            infl = r["inflight"]
            fl = "/".join("-" if infl.get(d) is None else f"{infl[d]:.1f}" for d in devs)
            lat = r["latency_ms"]
            print(
                f"{key + ') ' + labels[key]:<44} {r['gb_per_s']:>7.3f} {r['experts_per_s']:>10.1f}"
                f" {lat['p50']:>7.1f} {lat['p99']:>7.1f} {fl:>20}"
            )
        g = {k: v["gb_per_s"] for k, v in res.items()}
        ratio = probed[0] / probed[1]
        print()
        err = (ratio / (f / s) - 1) * 100
        print(
            f"probed weights {probed[0]:g},{probed[1]:g}: ratio {ratio:.2f} vs true {f / s:.2f} ({err:+.1f}%)"
        )
        print(f"symmetric pair probed {probed_sym[0]:g},{probed_sym[1]:g}")
        ratios = [
            ("e/c", "colifs vs the two drives' limit", g["e"] / g["c"], ">= 0.95"),
            ("e/a", "colifs pair vs the fast drive alone", g["e"] / g["a"], ""),
            ("d/a", "FUSE cost at drive speed", g["d"] / g["a"], ">= 0.95"),
            ("g/f", "wrong weights 1,1 vs right", g["g"] / g["f"], ""),
            ("h/a2", "symmetric pair vs one drive", g["h"] / g["a2"], ">= 1.9"),
            ("e_mmap/e", "mmap readers vs O_DIRECT readers", g["e_mmap"] / g["e"], ">= 0.90"),
            ("e_buf/e", "buffered readers vs O_DIRECT readers", g["e_buf"] / g["e"], ">= 0.90"),
        ]
        for name, what, value, target in ratios:
            print(f"{name:<9} {what:<40} {value:6.3f}   {('target ' + target) if target else ''}")
        if args.json:
            Path(args.json).write_text(
                json.dumps({"args": vars(args), "probed": probed, "phases": res}, indent=1)
            )
    finally:
        for m in (work / "mnt",):
            subprocess.run(["fusermount3", "-u", "-z", str(m)], capture_output=True)
        if rig is not None:
            rig.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
