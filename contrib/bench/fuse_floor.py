"""What the least a FUSE server can do costs in CPU per GB on this machine, /dev/fuse against FUSE
over io_uring, beside colifs on the same file: the floor under the daemon-CPU targets.

    python contrib/bench/fuse_floor.py [--rounds 2] [--mb-per-s 900] [--gb 2] [--disk]

One file on a RAM-backed loop device throttled to --mb-per-s (blkio), read cold through each
server by three readers, the readers in a 600 MiB memory cgroup: `dd bs=128k` (a buffered reader),
random 1 MiB stretches faulted in from an mmap by 2 threads for 8 s (a decode's pattern), and
`dd iflag=direct bs=16M` (O_DIRECT: 1 MiB requests, many in flight). Servers: contrib/bench/
fuse_floor.c with 16 threads on /dev/fuse ("classic", libfuse's way), and over io_uring with 4
entries per CPU queue, then `colifs mount` of the file's directory (native engine, one drive).
Prints each server's MB/s and CPU s/GB (utime + stime per GB it read from the drive).

`--disk`: the image on disk instead, read by the loop device with O_DIRECT. A RAM-backed loop
device copies each read into the server's buffer on one of this machine's cores (so the reply's
copy may find the bytes in that core's cache); a disk's data arrives by DMA, as a real NVMe's does.

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
from dual_drive import COLIFS, Rig, cpu_seconds, sh
from engines import MemoryCgroup

from colifs.kernel import bdi_read_ahead

ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")
BLKIO = Path("/sys/fs/cgroup/blkio")
SERVERS = ("classic", "uring", "colifs")


def read_bytes(pid: int) -> int:
    """What the process read from block devices so far (its O_DIRECT backing reads)."""
    lines = Path(f"/proc/{pid}/io").read_text().splitlines()
    return int(next(x for x in lines if x.startswith("read_bytes")).split()[1])


@contextlib.contextmanager
def rig(work: Path, mb_per_s: float, gb: float, ram: bool) -> Iterator[tuple[Path, MemoryCgroup]]:
    """The file on a drive throttled to `mb_per_s`, RAM-backed or not (the rig's second drive stays unused;
    this process joins the blkio cgroup, so the servers it starts are throttled), and the readers'
    memory cgroup: (the file's directory, that cgroup)."""
    drives = readers = None
    uring_was = ENABLE_URING.read_text().strip() if ENABLE_URING.exists() else None
    try:
        drives = Rig(work, gb + 1, ram=ram)
        d = drives.dirs[0]
        d.mkdir()
        print(f"writing {gb:g} GB ...", file=sys.stderr)
        sh("dd", "if=/dev/urandom", f"of={d}/model", "bs=1M", f"count={int(gb * 1000)}", "status=none")
        sh("sync")
        drives.throttle(mb_per_s, mb_per_s)
        readers = MemoryCgroup(600)
        if uring_was is not None:
            ENABLE_URING.write_text("Y\n")
        yield d, readers
    finally:
        if uring_was is not None:
            ENABLE_URING.write_text(f"{uring_was}\n")
        if readers is not None:
            readers.close()
        if drives is not None:
            drives.close()


@contextlib.contextmanager
def server(name: str, floor: Path, d: Path, mnt: Path) -> Iterator[int]:
    """The server `name` over d/model at mnt; yields its pid once it serves."""
    if name == "colifs":
        cmd = [*COLIFS, "mount", str(d), str(mnt), "-f", "--readahead-kb", "128"]
    else:
        cmd = [str(floor), name, "16" if name == "classic" else "4", str(d / "model"), str(mnt)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (mnt / "model").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not serve")
            time.sleep(0.05)
        time.sleep(1.5)  # io_uring: every queue registered
        Path(bdi_read_ahead(str(mnt))).write_text("128\n")
        yield proc.pid
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        proc.kill()
        proc.wait()


def measure(pid: int, readers: MemoryCgroup, reader: list[str]) -> tuple[float, float]:
    """(MB/s the server read, its CPU s per GB) over one cold reader run, the reader in `readers`."""
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    cpu0, read0, t0 = cpu_seconds(pid), read_bytes(pid), time.monotonic()
    inside = ["sh", "-c", f'echo $$ > {readers.path}/cgroup.procs && exec "$@"', "sh", *reader]
    subprocess.run(inside, check=True, capture_output=True)
    gb = (read_bytes(pid) - read0) / 1e9
    return gb * 1e3 / (time.monotonic() - t0), (cpu_seconds(pid) - cpu0) / gb


Results = dict[tuple[str, str], list[tuple[float, float]]]  # (server, reader) -> (MB/s, s/GB) per round


def rounds(
    n: int,
    readers: dict[str, list[str]],
    serving: Callable[[str], contextlib.AbstractContextManager[int]],
    memory: MemoryCgroup,
) -> Results:
    """Every reader through every server, n times, a server mounted afresh for each round."""
    results: Results = {}
    for r in range(n):
        for name in SERVERS:
            with serving(name) as pid:
                for label, reader in readers.items():
                    mb, s_gb = measure(pid, memory, reader)
                    results.setdefault((name, label), []).append((mb, s_gb))
                    print(f"round {r + 1}: {name}, {label}: {mb:.0f} MB/s, {s_gb:.3f} s/GB", file=sys.stderr)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mb-per-s", type=float, default=900)
    p.add_argument("--gb", type=float, default=2)
    p.add_argument("--disk", action="store_true", help="the drive's image on disk, not in /dev/shm")
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
        with rig(work, args.mb_per_s, args.gb, ram=not args.disk) as (d, memory):
            results = rounds(args.rounds, readers, lambda name: server(name, floor, d, mnt), memory)
        where = "on disk (loop, direct-io)" if args.disk else "in RAM"
        print(f"\none file at {args.mb_per_s:g} MB/s, {where}, read cold; server CPU s/GB, median (min-max) "
              f"of {args.rounds} rounds, and MB/s")  # fmt: skip
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
