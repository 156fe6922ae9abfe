"""Mount time and daemon size on a checkpoint shaped like DeepSeek-V3 (no data is written).

Builds 163 sparse shards whose headers list ~94k tensors (61 layers × 256 experts × 3 projections,
FP8 weights + scales, plus attention/shared experts), ~690 GB apparent size and a few MB on disk,
mirrors them, then times `colifs mount` (until it is serving) against the cost of parsing the
headers (what a mount must at least do), `colifs umount`, and reads the daemon's RSS. Then again
with a partial mirror (every other shard) and a usage history covering every key: the mount
computes partial-mirror routing, 1 MiB of every shard is read, and the unmount saves the usage
(merged into the history file). Each measured for both engines, with a `colifs reload` of the
mount (every header checked again, nothing changed), and the mirror taken away and added back
(`colifs mirror remove`, `colifs mirror add`: every header of the mirror checked again).
Usage: python contrib/bench/mount_scale.py [WORKDIR]
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS, EXPERTS, SHARDS = 61, 256, 163
HIDDEN, INTER = 7168, 2048


def tensors():
    yield "model.embed_tokens.weight", "BF16", [129280, HIDDEN]
    for L in range(LAYERS):
        p = f"model.layers.{L}"
        for proj, shape in (
            ("q_a_proj", [1536, HIDDEN]),
            ("kv_a_proj_with_mqa", [576, HIDDEN]),
            ("o_proj", [HIDDEN, 16384]),
        ):
            yield f"{p}.self_attn.{proj}.weight", "F8_E4M3", shape
        yield f"{p}.mlp.gate.weight", "BF16", [EXPERTS, HIDDEN]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield f"{p}.mlp.shared_experts.{proj}.weight", "F8_E4M3", [INTER, HIDDEN]
        for e in range(EXPERTS):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"{p}.mlp.experts.{e}.{proj}.weight", "F8_E4M3", [INTER, HIDDEN]
                yield f"{p}.mlp.experts.{e}.{proj}.weight_scale_inv", "F32", [16, 56]
    yield "lm_head.weight", "BF16", [129280, HIDDEN]


def nbytes(dtype: str, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * {"BF16": 2, "F8_E4M3": 1, "F32": 4}[dtype]


def build(root: Path) -> tuple[int, int]:
    root.mkdir(parents=True)
    specs = list(tensors())
    per = -(-len(specs) // SHARDS)
    total = 0
    for k in range(SHARDS):
        meta, off = {}, 0
        for name, dtype, shape in specs[k * per : (k + 1) * per]:
            n = nbytes(dtype, shape)
            meta[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
            off += n
        text = json.dumps(meta).encode()
        path = root / f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(8 + len(text) + off)  # sparse: no tensor data on disk
        total += 8 + len(text) + off
    return len(specs), total


def write_history(path: Path) -> int:
    """A usage file with every key of the model, random (seeded) counts: its size in bytes."""
    import random

    from colifs.formats.experts import tensor_key
    from colifs.usage import Usage, save

    rng = random.Random(0)
    u = Usage(runs=12)
    for name, dtype, shape in tensors():
        u.count(tensor_key(name), nbytes(dtype, shape) * rng.randint(1, 50))
    save(str(path), u)
    return path.stat().st_size


PARSE = """
import json, os, struct, sys
for d in sys.argv[1:]:
    for n in sorted(os.listdir(d)):
        with open(os.path.join(d, n), "rb") as f:
            (k,) = struct.unpack("<Q", f.read(8))
            json.loads(f.read(k))
"""


def drop_caches() -> None:
    subprocess.run(["sync"])
    if os.access("/proc/sys/vm/drop_caches", os.W_OK):  # headers read from disk, as after a reboot
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed_parse(dirs: list[Path]) -> float:
    """The floor a mount is held to: a fresh Python reads and parses every header of every
    replica (caches dropped), nothing else."""
    drop_caches()
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", PARSE, *map(str, dirs)], check=True)
    return time.monotonic() - t0


def timed_mount(colifs: list[str], dirs: list[Path], mnt: Path, *flags: str) -> tuple[float, dict, int]:
    """(seconds until serving, stats.json, daemon RSS in KiB), caches dropped first."""
    drop_caches()
    t0 = time.monotonic()
    done = subprocess.run(
        [*colifs, "mount", *map(str, dirs), str(mnt), "--no-probe", *flags], capture_output=True, text=True
    )
    t = time.monotonic() - t0
    if done.returncode:
        raise RuntimeError(done.stderr)
    st = json.loads((mnt / ".colifs" / "stats.json").read_text())
    status = Path(f"/proc/{st['pid']}/status").read_text()
    return t, st, next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:"))


def timed_reload(colifs: list[str], mnt: Path) -> tuple[float, float]:
    """(seconds `colifs reload` took, the daemon's own figure), caches dropped first."""
    drop_caches()
    t0 = time.monotonic()
    subprocess.run([*colifs, "reload", str(mnt)], check=True, capture_output=True)
    t = time.monotonic() - t0
    return t, json.loads((mnt / ".colifs" / "stats.json").read_text())["reload"]["last"]["seconds"]


def timed_mirror(colifs: list[str], mnt: Path, mirror: Path) -> tuple[float, float]:
    """(seconds `colifs mirror remove` took, seconds `colifs mirror add` took), caches dropped first."""
    out = []
    for action in ("remove", "add"):
        drop_caches()
        t0 = time.monotonic()
        subprocess.run([*colifs, "mirror", action, str(mnt), str(mirror)], check=True, capture_output=True)
        out.append(time.monotonic() - t0)
    return out[0], out[1]


def main() -> int:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="colifs-scale-"))
    primary, mirror, mnt = work / "p", work / "m", work / "mnt"
    colifs = [sys.executable, "-m", "colifs"]
    try:
        n, total = build(primary)
        build(mirror)  # built the same way: a copy would fill the disk (the holes are not kept)
        mnt.mkdir()
        print(f"{SHARDS} shards, {n} tensors, {total / 1e9:.0f} GB apparent")
        floor = min(timed_parse([primary, mirror]) for _ in range(3))
        print(f"parsing every header of both replicas (a fresh python, cold cache, best of 3): {floor:.2f} s")
        for engine in ("native", "pyfuse3"):  # side by side: the native engine also builds run tables
            t_mount, st, rss = timed_mount(colifs, [primary, mirror], mnt, "--engine", engine)
            t_reload, in_daemon = timed_reload(colifs, mnt)
            t_remove, t_add = timed_mirror(colifs, mnt, mirror)
            t0 = time.monotonic()
            subprocess.run([*colifs, "umount", str(mnt)], check=True)
            t_umount = time.monotonic() - t0
            usable = sum(1 for f in st["files"].values() if len(f["replicas"]) == 2)
            print(
                f"{engine:>7}: mount (until serving) {t_mount:.2f} s = {t_mount / floor:.2f}x parsing   "
                f"reload {t_reload:.2f} s ({in_daemon:.2f} in the daemon)   mirror remove {t_remove:.2f} s, "
                f"add {t_add:.2f} s   umount {t_umount:.2f} s   daemon RSS {rss / 1024:.0f} MiB   "
                f"({usable} shards mirrored)"
            )
        for p in sorted(mirror.glob("*.safetensors"))[::2]:
            p.unlink()  # a partial mirror: every other shard
        history = work / "usage.json"
        size = write_history(history)
        for engine in ("native", "pyfuse3"):
            flags = ("--usage-file", str(history), "--engine", engine)
            t_mount, st, rss = timed_mount(colifs, [primary, mirror], mnt, *flags)
            partial = st["partial_mirror"]
            t_reload, in_daemon = timed_reload(colifs, mnt)
            for p in sorted(primary.glob("*.safetensors")):
                with open(mnt / p.name, "rb") as f:
                    f.read(1 << 20)
            t0 = time.monotonic()
            subprocess.run([*colifs, "umount", str(mnt)], check=True)
            t_umount = time.monotonic() - t0
            print(
                f"{engine:>7}, partial mirror + usage history of {size / 1e6:.1f} MB: "
                f"mount {t_mount:.2f} s = {t_mount / floor:.2f}x parsing   "
                f"reload {t_reload:.2f} s ({in_daemon:.2f} in the daemon)   "
                f"umount (saving the usage) {t_umount:.2f} s   daemon RSS {rss / 1024:.0f} MiB   "
                f"mirror coverage {partial['coverage'][1]:.1%}"
            )
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
