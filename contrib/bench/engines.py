"""What the real-engine benchmarks (llama_decode.py, hf_load.py, colibri_decode.py) share: the
configurations they compare, the memory cgroup the engine runs in (the colifs daemon joins it: the
pages it puts in the page cache count against the same RAM), one engine run there with cold caches,
and one through a colifs mount with the bytes the daemon served and its CPU per GB.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from dual_drive import COLIFS, TICK, Rig, clean_up_on_signals, colifs_mount, cpu_seconds, settle

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")


def engine_python() -> str:
    """The engines' interpreter: $ENGINE_PYTHON, else the checkout's .venv-engines (make bench-engines)."""
    return os.environ.get("ENGINE_PYTHON", str(Path(__file__).parents[2] / ".venv-engines/bin/python"))


def can_run(prog: str) -> bool:
    """Root and cgroup v1 (blkio, memory), which the rig needs; if not, says so in one line."""
    if os.geteuid() == 0 and MEMORY_ROOT.is_dir():
        return True
    print(f"{prog}: needs root and cgroup v1 (blkio, memory)", file=sys.stderr)
    return False


def set_readahead(rig: Rig, kb: int) -> None:
    """The fast drive's readahead (a configuration's readahead_kb), for the opens that follow."""
    Path(f"/sys/block/{rig.devnames()[0]}/queue/read_ahead_kb").write_text(f"{kb}\n")


class Config(NamedTuple):
    label: str
    flags: list[str] | None  # colifs' (None: the fast drive read directly)
    readahead_kb: int  # the fast drive's
    drives: int = 2  # colifs over both drives, or over the fast one only
    again: bool = False  # measure the engine's second run on the mount (the first one unmeasured)
    mirror: bool = False  # no colifs: the engine reads both drives itself (its own mirror, MIRROR_CONFIGS)
    unlimited: bool = False  # the drives with no latency and no rate limit for this run (Rig.unlimited)
    tree: str | None = None  # mounted by the colifs of this other checkout (NAME@DIR: an A/B of builds)

    @property
    def baseline(self) -> bool:
        """The fast drive read directly, limits on: what every ratio is of."""
        return self.flags is None and not self.mirror and not self.unlimited

    @property
    def alone(self) -> bool:
        """colifs over the fast drive only, limits on: the other column ratios are of."""
        return self.flags is not None and self.drives == 1 and not self.unlimited


CONFIGS = (
    "direct32",
    "direct64",
    "direct128",
    "direct512",
    "defaults",
    "probed",
    "again",
    "fastonly",
    "readahead32",
    "readahead64",
    "readahead512",
    "readahead1024",
    "nofill",
    "passthrough",
    "passthrough512",
    "threads4",
    "directreads",
    "directreadsfast",
    "directreadsbuf",
    "expert",
    "stripe",
    "ceiling",
    "ceilingfast",
    "ceilingdirect",
    "ceilingdirectreads",
)
# Only for an engine that can read a mirror itself (Colibrì's COLI_MODEL_MIRROR): `rig_arguments`'
# `known`. Not in CONFIGS, whose engines would read the fast drive alone under that name.
MIRROR_CONFIGS = ("mirror",)


def config_list(text: str, known: tuple[str, ...] = CONFIGS) -> str:
    """An argparse type: configuration names, the baseline among them; NAME@DIR is NAME mounted by
    the colifs of the checkout DIR (its native engine built there)."""
    names = [n.partition("@")[0] for n in text.split(",")]
    unknown = set(names) - set(known)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    if not {n for n in known if n.startswith("direct")} & set(text.split(",")):
        raise argparse.ArgumentTypeError("needs a direct configuration: the baseline")
    for c in configs(1, 1, text):
        if c.tree and c.flags is None:
            raise argparse.ArgumentTypeError(f"{c.label}: no colifs mount to take from another checkout")
        if c.tree and not (Path(c.tree) / "colifs" / "__init__.py").is_file():
            raise argparse.ArgumentTypeError(f"{c.tree}: no colifs checkout there")
    return text


def rig_arguments(p: argparse.ArgumentParser, default_configs: str, known: tuple[str, ...] = CONFIGS) -> None:
    """The options every engine benchmark has: drive speeds, memory, repeats, configurations, JSON;
    `known`: the configurations this engine can run."""
    p.add_argument("--fast", type=float, default=150, help="the fast drive's MB/s (default 150)")
    p.add_argument("--slow", type=float, default=50, help="the slow drive's MB/s (default 50)")
    p.add_argument("--mem-mib", type=int, default=1200, help="the engine's memory cgroup (default 1200)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--configs",
        default=default_configs,
        type=lambda text: config_list(text, known),
        help=f"the configurations to run, in order (known: {','.join(known)}; default {default_configs}); "
        "NAME@DIR: NAME mounted by the colifs of the checkout DIR, its native engine built there (an A/B "
        "of two builds in one run)",
    )
    p.add_argument("--json", metavar="FILE", help="the results, saved after every run")
    p.add_argument("--ram", action="store_true", help="the drive images in /dev/shm (fast drives: 900 + 300)")
    p.add_argument(
        "--latency",
        action="store_true",
        help="drives with latency (latency_drive.py, RAM-backed): each read waits that of a real drive's "
        "bandwidth-delay product (560 KB fast, 270 KB slow) at its rate; one 128 KiB read in flight gets "
        "a fraction of the drive",
    )


def configs(fast: float, slow: float, names: str) -> list[Config]:
    w = f"{fast:g},{slow:g}"
    named = {
        # llama.cpp advises POSIX_FADV_SEQUENTIAL on the files it maps, which doubles their
        # readahead, and an mmap fault reads around by that window (docs/benchmarks.md run 48).
        "direct32": Config("fast drive directly, readahead 32 KiB", None, 32),
        "direct64": Config("fast drive directly, readahead 64 KiB", None, 64),
        "direct128": Config("fast drive directly, readahead 128 KiB", None, 128),
        "direct512": Config("fast drive directly, readahead 512 KiB", None, 512),
        "defaults": Config("colifs, both drives (defaults)", ["--weights", w], 128),
        # No weights: the mount probes the drives, which also chooses its readahead (colifs.kernel).
        "probed": Config("colifs, both drives, probed (no --weights)", [], 128),
        # A mount that serves the engine a second time: what it learnt while serving the first
        # (the readahead of the drives' measured speed, for later opens) is in force.
        "again": Config("colifs, both drives (defaults), second run", ["--weights", w], 128, again=True),
        "fastonly": Config("colifs, fast drive only (defaults)", [], 128, drives=1),
        "readahead32": Config(
            "colifs, both, --readahead-kb 32", ["--weights", w, "--readahead-kb", "32"], 128
        ),
        "readahead64": Config(
            "colifs, both, --readahead-kb 64", ["--weights", w, "--readahead-kb", "64"], 128
        ),
        # Larger FUSE requests (up to libfuse 3.14's 1 MiB, max_pages 256), each split over the
        # drives in flight at once (#39's "max_pages" design).
        "readahead512": Config(
            "colifs, both, --readahead-kb 512", ["--weights", w, "--readahead-kb", "512"], 128
        ),
        "readahead1024": Config(
            "colifs, both, --readahead-kb 1024", ["--weights", w, "--readahead-kb", "1024"], 128
        ),
        "nofill": Config("colifs, both, --fill-mib 0 (no fills)", ["--weights", w, "--fill-mib", "0"], 128),
        "passthrough": Config("colifs, both, --passthrough", ["--weights", w, "--passthrough"], 128),
        "passthrough512": Config(
            "colifs, both, --passthrough, drive readahead 512 KiB", ["--weights", w, "--passthrough"], 512
        ),
        "threads4": Config("colifs, both, --fuse-threads 4", ["--weights", w, "--fuse-threads", "4"], 128),
        # Read calls straight to the daemon, cached by the drives' own page caches (#39).
        "directreads": Config("colifs, both, --direct-reads", ["--weights", w, "--direct-reads"], 128),
        "directreadsfast": Config(
            "colifs, fast drive only, --direct-reads", ["--direct-reads"], 128, drives=1
        ),
        "directreadsbuf": Config(
            "colifs, both, --direct-reads --backing-io buffered",
            ["--weights", w, "--direct-reads", "--backing-io", "buffered"],
            128,
        ),
        "expert": Config("colifs, both, --routing expert", ["--weights", w, "--routing", "expert"], 128),
        "stripe": Config("colifs, both, --routing stripe", ["--weights", w, "--routing", "stripe"], 128),
        "mirror": Config(f"the engine's own mirror, both drives ({w})", None, 128, mirror=True),
    }
    # The mount's ceiling on this machine: `defaults` and `fastonly` with the drives without limit
    # from before the mount (its probe sees them so) to its unmount, so only the served path's own
    # cost (the daemon, the kernel's copies into the page cache, the rig's drive servers) holds the
    # engine back. No read policy gets more out of drives that have limits. `ceilingdirect`, the fast
    # drive read directly without limit, is the engine's own: what is between it and `ceiling` is
    # the mount's cost. `ceilingdirectreads`: the same for `directreads`, whose read calls skip the
    # mount's page cache.
    ceilings = (
        ("ceiling", "defaults"),
        ("ceilingfast", "fastonly"),
        ("ceilingdirect", "direct128"),
        ("ceilingdirectreads", "directreads"),
    )
    for name, of in ceilings:
        named[name] = named[of]._replace(label=f"{named[of].label}, drives without limit", unlimited=True)
    chosen = []
    for name, _, tree in (n.partition("@") for n in names.split(",")):
        c = named[name]
        chosen.append(c._replace(label=f"{c.label} ({tree})", tree=tree) if tree else c)
    return chosen


class MemoryCgroup:
    def __init__(self, limit_mib: int) -> None:
        self.path = MEMORY_ROOT / f"colifs-engine-{os.getpid()}"
        self.path.mkdir()
        self.set_limit(limit_mib)

    def set_limit(self, mib: int) -> None:
        (self.path / "memory.limit_in_bytes").write_text(f"{mib << 20}\n")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            (MEMORY_ROOT / "cgroup.procs").write_text(f"{pid}\n")
        self.path.rmdir()


def peak_rss_mib(pid: int) -> int:
    """The process's resident memory at its peak (VmHWM), MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) // 1024


def run_command_in_cgroup(
    cmd: list[str], cg: MemoryCgroup, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Caches dropped, `cmd` run inside the cgroup from its first instruction (the blkio cgroup is
    inherited), its output captured (bytes that are not UTF-8, e.g. an engine's text from random
    weights, replaced); RuntimeError with the end of its stderr if it fails."""
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    wrap = ["sh", "-c", f'echo $$ > {cg.path}/cgroup.procs && exec "$@"', "sh"]
    out = subprocess.run([*wrap, *cmd], capture_output=True, text=True, errors="replace", env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return out


def run_in_cgroup(py: str, script: str, argv: list[str], cg: MemoryCgroup) -> dict:
    """`script` run by `py` in the cgroup (run_command_in_cgroup); its last output line is a JSON
    object."""
    out = run_command_in_cgroup([py, "-c", script, *argv], cg)
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def measured_mount(
    dirs: list[Path],
    mnt: Path,
    flags: list[str],
    before: Callable[[int], object] | None = None,
    tree: str | None = None,
) -> Iterator[tuple[int, dict]]:
    """A colifs mount over `dirs` (by the colifs of checkout `tree`, if given), yielding the daemon's
    pid and a dict that, once the block is left, holds what the daemon served in it (GB), its CPU
    (s, and per GB) and the drives' byte shares; `before(pid)` runs first, unmeasured."""
    with colifs_mount(dirs, mnt, *flags, tree=tree) as st:
        pid, figures = st["pid"], {}
        if before is not None:
            before(pid)
            st = json.loads((mnt / ".colifs" / "stats.json").read_text())
        cpu0, served0 = cpu_seconds(pid), sum(x["bytes_served"] for x in st["replicas"])
        # What the engine's opens get: the kernel copies the readahead into a file when it opens it.
        figures["readahead_kb"] = st["kernel"].get("read_ahead_kb")
        yield pid, figures
        after = json.loads((mnt / ".colifs" / "stats.json").read_text())
        gb = (sum(x["bytes_served"] for x in after["replicas"]) - served0) / 1e9
        cpu = cpu_seconds(pid) - cpu0
        figures["daemon_gb"] = gb
        figures["daemon_cpu_s"] = cpu  # --passthrough: page-cache readers reach no daemon, no GB
        figures["daemon_cpu_s_per_gb"] = cpu / gb if gb else None
        figures["byte_share"] = [x["byte_share"] for x in after["replicas"]]
        figures["daemon_peak_rss_mib"] = peak_rss_mib(pid)
        figures["readahead_kb_after"] = after["kernel"].get("read_ahead_kb")
        figures["fills"] = after.get("fills")


def host_busy_seconds() -> tuple[float, float]:
    """Every core's busy time so far (user, nice, system, irq, softirq: not idle, I/O wait or time
    the hypervisor took) and the time, in seconds."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / TICK, time.monotonic()


@contextlib.contextmanager
def host_cpu() -> Iterator[dict]:
    """Yields a dict that, once the block is left, holds the CPU every process took in it (s) and
    the share of the machine's cores that was (`host_busy_pct`): a rig near 100 is CPU-bound, and
    there a configuration's extra CPU, the daemon's or the kernel's, costs the engine time."""
    figures: dict = {}
    busy0, t0 = host_busy_seconds()
    yield figures
    busy1, t1 = host_busy_seconds()
    figures["host_cpu_s"] = busy1 - busy0
    figures["host_busy_pct"] = 100 * (busy1 - busy0) / ((t1 - t0) * (os.cpu_count() or 1))


def one_run(
    dirs: list[Path], mnt: Path, config: Config, cg: MemoryCgroup, limit_mib: int, run: Callable[[Path], dict]
) -> dict:
    """`run(root)` on the fast drive (dirs[0]) or through colifs over `dirs`; for colifs the daemon
    joins the cgroup, and the result gets the bytes it served, its CPU and the drives' byte shares.

    One limit for every configuration: what the daemon allocates while serving (its buffers) comes
    out of the engine's page cache, as on a user's machine. (Until 2026-12-02 colifs' limit grew by
    the daemon's RSS + 64 MiB; memory the daemon held before joining is not charged to the cgroup
    (cgroup v1 moves no charges), so that gave the engine up to ~100 MiB more cache than the direct
    runs had.)"""
    cg.set_limit(limit_mib)
    if config.flags is None:
        with host_cpu() as host:
            r = run(dirs[0])
        return {**r, **host}

    def joined(pid: int) -> None:
        cg.add(pid)
        if config.again:
            run(mnt)

    with measured_mount(dirs[: config.drives], mnt, config.flags, joined, config.tree) as (pid, figures):
        with host_cpu() as host:
            r = run(mnt)
        (MEMORY_ROOT / "cgroup.procs").write_text(f"{pid}\n")
    return {**r, **figures, **host}


Results = dict[str, dict[str, list[dict]]]  # variant (load mode, loader) -> configuration label -> runs
OneRun = Callable[[Rig, MemoryCgroup, Path, str, Config], dict]  # rig, cgroup, mount point, variant, config


def interleaved(
    args: argparse.Namespace,
    prefix: str,
    write: Callable[[Path], None],
    variants: list[str],
    run: OneRun,
    before: Callable[[Rig, Path], None] | None = None,
    image_gb: float = 3.6,
) -> tuple[list[Config], Results]:
    """The rig (two throttled drives, `write` filling the first, copied to the second), the memory
    cgroup, then `args.repeats` rounds of every variant x configuration, results saved to
    `args.json` after every run (a failure later loses nothing measured). Cleans up on any exit,
    SIGTERM and SIGHUP included."""

    clean_up_on_signals()
    work = Path(tempfile.mkdtemp(prefix=f"colifs-{prefix}-"))
    rig = cg = None
    try:
        rig = Rig(work, image_gb=image_gb, ram=args.ram, latency=args.latency)
        a, b = rig.dirs
        a.mkdir()
        write(a)
        shutil.copytree(a, b, dirs_exist_ok=True)
        settle()
        rig.throttle(args.fast, args.slow)
        cg = MemoryCgroup(args.mem_mib)
        mnt = work / "mnt"
        mnt.mkdir()
        if before is not None:
            before(rig, mnt)
        chosen = configs(args.fast, args.slow, args.configs)
        results: Results = {}
        for rep in range(args.repeats):
            for variant in variants:
                for config in chosen:
                    print(f"run {rep + 1}/{args.repeats}: {variant}: {config[0]} ...", file=sys.stderr)
                    with rig.unlimited() if config.unlimited else contextlib.nullcontext():
                        r = run(rig, cg, mnt, variant, config)
                    results.setdefault(variant, {}).setdefault(config[0], []).append(r)
                    if args.json:
                        Path(args.json).write_text(
                            json.dumps({"args": vars(args), "results": results}, indent=1, default=str)
                        )
        return chosen, results
    finally:
        subprocess.run([*COLIFS, "umount", "--lazy", str(work / "mnt")], capture_output=True)
        if cg is not None:
            cg.close()
        if rig is not None:
            rig.close()
        shutil.rmtree(work, ignore_errors=True)


def median_of(runs: list[dict], key: str, fmt: str) -> str:
    """The median of a field over the runs that have it, formatted; "-" if none has it."""
    values = [x[key] for x in runs if x.get(key) is not None]
    return format(statistics.median(values), fmt) if values else "-"
