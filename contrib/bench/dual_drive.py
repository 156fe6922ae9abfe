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
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from latency_drive import BDP_KB, LatencyDrive, latency_us, make_ext4

from colifs.synth import write_checkpoint

COLIFS = [sys.executable, "-m", "colifs"]
CGROUP_ROOT = "/sys/fs/cgroup/blkio"


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def clean_up_on_signals() -> None:
    """SIGTERM and SIGHUP raise KeyboardInterrupt, so that a rig's clean-up (its `finally`) runs."""

    def interrupted(sig: int, _: object) -> None:
        raise KeyboardInterrupt(signal.Signals(sig).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)


class Rig:
    """Loop devices, filesystems and the cgroup; `close()` undoes whatever was done."""

    def __init__(self, work: Path, image_gb: float, ram: bool = False, latency: bool = False) -> None:
        """`ram`: the images in /dev/shm, fast enough that the daemon, not the drive, is the limit.
        `latency`: drives with latency (latency_drive.py, RAM-backed): each read waits the latency of
        a real drive's bandwidth-delay product at the rate `throttle` gives it, then its bytes
        leave at that rate; no blkio throttle."""
        self.work = work
        self.loops: list[str] = []
        self.mounts: list[Path] = []
        self.cgroup: Path | None = None
        self.dirs = []
        self.images: list[Path] = []
        self.latency_drives: list[LatencyDrive] = []
        self.rates: tuple[float, float] | None = None  # MB/s, fast and slow (throttle)
        try:
            for name in ("fast", "slow"):
                self._drive(name, image_gb, ram, latency)
        except BaseException:
            self.close()
            raise

    def _drive(self, name: str, image_gb: float, ram: bool, latency: bool) -> None:
        if latency:
            drive = LatencyDrive(self.work, name, image_gb)
            self.latency_drives.append(drive)
            assert drive.loop is not None
            loop = drive.loop
        else:
            shm = Path("/dev/shm", f"colifs-bench-{os.getpid()}-{name}.img")
            img = shm if ram else self.work / f"{name}.img"
            self.images.append(img)
            sh("truncate", "-s", f"{int(image_gb * 1024)}M", str(img))
            # direct-io: the loop device reads its image with O_DIRECT, not through the host's
            # page cache, so it behaves like a drive under the throttle (tmpfs needs no such thing)
            loop = sh("losetup", "-f", "--show", *([] if ram else ["--direct-io=on"]), str(img))
        self.loops.append(loop)
        # A common NVMe default, so the drives read directly are not flattered or handicapped
        # by this kernel's loop default of 2560 KiB.
        Path(f"/sys/block/{os.path.basename(loop)}/queue/read_ahead_kb").write_text("128\n")
        make_ext4(loop)
        d = self.work / name
        d.mkdir()
        sh("mount", loop, str(d))
        self.mounts.append(d)
        self.dirs.append(d / "model")

    def devnames(self) -> list[str]:
        return [os.path.basename(x) for x in self.loops]

    def bytes_read(self) -> list[int]:
        """Bytes each drive has read since it was made (/sys/block/DEV/stat: sectors read)."""
        return [int(Path(f"/sys/block/{d}/stat").read_text().split()[2]) * 512 for d in self.devnames()]

    def throttle(self, fast_mb: float, slow_mb: float) -> None:
        """The drives' rates from now on (a drive that slows while serving). Drives with latency
        keep the latency their first rate gave them (BDP_KB over it)."""
        self.rates = (fast_mb, slow_mb)
        if self.latency_drives:
            for drive, mb, bdp in zip(self.latency_drives, (fast_mb, slow_mb), BDP_KB, strict=True):
                drive.set(drive.latency_us or latency_us(mb, bdp), mb)
            return
        if self.cgroup is None:
            self.cgroup = Path(CGROUP_ROOT) / f"colifs-bench-{os.getpid()}"
            self.cgroup.mkdir()
            (self.cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
        for loop, mb in zip(self.loops, (fast_mb, slow_mb), strict=True):
            devno = Path(f"/sys/block/{os.path.basename(loop)}/dev").read_text().strip()
            (self.cgroup / "blkio.throttle.read_bps_device").write_text(f"{devno} {int(mb * 1e6)}\n")

    @contextlib.contextmanager
    def unlimited(self) -> Iterator[None]:
        """Drives with no latency and no rate limit while in the block, then the rates (and
        latencies) they had: what a reader gets through a path whose own cost on this machine is
        then the only limit (a mount's ceiling, which no read policy passes)."""
        rates, latencies = self.rates, [d.latency_us for d in self.latency_drives]
        assert rates is not None, "throttle the drives first"
        for drive in self.latency_drives:
            drive.set(0, 0)
        if not self.latency_drives:
            self.throttle(0, 0)  # blkio: a rate of 0 takes the device's rule away
        try:
            yield
        finally:
            if self.latency_drives:
                for drive, lat, mb in zip(self.latency_drives, latencies, rates, strict=True):
                    drive.set(lat, mb)
            else:
                self.throttle(*rates)

    def describe(self) -> str:
        """The drives, for a results header."""
        if not self.latency_drives:
            return "bandwidth caps (blkio throttle)"
        return "drives with latency: " + ", ".join(
            f"{d.mb_per_s:g} MB/s at {d.latency_us:.0f} us" for d in self.latency_drives
        )

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
        for loop in [] if self.latency_drives else self.loops:
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        for drive in self.latency_drives:  # each detaches its own loop device
            drive.close()
        for img in self.images:
            img.unlink(missing_ok=True)


def colifs_command(tree: str | None = None) -> list[str]:
    """How a rig runs colifs: this checkout's, or (`tree`) another checkout's, with its native engine
    built there: an A/B of two builds in one run. The editable install's import hook, which finds
    this checkout's package before any path, is taken off for it (the daemon forks from it)."""
    if tree is None:
        return COLIFS
    code = (
        "import runpy, sys; "
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]; "
        f"sys.path.insert(0, {tree!r}); sys.argv[0] = 'colifs'; "
        "runpy.run_module('colifs', run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code]


@contextlib.contextmanager
def colifs_mount(dirs: list[Path], mnt: Path, *flags: str, tree: str | None = None) -> Iterator[dict]:
    out = subprocess.run(
        [*colifs_command(tree), "mount", *map(str, dirs), str(mnt), *flags], capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(out.stderr)
    try:
        yield json.loads((mnt / ".colifs" / "stats.json").read_text())
    finally:
        # Honest numbers: a phase that fell back to the primary (errors, timeouts) says so.
        with contextlib.suppress(OSError, ValueError):
            st = json.loads((mnt / ".colifs" / "stats.json").read_text())
            timeouts = sum(r.get("health", {}).get("timeouts", 0) for r in st["replicas"])
            if st["fallbacks"] or timeouts:
                print(f"   WARNING: {st['fallbacks']} fallbacks, {timeouts} mirror timeouts on this mount")
        subprocess.run([*COLIFS, "umount", str(mnt)], capture_output=True)
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid` (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def settle() -> None:
    """Wait for writeback of the freshly written checkpoint to finish, then drop caches."""
    sh("sync")
    for _ in range(600):
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        if int(meminfo["Dirty"].split()[0]) + int(meminfo["Writeback"].split()[0]) < 10_000:
            break
        time.sleep(0.1)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def bench(dirs: list[Path], args: argparse.Namespace, devs: list[str], *extra: str) -> dict:
    cmd = [
        *COLIFS,
        "bench",
        *map(str, dirs),
        "--json",
        "--threads",
        str(args.threads),
    ]  # a later --threads wins
    cmd += ["--seconds", str(args.seconds), "--inflight", ",".join(devs), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout)


def stripe_study(args: argparse.Namespace, phase, rig: Rig, mnt: Path, res: dict[str, dict]) -> None:
    """Expert vs stripe routing for few and many readers, against the two drives' sum."""
    a, b = rig.dirs
    w = f"{args.fast:g},{args.slow:g}"
    phase("c", "both directly, ideal split, 16 readers", [a, b], "--weights", w)
    readers = [
        ("1", "1 O_DIRECT reader", ("--threads", "1")),
        ("1m", "1 mmap reader", ("--threads", "1", "--mmap")),
    ]
    readers += [("4", "4 readers", ("--threads", "4")), ("32", "32 readers", ("--threads", "32"))]
    for mode in ("expert", "stripe"):
        with colifs_mount([a, b], mnt, "--weights", w, "--routing", mode):
            for key, label, extra in readers:
                phase(f"{mode}{key}", f"colifs {mode}, {label}", [mnt], *extra)
        with colifs_mount([a, b], mnt, "--weights", w, "--routing", mode, "--readahead-kb", "4096"):
            phase(
                f"{mode}1m4",
                f"colifs {mode}, 1 mmap reader, readahead 4096",
                [mnt],
                "--threads",
                "1",
                "--mmap",
            )
    # The limit: both drives read directly in parallel (c); a and b alone are shown for reference
    # (the very first phase after the rig is built has read low in some runs).
    total = res["c"]["gb_per_s"]
    print()
    print(
        f"drives: fast {args.fast:g}, slow {args.slow:g} MB/s; experts of {res['a']['expert_mb']:.1f} MB; "
        f"alone {res['a']['gb_per_s']:.3f} + {res['b']['gb_per_s']:.3f}; "
        f"limit (c, both directly): {total:.3f} GB/s"
    )
    print(f"{'readers':<36} {'expert GB/s':>12} {'(of c)':>9} {'stripe GB/s':>12} {'(of c)':>9}")
    for key, label, _ in [*readers, ("1m4", "1 mmap reader, readahead 4096", ())]:
        e, s = res[f"expert{key}"]["gb_per_s"], res[f"stripe{key}"]["gb_per_s"]
        print(f"{label:<36} {e:>12.3f} {e / total:>9.2f} {s:>12.3f} {s / total:>9.2f}")
    wrapped = [k for k, r in res.items() if r["passes"]]
    if wrapped:
        print(f"INVALID: {', '.join(wrapped)} read every expert and began again: raise --model-gb")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "phases": res}, indent=1))


def partial_study(
    args: argparse.Namespace, phase, rig: Rig, mnt: Path, res: dict[str, dict], work: Path
) -> None:
    """A mirror drive holding only part of the model: learn usage on a skewed workload,
    `colifs plan/stage` a share of the shards onto the slow drive, then read with plain weights and
    with usage-informed (partial-mirror) routing, against a full mirror and the primary alone."""
    a, b = rig.dirs
    w = f"{args.fast:g},{args.slow:g}"
    z = ("--zipf", f"{args.zipf:g}")
    usage = work / "usage.json"
    splits: dict[str, float] = {}

    def split() -> float:
        st = json.loads((mnt / ".colifs" / "stats.json").read_text())
        served = [r["bytes_served"] for r in st["replicas"]]
        return served[-1] / sum(served) if len(served) > 1 and sum(served) else 0.0

    with colifs_mount([a], mnt, "--usage-file", str(usage)):
        phase("pa", f"colifs, primary only, zipf {args.zipf:g} (learns usage)", [mnt], *z)
    with colifs_mount([a, b], mnt, "--weights", w, "--usage-file", str(work / "u-full.json")):
        phase("pf", "colifs, full mirror", [mnt], *z)
        splits["pf"] = split()
    model = sum(p.stat().st_size for p in a.glob("*.safetensors"))
    shutil.rmtree(b)
    b.mkdir()
    budget = str(int(model * args.budget_share))
    plan = subprocess.run(
        [
            *COLIFS,
            "plan",
            str(a),
            str(b),
            "--budget",
            budget,
            "--usage",
            str(usage),
            "--weights",
            w,
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    if plan.returncode:
        raise RuntimeError(plan.stderr)
    planned = json.loads(plan.stdout)
    print(f"staging {planned['bytes_to_copy'] / 1e9:.2f} GB onto the slow drive ...", file=sys.stderr)
    staged = subprocess.run(
        [*COLIFS, "stage", str(a), str(b), "--budget", budget, "--usage", str(usage), "-q"],
        capture_output=True,
        text=True,
    )
    if staged.returncode:
        raise RuntimeError(staged.stderr)
    settle()
    with colifs_mount([a, b], mnt, "--weights", w, "--usage-file", str(work / "u-plain.json")):
        phase("pp", "colifs, partial mirror, plain weights", [mnt], *z)
        splits["pp"] = split()
    with colifs_mount([a, b], mnt, "--weights", w, "--usage-file", str(usage)) as st:
        phase("pi", "colifs, partial mirror, usage-informed routing", [mnt], *z)
        splits["pi"] = split()
        informed = st["partial_mirror"] or {}
    base = res["pa"]["gb_per_s"]
    print()
    print(
        f"drives: fast {args.fast:g}, slow {args.slow:g} MB/s; {args.threads} readers, zipf {args.zipf:g}; "
        f"mirror holds {planned['bytes_to_copy'] / model:.0%} of the model ({args.budget_share:.0%} budget), "
        f"{planned['coverage']:.1%} of the learned traffic"
    )
    print(f"{'phase':<52} {'GB/s':>7} {'vs primary':>10} {'mirror bytes':>13}")
    for key in ("pa", "pf", "pp", "pi"):
        g = res[key]["gb_per_s"]
        sp = f"{splits[key]:.1%}" if key in splits else "-"
        print(f"{key + ') ' + res[key]['label']:<52} {g:>7.3f} {g / base:>10.2f} {sp:>13}")
    print(
        f"predicted: plan {planned['predicted_speedup']:.2f}x; mount's byte split "
        f"{informed.get('predicted_byte_share', ['-', '-'])[-1]} on the mirror (target "
        f"{args.slow / (args.fast + args.slow):.1%})"
    )
    g = {k: res[k]["gb_per_s"] for k in ("pa", "pf", "pp", "pi")}
    print(f"pi/pf     partial (informed) vs full mirror        {g['pi'] / g['pf']:.3f}")
    print(f"pi/pp     informed vs plain routing, same mirror   {g['pi'] / g['pp']:.3f}")


FAULTFS = Path(__file__).resolve().parents[2] / "tests" / "faultfs.py"


def fault_study(
    args: argparse.Namespace, phase, rig: Rig, mnt: Path, res: dict[str, dict], work: Path
) -> None:
    """A mirror that fails under load: the slow drive is served through the test suite's
    fault-injecting FUSE pass-through; healthy, then hung, then failing with EIO, each on a fresh
    mount: how much of the primary's own speed is left, and what the health state says."""
    a, b = rig.dirs
    w = f"{args.fast:g},{args.slow:g}"
    faulty, control = work / "faulty", work / "control"
    faulty.mkdir()
    control.write_text("ok")
    proc = subprocess.Popen([sys.executable, str(FAULTFS), str(b), str(faulty), str(control)])
    health: dict[str, dict] = {}
    try:
        deadline = time.monotonic() + 20
        while not any(faulty.iterdir()):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("faultfs did not come up")
            time.sleep(0.1)
        for key, mode, label in (
            ("ff", "ok", "colifs, mirror through faultfs, healthy"),
            ("fh", "hang", "the same, mirror reads hang (timeout 5 s)"),
            ("fe", "eio", "the same, mirror reads fail (EIO)"),
        ):
            control.write_text("ok")
            with colifs_mount([a, faulty], mnt, "--weights", w):
                control.write_text(mode)
                phase(key, label, [mnt])
                st = json.loads((mnt / ".colifs" / "stats.json").read_text())
                health[key] = {**st["replicas"][1]["health"], "fallbacks": st["fallbacks"]}
                control.write_text("ok")  # let hung reads finish before the unmount
    finally:
        control.write_text("ok")
        proc.terminate()
        proc.wait()
        subprocess.run(["fusermount3", "-u", "-z", str(faulty)], capture_output=True)
    base = res["a"]["gb_per_s"]
    print()
    print(f"drives: fast {args.fast:g}, slow {args.slow:g} MB/s; {args.threads} readers, {args.seconds:g} s")
    cols = f"{'GB/s':>7} {'vs primary':>10} {'state':>6} {'timeouts':>8} {'errors':>6} {'fallbacks':>9}"
    print(f"{'phase':<46} {cols}")
    print(f"{'a) ' + res['a']['label']:<46} {base:>7.3f} {1:>10.2f}")
    for key in ("ff", "fh", "fe"):
        g, h = res[key]["gb_per_s"], health[key]
        figures = f"{g:>7.3f} {g / base:>10.2f} {h['state']:>6} {h['timeouts']:>8} {h['errors']:>6}"
        print(f"{key + ') ' + res[key]['label']:<46} {figures} {h['fallbacks']:>9}")


MODES = {
    "stripe": ("--fixed-weights",),  # fixed 1 MiB stripes, the split as mounted
    "adaptive": ("--routing", "stripe"),  # stripes whose weights follow the drives (its default)
    "queue": ("--routing", "queue"),  # the native default: backlogs spill, weights follow waiting readers
    "queue-fixed": ("--routing", "queue", "--fixed-weights"),  # backlogs spill, weights stay (before run 65)
    "pyfuse3": ("--engine", "pyfuse3"),  # the pyfuse3 engine's default: adaptive stripes
    "pyfuse3-fixed": ("--engine", "pyfuse3", "--fixed-weights"),
}


def adapt_study(
    args: argparse.Namespace, phase, rig: Rig, mnt: Path, res: dict[str, dict], work: Path
) -> None:
    """Routing that follows the drives: right weights, wrong weights, then the mirror slowed to a
    quarter and (separately) the primary to a third while mounted, then another process reading
    the mirror's drive flat out, for each mode of --adapt-modes
    (--routing stripe with fixed weights, the same with --adaptive-weights, --routing queue). Each
    colifs phase runs after WARM s of the same load on the same mount (what the routing had to
    follow), beside the drives read directly at the same throttles."""
    f, s = args.fast, args.slow
    a, b = rig.dirs
    warm = 10.0
    modes = [m for m in args.adapt_modes.split(",") if m]

    def stats() -> dict:
        return json.loads((mnt / ".colifs" / "stats.json").read_text())

    def warmed(key: str, label: str, *extra: str) -> None:
        phase(key + "_warm", label + " (first 10 s)", [mnt], "--seconds", f"{warm:g}", *extra)
        before = stats()
        cpu = cpu_seconds(before["pid"])
        phase(key, label, [mnt], *extra)
        after = stats()
        pairs = zip(before["replicas"], after["replicas"], strict=True)
        served = [y["bytes_served"] - x["bytes_served"] for x, y in pairs]
        res[key]["balance"] = after["balance"]
        res[key]["served_shares"] = [x / max(sum(served), 1) for x in served]
        res[key]["cpu_s_per_gb"] = (cpu_seconds(after["pid"]) - cpu) / max(sum(served) / 1e9, 1e-9)

    phase("c", "both directly, ideal split", [a, b], "--weights", f"{f:g},{s:g}")
    phase(
        "c_1", "both directly, ideal split, 1 reader", [a, b], "--weights", f"{f:g},{s:g}", "--threads", "1"
    )
    for mode in modes:
        for key, weights, what in (("r", f"{f:g},{s:g}", "right weights"), ("w", "1,1", "--weights 1,1")):
            for readers, suffix in (("16", ""), ("1", "_1")):
                rdr = (f"{args.threads}", "") if readers == "16" else ("1", ", 1 reader")
                with colifs_mount([a, b], mnt, "--weights", weights, *MODES[mode]):
                    warmed(f"{key}{suffix}_{mode}", f"colifs {mode}, {what}{rdr[1]}", "--threads", rdr[0])
    for key, fast, slow, what in (
        ("ms", f, s / 4, "mirror slowed to a quarter"),
        ("ps", f / 3, s, "primary to a third"),
    ):
        for mode in modes:
            rig.throttle(f, s)
            with colifs_mount([a, b], mnt, "--weights", f"{f:g},{s:g}", *MODES[mode]):
                phase(f"{key}_{mode}_before", f"colifs {mode}, {f:g}+{s:g}", [mnt], "--seconds", "5")
                rig.throttle(fast, slow)
                warmed(f"{key}_{mode}", f"colifs {mode}, {what}")
        phase(f"{key}_sum", f"both directly, {what}", [a, b], "--weights", f"{fast:g},{slow:g}")
        phase(f"{key}_alone", f"faster drive alone, {what}", [a if fast >= slow else b])
    rig.throttle(f, s)
    what = "another process reading the mirror's drive"
    for mode in modes:
        with colifs_mount([a, b], mnt, "--weights", f"{f:g},{s:g}", *MODES[mode]), competing(b, work) as rate:
            warmed(f"sh_{mode}", f"colifs {mode}, {what}")
            # What the drives have left is their sum less what the other process took over the
            # same seconds: a mount that leaves it more of the shared drive is not counted short.
            other = rate(res[f"sh_{mode}"]["started"], args.seconds)
        res[f"sh_{mode}"]["other_mb_s"] = other / 1e6
        res[f"sh_left_{mode}"] = {
            "label": f"the sum less the other process ({other / 1e6:.0f} MB/s)",
            "gb_per_s": res["c"]["gb_per_s"] - other / 1e9,
        }
    with competing(b, work):  # the faster drive read alone, beside the other process
        phase("sh_fast", f"fast drive alone, {what}", [a])
    _print_adapt(args, res, modes)


def membership_study(
    args: argparse.Namespace, phase, rig: Rig, mnt: Path, res: dict[str, dict], work: Path
) -> None:
    """A mirror taken away and added back while 16 readers stream (`colifs mirror remove/add`):
    how long each command takes under load, whether the mirror's drive unmounts at once after the
    removal, and what the mount delivers before, between and after, beside the drives read
    directly; the daemon's CPU per GB in every phase."""
    f, s = args.fast, args.slow
    a, b = rig.dirs

    def stats() -> dict:
        return json.loads((mnt / ".colifs" / "stats.json").read_text())

    def measured(key: str, label: str) -> None:
        before = stats()
        cpu = cpu_seconds(before["pid"])
        phase(key, label, [mnt])
        after = stats()
        pairs = zip(before["replicas"], after["replicas"], strict=True)
        served = [y["bytes_served"] - x["bytes_served"] for x, y in pairs]
        res[key]["cpu_s_per_gb"] = (cpu_seconds(after["pid"]) - cpu) / max(sum(served) / 1e9, 1e-9)
        res[key]["served_shares"] = [x / max(sum(served), 1) for x in served]

    def under_load(action: str) -> float:
        """`colifs mirror ACTION` 2 s into a bench of the mount: the seconds it took."""
        load = subprocess.Popen(
            [*COLIFS, "bench", str(mnt), "--threads", str(args.threads), "--seconds", "6"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(2)
            t0 = time.monotonic()
            sh(*COLIFS, "mirror", action, str(mnt), str(b))
            return time.monotonic() - t0
        finally:
            load.wait()

    phase("c", "both directly, ideal split", [a, b], "--weights", f"{f:g},{s:g}")
    with colifs_mount([a, b], mnt, "--weights", f"{f:g},{s:g}"):
        measured("m_both", "colifs, both drives")
        res["t_remove"] = {"seconds": under_load("remove")}
        # No descriptor left on the mirror's drive: it unmounts at once (and is mounted again).
        unmounted = subprocess.run(["umount", str(rig.mounts[1])], capture_output=True, text=True)
        res["drive_unmounted"] = {"ok": unmounted.returncode == 0, "why": unmounted.stderr.strip()}
        if unmounted.returncode == 0:
            sh("mount", rig.loops[1], str(rig.mounts[1]))
        measured("m_removed", "colifs, mirror removed")
        res["t_add"] = {"seconds": under_load("add")}
        measured("m_added", "colifs, mirror added back")
    print()
    print(f"drives: fast {f:g}, slow {s:g} MB/s; {args.threads} readers, {args.seconds:g} s a phase")
    print(f"{'phase':<46} {'GB/s':>7} {'of':>5} {'':<22} {'split':>11} {'CPU s/GB':>9}")
    refs = {"m_both": "c", "m_removed": "a", "m_added": "c"}
    for key, ref in refs.items():
        got, base = res[key]["gb_per_s"], res[ref]["gb_per_s"]
        split = " / ".join(f"{100 * x:.0f}%" for x in res[key]["served_shares"])
        print(
            f"{key + ') ' + res[key]['label']:<46} {got:>7.3f} {got / base:>5.2f} "
            f"{'of ' + res[ref]['label']:<22.22} {split:>11} {res[key]['cpu_s_per_gb']:>9.2f}"
        )
    gone = res["drive_unmounted"]
    print(
        f"colifs mirror remove under load: {res['t_remove']['seconds']:.2f} s; the mirror's drive then "
        + ("unmounted at once" if gone["ok"] else f"did NOT unmount: {gone['why']}")
        + f"; colifs mirror add under load: {res['t_add']['seconds']:.2f} s"
    )


# The other process: O_DIRECT 4 MiB reads of a model's files over and over, one at a time, logging
# "wall-clock bytes-so-far" every 50 ms so its rate over any window can be read afterwards.
_COMPETITOR = """
import mmap, os, sys, time
root, log = sys.argv[1], open(sys.argv[2], "w", buffering=1)
buf, done, last = mmap.mmap(-1, 4 << 20), 0, 0.0
while True:
    for name in sorted(os.listdir(root)):
        fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_DIRECT)
        off = 0
        while (n := os.preadv(fd, [buf], off)) > 0:
            off, done = off + n, done + n
            if (now := time.time()) - last >= 0.05:
                log.write(f"{now} {done}\\n")
                last = now
            if n < len(buf):
                break
        os.close(fd)
"""


@contextlib.contextmanager
def competing(model: Path, work: Path) -> Iterator[Callable[[float, float], float]]:
    """Another process reading the drive that holds `model` flat out, in the rig's cgroup (it shares
    that drive's throttle with colifs). Yields `rate(start, seconds)`: its bytes per second over
    that wall-clock window."""
    log = work / "competitor.log"
    proc = subprocess.Popen([sys.executable, "-c", _COMPETITOR, str(model), str(log)], start_new_session=True)

    def rate(start: float, seconds: float) -> float:
        samples = [tuple(map(float, x.split())) for x in log.read_text().splitlines() if x.count(" ") == 1]

        def at(t: float) -> float:  # bytes read by time t, interpolated between samples
            before = [x for x in samples if x[0] <= t]
            after = [x for x in samples if x[0] >= t]
            if not before or not after:
                raise RuntimeError("the other process did not log over the whole phase")
            (t0, b0), (t1, b1) = before[-1], after[0]
            return b0 if t1 == t0 else b0 + (b1 - b0) * (t - t0) / (t1 - t0)

        return (at(start + seconds) - at(start)) / seconds

    try:
        time.sleep(1)  # under way
        yield rate
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _print_adapt(args: argparse.Namespace, res: dict[str, dict], modes: list[str]) -> None:
    print()
    print(f"drives: fast {args.fast:g}, slow {args.slow:g} MB/s; {args.threads} readers, {args.seconds:g} s")
    print(f"{'phase':<58} {'MB/s':>8} {'ratio':>6}  {'of':<40} {'CPU s/GB':>8}  served, shares, utilization")
    rows = []
    for mode in modes:
        rows += [
            (f"r_{mode}", "c", "the sum"),
            (f"r_1_{mode}", "c_1", "an ideal 3:1 mirror, 1 reader"),
            (f"w_{mode}", "c", "the sum"),
            (f"w_1_{mode}", "c_1", "an ideal 3:1 mirror, 1 reader"),
        ]
    for key in ("ms", "ps"):
        for mode in modes:
            rows += [
                (f"{key}_{mode}", f"{key}_sum", "the new sum"),
                (f"{key}_{mode}", f"{key}_alone", "the faster drive alone"),
            ]
    for mode in modes:
        rows += [
            (f"sh_{mode}", f"sh_left_{mode}", ""),
            (f"sh_{mode}", "sh_fast", "the faster drive alone"),
        ]
    for key, ref, what in rows:
        what = what or res[ref]["label"]
        got, base = res[key]["gb_per_s"] * 1e3, res[ref]["gb_per_s"] * 1e3
        bal = res[key].get("balance", {})
        served = " / ".join(f"{x:.0%}" for x in res[key].get("served_shares", []))
        shares = " / ".join(f"{x:.0%}" for x in bal.get("shares", []))
        busy = " / ".join(f"{x:.0%}" for x in bal.get("utilization", []))
        cpu = res[key].get("cpu_s_per_gb", 0.0)
        print(
            f"{key + ') ' + res[key]['label']:<58} {got:>8.1f} {got / base:>6.2f}  {what:<40} {cpu:>8.2f}"
            f"  {served}, {shares}, {busy}"
        )
    for key in res:
        if key.endswith("_warm"):
            print(f"{key + ') ' + res[key]['label']:<58} {res[key]['gb_per_s'] * 1e3:>8.1f}")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fast", type=float, default=150, help="MB/s of the fast drive (default 150)")
    p.add_argument("--slow", type=float, default=50, help="MB/s of the slow drive (default 50)")
    p.add_argument("--symmetric", type=float, default=100, help="MB/s of each drive in h) (default 100)")
    p.add_argument("--threads", type=int, default=16, help="bench reader threads (default 16)")
    p.add_argument("--seconds", type=float, default=10, help="seconds per phase (default 10)")
    p.add_argument(
        "--model-gb",
        type=float,
        help="checkpoint size (default: 1.5 x what the fastest phase reads, so no expert is read twice)",
    )
    p.add_argument(
        "--expert-mb",
        type=float,
        default=19,
        help="size of one expert (default 19, as in big MoE models; the probe reads this size too)",
    )
    p.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    p.add_argument(
        "--stripe-study",
        action="store_true",
        help="only the routing study: expert vs stripe, 1 O_DIRECT reader, 1 mmap reader, 4 and 32 readers",
    )
    p.add_argument(
        "--partial-study",
        action="store_true",
        help="only the partial-mirror study: learn usage, stage a share of the shards, plain vs informed",
    )
    p.add_argument(
        "--fault-study",
        action="store_true",
        help="only the fault study: the mirror healthy, hung, failing, through a fault-injecting FUSE",
    )
    p.add_argument(
        "--adapt-study",
        action="store_true",
        help="only the adaptive-weights study: wrong weights, the mirror or the primary slowing mid-run",
    )
    p.add_argument(
        "--membership-study",
        action="store_true",
        help="only the membership study: the mirror removed and added back under load",
    )
    p.add_argument(
        "--adapt-modes",
        default="stripe,adaptive,queue",
        help="the routing modes the adaptive study compares (default stripe,adaptive,queue)",
    )
    p.add_argument("--ram", action="store_true", help="the drive images in /dev/shm (fast drives)")
    p.add_argument("--zipf", type=float, default=1.0, help="skew of the partial study's workload (default 1)")
    p.add_argument(
        "--budget-share", type=float, default=0.25, help="share of the model staged in the partial study"
    )
    p.add_argument(
        "--sweep-readahead",
        metavar="KB,...",
        default="128,512,1024,2048,4096",
        help="readahead values for the mmap/buffered sweep (default 128,512,1024,2048,4096; '' skips it)",
    )
    args = p.parse_args()
    if args.model_gb is None:
        args.model_gb = max(1.0, 1.5 * args.seconds * max(args.fast + args.slow, 2 * args.symmetric) / 1000)
    return args


def _write_model(rig: Rig, args: argparse.Namespace) -> None:
    print(f"writing a {args.model_gb:g} GB checkpoint to both drives ...", file=sys.stderr)
    # An expert is 3 projections of hidden × inter uint8 (plus tiny scales); hidden 2048.
    inter = max(32, round(args.expert_mb * 1e6 / 3 / 2048 / 32) * 32)
    experts = 32
    layers = max(1, round(args.model_gb * 1e9 / (experts * 3 * 2048 * inter)))
    write_checkpoint(str(rig.dirs[0]), "deepseek", layers, experts, hidden=2048, inter=inter, shards=8)
    shutil.copytree(rig.dirs[0], rig.dirs[1])
    settle()


def main() -> int:
    args = _parse()
    if os.geteuid() != 0:
        print("dual-drive: needs root (loop devices, mounts, blkio cgroup)", file=sys.stderr)
        return 2
    if not os.path.isdir(CGROUP_ROOT):
        print(f"dual-drive: {CGROUP_ROOT} is missing (needs cgroup v1 blkio)", file=sys.stderr)
        return 2

    clean_up_on_signals()
    work = Path(tempfile.mkdtemp(prefix="colifs-dual-"))
    rig = None
    try:
        rig = Rig(
            work, image_gb=args.model_gb * 1.6 + 0.3, ram=args.ram
        )  # room for the dense layers of small experts
        devs = rig.devnames()
        _write_model(rig, args)
        mnt = work / "mnt"
        mnt.mkdir()
        rig.throttle(args.fast, args.slow)
        res: dict[str, dict] = {}

        def phase(key: str, label: str, dirs: list[Path], *extra: str) -> None:
            print(f"{key}) {label} ...", file=sys.stderr)
            res[key] = bench(dirs, args, devs, *extra)
            res[key]["label"] = label

        a, b = rig.dirs
        phase("a", "primary directly", [a])
        phase("b", "mirror directly", [b])
        studies = {"stripe_study": stripe_study}
        for name, study in studies.items():
            if getattr(args, name):
                study(args, phase, rig, mnt, res)
                return 0
        studies_w = {
            "partial_study": partial_study,
            "fault_study": fault_study,
            "adapt_study": adapt_study,
            "membership_study": membership_study,
        }
        for name, study in studies_w.items():
            if getattr(args, name):
                study(args, phase, rig, mnt, res, work)
                return 0
        probed = full_study(args, phase, rig, mnt, res, devs)
        if args.json:
            Path(args.json).write_text(
                json.dumps({"args": vars(args), "probed": probed, "phases": res}, indent=1)
            )
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(work / "mnt")], capture_output=True)
        if rig is not None:
            rig.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def full_study(
    args: argparse.Namespace, phase: Callable, rig: Rig, mnt: Path, res: dict[str, dict], devs: list[str]
) -> list[float]:
    """Every default phase: the limit, colifs without and with the mirror (probed, given, wrong
    weights, buffered backing), the readahead sweep, a symmetric pair; then the tables. Returns
    the probed weights."""
    f, s = args.fast, args.slow
    a, b = rig.dirs
    phase("c", "both directly, ideal split", [a, b], "--weights", f"{f:g},{s:g}")
    with colifs_mount([a], mnt, "--no-probe"):
        phase("d", "colifs, no mirror", [mnt])
    with colifs_mount([a, b], mnt) as st:
        probed = [r["weight"] for r in st["replicas"]]
        phase("e", "colifs, probed weights", [mnt])
        phase("e_mmap", "colifs, probed, mmap readers", [mnt], "--mmap")
        phase("e_buf", "colifs, probed, buffered readers", [mnt], "--buffered")
        phase("e_1", "colifs, probed, 1 O_DIRECT reader", [mnt], "--threads", "1")
    with colifs_mount([a, b], mnt, "--weights", f"{f:g},{s:g}"):
        phase("f", f"colifs, --weights {f:g},{s:g}", [mnt])
        phase("f_buf", f"colifs, --weights {f:g},{s:g}, buffered readers", [mnt], "--buffered")
    with colifs_mount([a, b], mnt, "--weights", f"{f:g},{s:g}", "--backing-io", "buffered"):
        phase("fb", "colifs, same, --backing-io buffered", [mnt])
        phase("fb_buf", "colifs, same, --backing-io buffered, buffered readers", [mnt], "--buffered")
    with colifs_mount([a, b], mnt, "--weights", "1,1"):
        phase("g", "colifs, --weights 1,1 (wrong)", [mnt])
    phase("a_again", "primary directly, again (rig check)", [a])
    sweep = [int(x) for x in args.sweep_readahead.split(",") if x]
    for kb in sweep:
        with colifs_mount([a, b], mnt, "--weights", f"{f:g},{s:g}", "--readahead-kb", str(kb)):
            for mode in ("mmap", "buffered"):
                for threads in (args.threads, 1):
                    label = f"readahead {kb} KiB, {mode}, {threads} reader(s)"
                    phase(f"ra{kb}_{mode}_{threads}", label, [mnt], f"--{mode}", "--threads", str(threads))
    rig.throttle(args.symmetric, args.symmetric)
    phase("a2", f"one drive directly, both at {args.symmetric:g}", [a])
    with colifs_mount([a, b], mnt) as st2:
        probed_sym = [r["weight"] for r in st2["replicas"]]
        phase("h", "colifs, symmetric pair, probed", [mnt])
    _print_phases(args, res, devs)
    _print_ratios(args, res, probed, probed_sym)
    if sweep:
        _print_sweep(args, res, sweep)
    return probed


def _print_phases(args: argparse.Namespace, res: dict[str, dict], devs: list[str]) -> None:
    print()
    print(
        f"drives: fast {args.fast:g} MB/s, slow {args.slow:g} MB/s (blkio throttle on loop-backed ext4); "
        f"{args.threads} readers, {args.seconds:g} s per phase, cold caches, "
        f"experts of {res['a']['expert_mb']:.1f} MB"
    )
    head = f"{'phase':<44} {'GB/s':>7} {'experts/s':>10} {'p50 ms':>7} {'p99 ms':>7}"
    print(f"{head} {'in flight fast/slow':>20}")
    for key, r in res.items():
        infl = r["inflight"]
        fl = "/".join("-" if infl.get(d) is None else f"{infl[d]:.1f}" for d in devs)
        lat = r["latency_ms"]
        print(
            f"{key + ') ' + r['label']:<44} {r['gb_per_s']:>7.3f} {r['experts_per_s']:>10.1f}"
            f" {lat['p50']:>7.1f} {lat['p99']:>7.1f} {fl:>20}"
        )
    wrapped = [k for k, r in res.items() if r["passes"]]
    if wrapped:
        print(
            f"INVALID: {', '.join(wrapped)} read every expert and began again (cache hits): raise --model-gb"
        )


def _print_ratios(
    args: argparse.Namespace, res: dict[str, dict], probed: list[float], probed_sym: list[float]
) -> None:
    f, s = args.fast, args.slow
    g = {k: v["gb_per_s"] for k, v in res.items()}
    ratio = probed[0] / probed[1]
    print()
    err = (ratio / (f / s) - 1) * 100
    print(f"probed weights {probed[0]:g},{probed[1]:g}: ratio {ratio:.2f} vs true {f / s:.2f} ({err:+.1f}%)")
    print(f"symmetric pair probed {probed_sym[0]:g},{probed_sym[1]:g}")
    ratios = [
        ("e/c", "colifs vs the two drives' limit", g["e"] / g["c"], ">= 0.95"),
        ("e/a", "colifs pair vs the fast drive alone", g["e"] / g["a"], ""),
        ("d/a", "FUSE cost at drive speed", g["d"] / g["a"], ">= 0.95"),
        ("g/f", "wrong weights 1,1 vs right", g["g"] / g["f"], ""),
        ("fb/f", "buffered backing vs O_DIRECT backing", g["fb"] / g["f"], ""),
        ("fb_buf/f_buf", "the same, buffered readers", g["fb_buf"] / g["f_buf"], ""),
        ("h/a2", "symmetric pair vs one drive", g["h"] / g["a2"], ">= 1.9"),
        ("e_mmap/e", "mmap readers vs O_DIRECT readers", g["e_mmap"] / g["e"], ">= 0.90"),
        ("e_buf/e", "buffered readers vs O_DIRECT readers", g["e_buf"] / g["e"], ">= 0.90"),
    ]
    for name, what, value, target in ratios:
        print(f"{name:<9} {what:<40} {value:6.3f}   {('target ' + target) if target else ''}")


def _print_sweep(args: argparse.Namespace, res: dict[str, dict], sweep: list[int]) -> None:
    g = {k: v["gb_per_s"] for k, v in res.items()}
    print()
    print(f"readahead sweep, colifs --weights {args.fast:g},{args.slow:g}: GB/s (ratio to O_DIRECT readers, "
          "same count)")  # fmt: skip
    print(
        f"{'read_ahead_kb':>13} {'mmap x' + str(args.threads):>16} {'mmap x1':>16} "
        f"{'buffered x' + str(args.threads):>16} {'buffered x1':>16}"
    )
    for kb in sweep:
        cells = []
        for mode in ("mmap", "buffered"):
            for threads, ref in ((args.threads, g["e"]), (1, g["e_1"])):
                v = g[f"ra{kb}_{mode}_{threads}"]
                cells.append(f"{v:.3f} ({v / ref:.2f})")
        print(f"{kb:>13} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    raise SystemExit(main())
