"""Sequential readers on the latency rig: a shard read through from its first byte in read() calls of
one size (cp, cat, a checksum, an engine's fread of its tensors), from the fast drive directly and
through colifs mounts, every phase with cold caches. Prints MB/s, the ratio to the fast drive read
directly in the same repeat, and the daemon's CPU per GB. Root only; cleans up on any exit.

    .venv/bin/python contrib/bench/seq_read.py [--fast 900] [--slow 300] [--sizes 32,128,1024]
        [--repeats 2] [--configs "default;--direct-reads"]

A configuration is the mount's extra flags ("default": none); configurations are separated by ';'.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dual_drive import Rig, clean_up_on_signals, cpu_seconds, settle
from fast_drives import colifs

from colifs.synth import write_checkpoint


def read_through(root: Path, size: int) -> int:
    """Every shard under root, in order, in read() calls of `size` bytes: the bytes read."""
    n = 0
    buf = bytearray(size)
    for f in sorted(root.glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            while k := os.readv(fd, [buf]):
                n += k
        finally:
            os.close(fd)
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fast", type=float, default=900, help="MB/s of the fast drive (default 900)")
    p.add_argument("--slow", type=float, default=300, help="MB/s of the slow drive (default 300)")
    p.add_argument("--sizes", default="32,128,1024", help="read() sizes in KiB (default 32,128,1024)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats (default 2)")
    p.add_argument("--configs", default="default;--direct-reads", help="mount flags per configuration, ';'")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("seq-read: needs root (loop devices, mounts)", file=sys.stderr)
        return 2

    clean_up_on_signals()
    configs = [c.strip() for c in args.configs.split(";") if c.strip()]
    work = Path(tempfile.mkdtemp(prefix="colifs-seq-"))
    rig = None
    try:
        rig = Rig(work, image_gb=2.2, latency=True)
        rig.throttle(args.fast, args.slow)
        a, b = rig.dirs
        print("writing a 1.5 GB checkpoint (experts of 6 MB) to both drives ...", file=sys.stderr)
        write_checkpoint(str(a), "deepseek", 5, 32, hidden=2048, inter=1024, shards=4)
        shutil.copytree(a, b)
        settle()
        mnt = work / "mnt"
        mnt.mkdir()
        print(rig.describe())
        print(f"{'repeat':>6} {'KiB':>5}  {'configuration':<28} {'MB/s':>7} {'ratio':>6} {'s/GB':>5}")
        for rep in range(args.repeats):
            for kib in (int(x) for x in args.sizes.split(",")):
                settle()
                t = time.perf_counter()
                n = read_through(a, kib << 10)
                direct = n / (time.perf_counter() - t) / 1e6
                print(f"{rep:>6} {kib:>5}  {'fast drive directly':<28} {direct:>7.1f} {1:>6.2f}", flush=True)
                for flags in configs:
                    with colifs([a, b], mnt, *([] if flags == "default" else flags.split())) as dm:
                        settle()
                        c0, t = cpu_seconds(dm.pid), time.perf_counter()
                        n = read_through(mnt, kib << 10)
                        mb = n / (time.perf_counter() - t) / 1e6
                        s_gb = (cpu_seconds(dm.pid) - c0) / (n / 1e9)
                    name = f"colifs {flags}"
                    print(
                        f"{rep:>6} {kib:>5}  {name:<28} {mb:>7.1f} {mb / direct:>6.2f} {s_gb:>5.2f}",
                        flush=True,
                    )
    finally:
        os.system(f"fusermount3 -u -z {work / 'mnt'} 2>/dev/null")
        if rig is not None:
            rig.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
