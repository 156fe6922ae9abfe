"""The mount's own cost: backing files in page cache, so no drive limits either side.

Side by side in one run, 1 MiB reads: the backing files directly (page cache); O_DIRECT client
reads (every request reaches the daemon) through a bare inline-pread pyfuse3 filesystem (the
reference: the least a Python FUSE daemon does) and through colifs; 1 and 8 reader threads; each
daemon's CPU seconds per GB.
Usage: python contrib/bench/cached_ceiling.py [MB] [colifs mount flags, e.g. --backing-io buffered]
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

from dual_drive import cpu_seconds

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
        bare_mnt = work / "bare"
        bare_mnt.mkdir()
        bare = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("bare_fs.py")), str(primary), str(bare_mnt)]
        )
        subprocess.run(
            [*colifs, "mount", str(primary), str(mirror), str(mnt), *sys.argv[2:]],
            check=True,
            capture_output=True,
        )
        while not (bare_mnt / paths[0].name).exists():
            time.sleep(0.05)
        pid = json.loads((mnt / ".colifs" / "stats.json").read_text())["pid"]
        print(f"{len(paths)} shards, {total / 1e9:.2f} GB, backing files in page cache, 1 MiB requests")
        print(f"colifs flags: {' '.join(sys.argv[2:]) or '(defaults)'}")
        print(
            f"{'threads':>7} {'direct':>8} {'bare':>6} {'colifs':>7} {'colifs/direct':>14}"
            f" {'colifs/bare':>12}"
            f" {'bare s/GB':>10} {'colifs s/GB':>12}"
        )
        for threads in (1, 8):
            direct = read_all(paths, threads, direct=False)
            rates, cpus = [], []
            for root, daemon in ((bare_mnt, bare.pid), (mnt, pid)):
                c0 = cpu_seconds(daemon)
                rates.append(read_all([root / p.name for p in paths], threads, direct=True))
                cpus.append((cpu_seconds(daemon) - c0) / (total / 1e9))
            print(
                f"{threads:>7} {direct:>8.2f} {rates[0]:>6.2f} {rates[1]:>7.2f} {rates[1] / direct:>14.2f}"
                f" {rates[1] / rates[0]:>12.2f} {cpus[0]:>10.2f} {cpus[1]:>12.2f}"
            )
        print("(GB/s; s/GB = daemon CPU seconds per GB served)")
        subprocess.run([*colifs, "umount", str(mnt)], check=True)
        subprocess.run(["fusermount3", "-u", str(bare_mnt)], check=True)
        bare.wait()
    finally:
        for m in (mnt, work / "bare"):
            subprocess.run(["fusermount3", "-u", "-z", str(m)], capture_output=True)
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
