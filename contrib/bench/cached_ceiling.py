"""The mount's own cost: backing files in page cache, so no drive limits either side.

Side by side in one run: 1 MiB reads of the backing file directly (page cache) vs 1 MiB O_DIRECT
client reads through a colifs mount (every request reaches the daemon), for 1 and 8 reader
threads, with the daemon's CPU seconds per GB. Usage: python contrib/bench/cached_ceiling.py [MB]
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from colifs.synth import write_checkpoint

CHUNK = 1 << 20


def read_all(paths: list[Path], threads: int, direct: bool) -> float:
    """GB/s reading every file once in 1 MiB requests spread over `threads` threads."""
    jobs = [(p, off) for p in paths for off in range(0, p.stat().st_size, CHUNK)]
    got = [0] * threads

    def work(k: int) -> None:
        buf = mmap.mmap(-1, CHUNK)
        fds: dict[Path, int] = {}
        for p, off in jobs[k::threads]:
            if p not in fds:
                fds[p] = os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            got[k] += os.preadv(fds[p], [buf], off)
        for fd in fds.values():
            os.close(fd)

    t0 = time.monotonic()
    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(got) / (time.monotonic() - t0) / 1e9


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    mb = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    work = Path(tempfile.mkdtemp(prefix="colifs-cached-"))
    primary, mirror, mnt = work / "p", work / "m", work / "mnt"
    colifs = [sys.executable, "-m", "colifs"]
    try:
        # 64 experts × 3 projections of hidden×inter bytes per layer; sized to ~mb MB
        layers = max(1, mb // 48)
        write_checkpoint(str(primary), "deepseek", layers=layers, experts=64, hidden=512, inter=512, shards=8)
        shutil.copytree(primary, mirror)
        mnt.mkdir()
        paths = sorted(primary.glob("*.safetensors"))
        total = sum(p.stat().st_size for p in paths)
        for p in paths + sorted(mirror.glob("*.safetensors")):
            p.read_bytes()  # into page cache
        subprocess.run(
            [*colifs, "mount", str(primary), str(mirror), str(mnt)], check=True, capture_output=True
        )
        pid = json.loads((mnt / ".colifs" / "stats.json").read_text())["pid"]
        via = [mnt / p.name for p in paths]
        print(f"{len(paths)} shards, {total / 1e9:.2f} GB, backing files in page cache, 1 MiB requests")
        print(f"{'threads':>7} {'direct GB/s':>12} {'mount GB/s':>11} {'ratio':>6} {'daemon s/GB':>12}")
        for threads in (1, 8):
            direct = read_all(paths, threads, direct=False)
            c0 = cpu_seconds(pid)
            through = read_all(via, threads, direct=True)
            cpu = (cpu_seconds(pid) - c0) / (total / 1e9)
            print(f"{threads:>7} {direct:>12.2f} {through:>11.2f} {through / direct:>6.2f} {cpu:>12.2f}")
        subprocess.run([*colifs, "umount", str(mnt)], check=True)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
