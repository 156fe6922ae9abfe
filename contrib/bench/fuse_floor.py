"""What the least a FUSE server can do costs in CPU per GB on this machine, /dev/fuse against FUSE
over io_uring, beside colifs on the same file: the floor under the daemon-CPU targets.

    python contrib/bench/fuse_floor.py [--rounds 2] [--mb-per-s 900] [--gb 2]

One file on a RAM-backed loop device throttled to --mb-per-s (blkio), read cold through each
server by three readers, the readers in a 600 MiB memory cgroup: `dd bs=128k` (a buffered reader),
random 1 MiB stretches faulted in from an mmap by 2 threads for 8 s (a decode's pattern), and
`dd iflag=direct bs=16M` (O_DIRECT: 1 MiB requests, many in flight). Servers: contrib/bench/
fuse_floor.c with 16 threads on /dev/fuse ("classic", libfuse's way), and over io_uring with 4
entries per CPU queue, then `colifs mount` of the file's directory (native engine, one drive).
Prints each server's MB/s and CPU s/GB (utime + stime per GB it read from the drive).

Needs root, cgroup v1 (blkio, memory), gcc and liburing-dev (`apt-get install liburing-dev`), and
for io_uring a kernel with CONFIG_FUSE_IO_URING: the fuse module's enable_uring is set to Y for the
run and put back after. Cleans up on any exit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from dual_drive import COLIFS, cpu_seconds

ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")
BLKIO, MEMORY = Path("/sys/fs/cgroup/blkio"), Path("/sys/fs/cgroup/memory")
SERVERS = ("classic", "uring", "colifs")


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def read_bytes(pid: int) -> int:
    """What the process read from block devices so far (its O_DIRECT backing reads)."""
    lines = Path(f"/proc/{pid}/io").read_text().splitlines()
    return int(next(x for x in lines if x.startswith("read_bytes")).split()[1])


def in_cgroup(cg: Path, cmd: list[str]) -> list[str]:
    return ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh", *cmd]


@contextlib.contextmanager
def rig(work: Path, mb_per_s: float, gb: float) -> Iterator[tuple[Path, Path, Path]]:
    """The file on a throttled RAM-backed drive: (its directory, the blkio cgroup, the memory one)."""
    img, d = Path(f"/dev/shm/fuse-floor-{os.getpid()}.img"), work / "d"
    blk, mem = BLKIO / f"fuse-floor-{os.getpid()}", MEMORY / f"fuse-floor-{os.getpid()}"
    loop, uring_was = None, ENABLE_URING.read_text().strip() if ENABLE_URING.exists() else None
    try:
        sh("truncate", "-s", f"{int(gb * 1000 + 1000)}M", str(img))
        loop = sh("losetup", "-f", "--show", str(img))
        sh("mkfs.ext4", "-q", loop)
        d.mkdir()
        sh("mount", loop, str(d))
        print(f"writing {gb:g} GB ...", file=sys.stderr)
        sh("dd", "if=/dev/urandom", f"of={d}/model", "bs=1M", f"count={int(gb * 1000)}", "status=none")
        sh("sync")
        blk.mkdir()
        dev = Path(f"/sys/block/{Path(loop).name}/dev").read_text().strip()
        (blk / "blkio.throttle.read_bps_device").write_text(f"{dev} {int(mb_per_s * 1e6)}\n")
        mem.mkdir()
        (mem / "memory.limit_in_bytes").write_text(f"{600 << 20}\n")
        if uring_was is not None:
            ENABLE_URING.write_text("Y\n")
        yield d, blk, mem
    finally:
        if uring_was is not None:
            ENABLE_URING.write_text(f"{uring_was}\n")
        subprocess.run(["umount", str(d)], capture_output=True)
        if loop:
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        img.unlink(missing_ok=True)
        for cg in (blk, mem):
            with contextlib.suppress(OSError):
                for pid in (cg / "cgroup.procs").read_text().split():
                    (cg.parent / "cgroup.procs").write_text(f"{pid}\n")
                cg.rmdir()


@contextlib.contextmanager
def server(name: str, floor: Path, d: Path, mnt: Path, blk: Path) -> Iterator[int]:
    """The server `name` over d/model at mnt, in the blkio cgroup; yields its pid once it serves."""
    if name == "colifs":
        cmd = [*COLIFS, "mount", str(d), str(mnt), "-f", "--readahead-kb", "128"]
    else:
        cmd = [str(floor), name, "16" if name == "classic" else "4", str(d / "model"), str(mnt)]
    proc = subprocess.Popen(in_cgroup(blk, cmd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (mnt / "model").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not serve")
            time.sleep(0.05)
        time.sleep(1.5)  # io_uring: every queue registered
        dev = os.stat(mnt).st_dev
        Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").write_text("128\n")
        yield proc.pid
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        proc.kill()
        proc.wait()


def measure(pid: int, mem: Path, reader: list[str]) -> tuple[float, float]:
    """(MB/s the server read, its CPU s per GB) over one cold reader run."""
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    cpu0, read0, t0 = cpu_seconds(pid), read_bytes(pid), time.monotonic()
    subprocess.run(in_cgroup(mem, reader), check=True, capture_output=True)
    gb = (read_bytes(pid) - read0) / 1e9
    return gb * 1e3 / (time.monotonic() - t0), (cpu_seconds(pid) - cpu0) / gb


Results = dict[tuple[str, str], list[tuple[float, float]]]  # (server, reader) -> (MB/s, s/GB) per round


def rounds(
    n: int,
    readers: dict[str, list[str]],
    serving: Callable[[str], contextlib.AbstractContextManager[int]],
    mem: Path,
) -> Results:
    """Every reader through every server, n times, a server mounted afresh for each round."""
    results: Results = {}
    for r in range(n):
        for name in SERVERS:
            with serving(name) as pid:
                for label, reader in readers.items():
                    mb, s_gb = measure(pid, mem, reader)
                    results.setdefault((name, label), []).append((mb, s_gb))
                    print(f"round {r + 1}: {name}, {label}: {mb:.0f} MB/s, {s_gb:.3f} s/GB", file=sys.stderr)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mb-per-s", type=float, default=900)
    p.add_argument("--gb", type=float, default=2)
    args = p.parse_args()
    if os.geteuid() != 0 or not BLKIO.is_dir():
        print("fuse_floor: needs root and cgroup v1 (blkio, memory)", file=sys.stderr)
        return 2
    if not Path("/usr/include/liburing.h").exists():
        print("fuse_floor: needs liburing-dev (apt-get install liburing-dev)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fuse-floor-") as tmp:
        work = Path(tmp)
        floor = work / "fuse_floor"
        source = Path(__file__).with_name("fuse_floor.c")
        sh("gcc", "-O2", "-Wall", "-Wextra", "-o", str(floor), str(source), "-luring", "-lpthread")
        mnt = work / "mnt"
        mnt.mkdir()
        readers = {
            "buffered, dd bs=128k": ["dd", f"if={mnt}/model", "of=/dev/null", "bs=128k"],
            "mmap, random 1 MiB stretches": [str(floor), "touch", f"{mnt}/model", "2", "8"],
            "O_DIRECT, dd bs=16M": ["dd", f"if={mnt}/model", "of=/dev/null", "bs=16M", "iflag=direct"],
        }
        with rig(work, args.mb_per_s, args.gb) as (d, blk, mem):
            results = rounds(args.rounds, readers, lambda name: server(name, floor, d, mnt, blk), mem)
        print(f"\none file at {args.mb_per_s:g} MB/s, read cold; server CPU s/GB, median (min-max) of "
              f"{args.rounds} rounds, and MB/s")  # fmt: skip
        for label in readers:
            print(f"\n{label}:")
            for name in SERVERS:
                runs = results[(name, label)]
                s = [x[1] for x in runs]
                print(f"  {name:<8} {statistics.median(s):.3f} s/GB ({min(s):.3f}-{max(s):.3f})  "
                      f"{statistics.median(x[0] for x in runs):.0f} MB/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
