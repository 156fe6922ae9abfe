"""The fast-drive benchmark (dual-drive.sh --fast-drives, as root): drives fast enough that the FUSE
daemon, not the drive, is the limit.

Two RAM-backed loop devices (images in /dev/shm) with ext4, throttled by a blkio cgroup to FAST and
SLOW MB/s (default 900 + 300), one synthetic MoE checkpoint of ~3 MB experts on both; engine-pattern
readers (`colifs bench`: whole experts, O_DIRECT, cold caches), all in one run:
  the fast drive directly, both directly with the ideal split (the limit), mergerfs over the fast
  drive alone (a native multi-threaded FUSE daemon, the reference), colifs (native and pyfuse3
  engines) on the fast drive alone and on both, mmap and buffered readers through colifs, and a
  sweep of the fast drive's speed (the slow one a third of it).
Every daemon phase prints the daemon's CPU seconds per GB it served, and GB/s per core of it.
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
from collections.abc import Callable, Iterator
from pathlib import Path

from dual_drive import CGROUP_ROOT, COLIFS, Rig, bench, clean_up_on_signals, cpu_seconds, settle

from colifs.synth import write_checkpoint


class Daemon:
    """A FUSE daemon under test: its pid and the bytes it has served so far."""

    def __init__(self, pid: int, served: Callable[[], int | None]) -> None:
        self.pid = pid
        self.served = served


@contextlib.contextmanager
def colifs(dirs: list[Path], mnt: Path, *flags: str) -> Iterator[Daemon]:
    out = subprocess.run(
        [*COLIFS, "mount", *map(str, dirs), str(mnt), *flags], capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(out.stderr)
    stats = mnt / ".colifs" / "stats.json"

    def served() -> int:
        return sum(r["bytes_served"] for r in json.loads(stats.read_text())["replicas"])

    try:
        yield Daemon(json.loads(stats.read_text())["pid"], served)
    finally:
        with contextlib.suppress(OSError, ValueError):
            st = json.loads(stats.read_text())
            timeouts = sum(r.get("health", {}).get("timeouts", 0) for r in st["replicas"])
            if st["fallbacks"] or timeouts:
                print(f"   WARNING: {st['fallbacks']} fallbacks, {timeouts} mirror timeouts on this mount")
            fills = st.get("fills", {})
            if fills.get("fills_started"):  # the mount timed these drives as needing depth (colifs.depth)
                print(
                    f"   note: fills ran on this mount ({fills['fills_started']} fills, "
                    f"{fills['bytes_read'] / 1e9:.2f} GB read ahead)"
                )
        subprocess.run([*COLIFS, "umount", str(mnt)], capture_output=True)
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


@contextlib.contextmanager
def mergerfs(branch: Path, mnt: Path) -> Iterator[Daemon]:
    """mergerfs over one branch, page cache off for its files (O_DIRECT readers reach the drive)."""
    proc = subprocess.Popen(["mergerfs", "-f", "-o", "cache.files=off,ro", str(branch), str(mnt)])
    try:
        deadline = time.monotonic() + 20
        while not any(mnt.iterdir()):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("mergerfs did not come up")
            time.sleep(0.1)
        yield Daemon(proc.pid, lambda: None)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        proc.terminate()
        proc.wait()


def ensure_mergerfs() -> bool:
    if shutil.which("mergerfs"):
        return True
    print("installing mergerfs (Debian) for the reference phases ...", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", "-qq", "mergerfs"], capture_output=True, env=env)
    return shutil.which("mergerfs") is not None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fast", type=float, default=900, help="MB/s of the fast drive (default 900)")
    p.add_argument("--slow", type=float, default=300, help="MB/s of the slow drive (default 300)")
    p.add_argument("--threads", type=int, default=16, help="readers in the many-reader phases (default 16)")
    p.add_argument("--seconds", type=float, default=6, help="seconds per phase (default 6)")
    p.add_argument("--model-gb", type=float, default=4.0, help="checkpoint size on each drive (default 4)")
    p.add_argument("--expert-mb", type=float, default=3.0, help="size of one expert (default 3)")
    p.add_argument(
        "--sweep",
        default="150,300,600,900,1500,1800,2400,3000",
        metavar="MB/s,...",
        help="fast-drive speeds of the sweep, the slow drive a third (default 150,...,3000; '' skips it)",
    )
    p.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    p.add_argument(
        "--native-flags",
        default="",
        metavar="FLAGS",
        help="more mount flags for every native-engine mount, e.g. '--direct-reads' (default none)",
    )
    p.add_argument("--fast-drives", action="store_true", help=argparse.SUPPRESS)  # dual-drive.sh's switch
    args = p.parse_args()
    if os.geteuid() != 0 or not os.path.isdir(CGROUP_ROOT):
        print("fast-drives: needs root and cgroup v1 blkio", file=sys.stderr)
        return 2

    clean_up_on_signals()
    have_mergerfs = ensure_mergerfs()
    work = Path(tempfile.mkdtemp(prefix="colifs-fast-"))
    rig = None
    res: dict[str, dict] = {}
    try:
        rig = Rig(work, image_gb=args.model_gb * 1.15 + 0.3, ram=True)
        devs = rig.devnames()
        a, b = rig.dirs
        print(f"writing a {args.model_gb:g} GB checkpoint to both RAM drives ...", file=sys.stderr)
        hidden = 1024
        inter = max(32, round(args.expert_mb * 1e6 / 3 / hidden / 32) * 32)
        experts = 32
        layers = max(1, round(args.model_gb * 1e9 / (experts * 3 * hidden * inter)))
        write_checkpoint(str(a), "deepseek", layers, experts, hidden=hidden, inter=inter, shards=8)
        shutil.copytree(a, b)
        settle()
        mnt = work / "mnt"
        mnt.mkdir()

        def phase(key: str, label: str, dirs: list[Path], daemon: Daemon | None = None, *extra: str) -> dict:
            print(f"{key}) {label} ...", file=sys.stderr)
            cpu0 = cpu_seconds(daemon.pid) if daemon else 0.0
            served0 = daemon.served() if daemon else None
            r = bench(dirs, args, devs, *extra)
            if daemon:
                served = daemon.served()
                gb = ((served - served0) if served is not None else r["bytes"]) / 1e9
                r["daemon_cpu_s_per_gb"] = (cpu_seconds(daemon.pid) - cpu0) / gb if gb else None
            r["label"] = label
            res[key] = r
            return r

        f, s = args.fast, args.slow
        w = f"{f:g},{s:g}"
        rig.throttle(f, s)
        n, one = ("--threads", str(args.threads)), ("--threads", "1")
        phase("a", "fast drive directly", [a], None, *n)
        phase("a1", "fast drive directly, 1 reader", [a], None, *one)
        phase("c", "both directly, ideal split (the limit)", [a, b], None, "--weights", w, *n)
        phase("c1", "both directly, ideal split, 1 reader", [a, b], None, "--weights", w, *one)
        if have_mergerfs:
            with mergerfs(a, mnt) as dm:
                phase("m", "mergerfs, fast drive alone", [mnt], dm, *n)
                phase("m1", "mergerfs, fast drive alone, 1 reader", [mnt], dm, *one)
        native = args.native_flags.split()
        for engine in ("native", "pyfuse3"):
            e = engine[0]
            more = native if engine == "native" else []
            with colifs([a], mnt, "--no-probe", "--engine", engine, *more) as dm:
                phase(f"{e}d", f"colifs {engine}, fast drive alone", [mnt], dm, *n)
            with colifs([a, b], mnt, "--weights", w, "--engine", engine, *more) as dm:
                phase(f"{e}", f"colifs {engine}, both, --weights {w}", [mnt], dm, *n)
                phase(f"{e}1", f"colifs {engine}, both, 1 reader", [mnt], dm, *one)
                if engine == "native":
                    # Page-cache readers must not read an expert twice (the second read is a cache
                    # hit): these phases last as long as the model takes at the drives' limit.
                    cold = (
                        "--seconds",
                        f"{min(args.seconds, 0.7 * args.model_gb / res['c']['gb_per_s']):.1f}",
                    )
                    phase("n_mmap", "colifs native, both, mmap readers", [mnt], dm, *n, "--mmap", *cold)
                    phase(
                        "n_buf", "colifs native, both, buffered readers", [mnt], dm, *n, "--buffered", *cold
                    )
        sweep = [float(x) for x in args.sweep.split(",") if x]
        for fast in sweep:
            slow = fast / 3
            rig.throttle(fast, slow)
            sw = f"{fast:g},{slow:g}"
            phase(f"s{fast:g}a", f"sweep {sw}: fast drive directly", [a], None, *n)
            phase(f"s{fast:g}c", f"sweep {sw}: both directly, ideal", [a, b], None, "--weights", sw, *n)
            with colifs([a, b], mnt, "--weights", sw, *native) as dm:
                phase(f"s{fast:g}n", f"sweep {sw}: colifs native, both", [mnt], dm, *n)
        report(args, res, devs, sweep, have_mergerfs)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "phases": res}, indent=1))
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(work / "mnt")], capture_output=True)
        if rig is not None:
            rig.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(
    args: argparse.Namespace, res: dict[str, dict], devs: list[str], sweep: list[float], mfs: bool
) -> None:
    g = {k: r["gb_per_s"] * 1000 for k, r in res.items()}  # MB/s

    def cpu(k: str) -> str:
        c = res[k].get("daemon_cpu_s_per_gb")
        return f"{c:.2f}" if c else "-"

    def per_core(k: str) -> str:
        c = res[k].get("daemon_cpu_s_per_gb")
        return f"{1 / c:.2f}" if c else "-"

    print()
    print(
        f"RAM drives throttled to {args.fast:g} + {args.slow:g} MB/s; "
        f"experts of {res['a']['expert_mb']:.1f} MB, "
        f"O_DIRECT readers, cold caches, {args.seconds:g} s per phase; {os.cpu_count()} cores"
    )
    print(f"{'phase':<48} {'MB/s':>7} {'p50 ms':>7} {'CPU s/GB':>9} {'GB/s/core':>9} {'in flight':>10}")
    for k, r in res.items():
        if k.startswith("s") and k[1:2].isdigit():
            continue
        infl = "/".join("-" if r["inflight"].get(d) is None else f"{r['inflight'][d]:.1f}" for d in devs)
        print(
            f"{k + ') ' + r['label']:<48} {g[k]:>7.0f} {r['latency_ms']['p50']:>7.1f} {cpu(k):>9} "
            f"{per_core(k):>9} {infl:>10}"
        )
    wrapped = [k for k in ("n_mmap", "n_buf") if res[k]["passes"]]
    if wrapped:
        print(
            f"INVALID: {', '.join(wrapped)} read every expert and began again (cache hits): raise --model-gb"
        )
    print()
    ratios = [
        ("n/c", "native colifs, 16 readers vs both directly", g["n"] / g["c"], ">= 0.90"),
        ("n1/c1", "native colifs, 1 reader vs ideal 1 reader", g["n1"] / g["c1"], ">= 0.80"),
        ("n/a", "native colifs pair vs the fast drive alone", g["n"] / g["a"], "> 1"),
        ("nd/a", "native colifs, fast drive only vs directly", g["nd"] / g["a"], ""),
        ("n_mmap/n", "mmap readers vs O_DIRECT readers", g["n_mmap"] / g["n"], ">= 0.90"),
        ("n_buf/n", "buffered readers vs O_DIRECT readers", g["n_buf"] / g["n"], ">= 0.90"),
        ("p/c", "pyfuse3 colifs vs both directly", g["p"] / g["c"], ""),
        ("n/p", "native vs pyfuse3 engine", g["n"] / g["p"], ""),
    ]
    if mfs:
        ratios.append(("nd/m", "native colifs vs mergerfs, fast drive alone", g["nd"] / g["m"], ""))
    for name, what, value, target in ratios:
        print(f"{name:<9} {what:<46} {value:6.3f}   {('target ' + target) if target else ''}")
    print(f"native daemon CPU: {cpu('n')} s/GB (target <= 0.45); pyfuse3: {cpu('p')} s/GB")
    if sweep:
        _print_sweep(res, sweep, cpu)


def _print_sweep(res: dict[str, dict], sweep: list[float], cpu: Callable[[str], str]) -> None:
    g = {k: r["gb_per_s"] * 1000 for k, r in res.items()}  # MB/s
    print()
    print("sweep (slow drive = fast / 3), 16 readers, MB/s:")
    print(
        f"{'fast':>6} {'directly':>9} {'limit':>7} {'colifs':>7} {'vs fast':>8} {'of limit':>9} "
        f"{'CPU s/GB':>9}"
    )
    cpu_bound = None
    for fast in sweep:
        k = f"s{fast:g}"
        ratio = g[k + "n"] / g[k + "a"]
        if cpu_bound is None and g[k + "n"] / g[k + "c"] < 0.9:
            cpu_bound = fast
        print(
            f"{fast:>6g} {g[k + 'a']:>9.0f} {g[k + 'c']:>7.0f} {g[k + 'n']:>7.0f} {ratio:>8.2f} "
            f"{g[k + 'n'] / g[k + 'c']:>9.2f} {cpu(k + 'n'):>9}"
        )
    where = f"{cpu_bound:g} + {cpu_bound / 3:g} MB/s" if cpu_bound else "none of these speeds"
    print(f"first speed where colifs gets < 0.90 of the limit (this machine's CPU): {where}")


if __name__ == "__main__":
    raise SystemExit(main())
