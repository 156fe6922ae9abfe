"""`colifs bench`: read a model directory the way an MoE engine decodes.

N reader threads each fetch whole routed experts (every tensor of one (stack, layer, expert),
found through the safetensors headers), picked at random, uniformly or with a Zipf skew. Works on
a colifs mount or on plain directories; given several directories (full copies) and weights, each
expert is read from the directory colifs' routing would pick: the two drives read directly, in
parallel, with the ideal split (the physical limit colifs is measured against).
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import random
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from colifs.backing import align_down, align_up
from colifs.formats import format_for
from colifs.formats.layout import ExpertKey, LayoutError
from colifs.formats.moe import Configs
from colifs.routing import pick, positions


@dataclass(frozen=True)
class Expert:
    key: ExpertKey
    ranges: list[tuple[str, int, int]]  # (relpath, start, end)

    @property
    def nbytes(self) -> int:
        return sum(e - s for _, s, e in self.ranges)


def find_experts(root: str) -> list[Expert]:
    """Every routed expert of the model files (safetensors, GGUF) under `root`, with its byte ranges."""
    ranges: dict[ExpertKey, list[tuple[str, int, int]]] = {}
    configs = Configs(root)
    for path in sorted(Path(root).rglob("*")):
        fmt = format_for(str(path)) if path.is_file() else None
        if fmt is None:
            continue
        rel = str(path.relative_to(root))
        try:
            _, _, lay = fmt.read(str(path), configs.experts_for(rel))
        except (OSError, LayoutError):
            continue
        for start, end, key in lay.extents():
            if isinstance(key, ExpertKey):
                ranges.setdefault(key, []).append((rel, start, end))
    return [Expert(key, spans) for key, spans in ranges.items()]


def drop_caches(roots: Sequence[str]) -> None:
    """Cold cache: evict every file under the roots (and the whole page cache when root)."""
    for root in roots:
        for path in Path(root).rglob("*"):
            if path.is_file() and not path.is_symlink():
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    if os.geteuid() == 0:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


class _Chooser:
    """Experts at random, shared by the reader threads.

    Uniform: a shuffled order without replacement (reshuffled when used up), so no expert is read
    twice before all were read once and a model that fits in RAM still reads cold. Zipf(a): with
    replacement over a fixed shuffled order, so the hot experts may come from cache, as in use.
    """

    def __init__(self, n: int, zipf: float, seed: int) -> None:
        self.n = n
        self.rng = random.Random(seed)
        self.order = list(range(n))
        self.rng.shuffle(self.order)
        self.next = 0
        self.passes = 0  # times the uniform order was used up
        self.lock = threading.Lock()
        self.cum: list[float] = []
        if zipf > 0:
            acc = 0.0
            for k in range(n):
                acc += 1.0 / (k + 1) ** zipf
                self.cum.append(acc)

    def __call__(self, rng: random.Random) -> int:
        if self.cum:
            return self.order[bisect.bisect_left(self.cum, rng.random() * self.cum[-1])]
        with self.lock:
            if self.next == self.n:
                self.rng.shuffle(self.order)
                self.next = 0
                self.passes += 1
            self.next += 1
            return self.order[self.next - 1]


class _Reader:
    """One reader thread's open files and buffer, in one access mode."""

    def __init__(self, mode: str, max_range: int) -> None:
        self.mode = mode
        self.fds: dict[str, int] = {}
        self.maps: dict[str, tuple[mmap.mmap, ctypes.c_char]] = {}
        self.buf = mmap.mmap(-1, align_up(max_range) + 8192)
        self.buf_at = ctypes.c_char.from_buffer(self.buf)

    def read(self, root: str, rel: str, start: int, end: int) -> int:
        path = os.path.join(root, rel)
        if self.mode == "mmap":
            if path not in self.maps:
                with open(path, "rb") as f:
                    # Private and writable only so that ctypes can take its address; nothing is
                    # written, so its pages are the page cache's, faulted in like any mapping.
                    mm = mmap.mmap(
                        f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
                    )
                self.maps[path] = (mm, ctypes.c_char.from_buffer(mm))
            at = ctypes.addressof(self.maps[path][1])
            # ctypes.memmove releases the GIL, so the readers fault in parallel like an engine's
            # native threads (a Python slice copy would hold the GIL through every page fault).
            ctypes.memmove(ctypes.addressof(self.buf_at), at + start, end - start)
            return end - start
        fd = self.fds.get(path)
        if fd is None:
            flags = os.O_RDONLY | (os.O_DIRECT if self.mode == "odirect" else 0)
            fd = self.fds[path] = os.open(path, flags)
        if self.mode == "odirect":
            a, b = align_down(start), align_up(end)
            n = os.preadv(fd, [memoryview(self.buf)[: b - a]], a)
            return min(n, end - a) - (start - a)
        return os.preadv(fd, [memoryview(self.buf)[: end - start]], start)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.maps.clear()  # each map is unmapped once its ctypes anchor (the export) is gone


def _sample_inflight(devices: Sequence[str], stop: threading.Event, out: dict[str, list[int]]) -> None:
    """Reads in flight per block device, every 20 ms (/sys/block/DEV/inflight)."""
    while not stop.wait(0.02):
        for dev in devices:
            try:
                with open(f"/sys/block/{dev}/inflight") as f:
                    out[dev].append(int(f.read().split()[0]))
            except (OSError, ValueError, IndexError):
                pass


class _Figures:
    """What the readers measured, over exactly [start, deadline]: a read that straddles the deadline
    counts for the part of its time before it. Readers finish the expert they are on, uncounted:
    with big experts that tail is seconds long, on the slowest drive, and would bias every rate down."""

    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.wall = time.time()  # the same moment, for lining the window up with other processes
        self.deadline = self.start + seconds
        self.bytes = 0.0
        self.experts = 0.0
        self.latencies: list[float] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    def _share(self, t0: float, t1: float) -> float:
        return 1.0 if t1 <= self.deadline else max(0.0, self.deadline - t0) / (t1 - t0)

    def read(self, nbytes: int, t0: float, t1: float) -> None:
        with self._lock:
            self.bytes += nbytes * self._share(t0, t1)

    def expert(self, t0: float, t1: float) -> None:
        with self._lock:
            self.latencies.append(t1 - t0)
            self.experts += self._share(t0, t1)

    def failed(self, error: BaseException) -> None:
        self.errors.append(error)

    def percentile_ms(self, p: float) -> float:
        lat = sorted(self.latencies)
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else 0.0


def _reader(
    figures: _Figures, experts: Sequence[Expert], route: Sequence[int], roots: Sequence[str],
    choose: _Chooser, mode: str, max_range: int, seed: int,
) -> None:  # fmt: skip
    """One reader thread: whole experts, one after the other, until the deadline."""
    rng = random.Random(seed)
    reader = _Reader(mode, max_range)
    try:
        while time.monotonic() < figures.deadline:
            i = choose(rng)
            t_expert = t1 = time.monotonic()
            for rel, s, e in experts[i].ranges:
                t0 = time.monotonic()
                n = reader.read(roots[route[i]], rel, s, e)
                t1 = time.monotonic()
                figures.read(n, t0, t1)
            figures.expert(t_expert, t1)
    except BaseException as e:
        figures.failed(e)
    finally:
        reader.close()


def _wait(pool: Sequence[threading.Thread], figures: _Figures, stop: threading.Event, progress: bool) -> None:
    """Until every reader is done; the in-flight sampler stops at the deadline."""
    while any(t.is_alive() for t in pool):
        time.sleep(0.25)
        now = time.monotonic()
        if now >= figures.deadline:
            stop.set()  # in-flight samples cover the measured span only
        if progress:
            el = min(now, figures.deadline) - figures.start
            gb = figures.bytes / 1e9
            print(f"\r  {el:5.1f}s  {gb:7.2f} GB  {gb / el:6.3f} GB/s", end="", file=sys.stderr)
    stop.set()
    if progress:
        print(file=sys.stderr)


def _routes(experts: Sequence[Expert], replicas: int, weights: Sequence[float] | None) -> list[int]:
    """The directory each expert is read from: colifs' routing of its key over full copies."""
    if replicas == 1:
        return [0] * len(experts)
    where = positions(e.key for e in experts)
    return [pick(where[e.key], weights or [1.0] * replicas) for e in experts]


def run(
    roots: Sequence[str],
    weights: Sequence[float] | None = None,
    threads: int = 4,
    seconds: float = 10.0,
    zipf: float = 0.0,
    mode: str = "odirect",
    cold: bool = True,
    devices: Sequence[str] = (),
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Run the workload and return its figures (see `report`)."""
    experts = find_experts(roots[0])
    if not experts:
        raise ValueError(f"{roots[0]}: no routed MoE expert tensors found in its model files")
    route = _routes(experts, len(roots), weights)
    if cold:
        drop_caches(roots)
    choose = _Chooser(len(experts), zipf, seed)
    max_range = max(e - s for x in experts for _, s, e in x.ranges)
    samples: dict[str, list[int]] = {d: [] for d in devices}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_inflight, args=(devices, stop, samples), daemon=True)
    sampler.start()
    figures = _Figures(seconds)
    pool = [
        threading.Thread(
            target=_reader, args=(figures, experts, route, roots, choose, mode, max_range, seed * 1000 + k),
            daemon=True,
        )
        for k in range(threads)
    ]  # fmt: skip
    for t in pool:
        t.start()
    _wait(pool, figures, stop, progress)
    sampler.join()
    if figures.errors:
        raise figures.errors[0]
    return {
        "roots": list(roots),
        "mode": mode,
        "threads": threads,
        "zipf": zipf,
        "seconds": seconds,
        "started": figures.wall,
        "experts_total": len(experts),
        "expert_mb": sum(x.nbytes for x in experts) / len(experts) / 1e6,
        "bytes": round(figures.bytes),
        "experts": figures.experts,
        "gb_per_s": figures.bytes / seconds / 1e9,
        "experts_per_s": figures.experts / seconds,
        "latency_ms": {f"p{round(100 * p)}": figures.percentile_ms(p) for p in (0.5, 0.9, 0.99)},
        "inflight": {d: (sum(v) / len(v) if v else None) for d, v in samples.items()},
        "passes": choose.passes,
    }


def report(r: dict) -> str:
    lat = r["latency_ms"]
    lines = [
        f"{', '.join(r['roots'])}: {r['mode']}, {r['threads']} threads, zipf {r['zipf']:g}, "
        f"{r['experts_total']} experts of {r['expert_mb']:.2f} MB",
        f"  {r['gb_per_s']:.3f} GB/s  {r['experts_per_s']:.1f} experts/s  latency ms p50 {lat['p50']:.1f} "
        f"p90 {lat['p90']:.1f} p99 {lat['p99']:.1f}  ({r['bytes'] / 1e9:.2f} GB in {r['seconds']:.1f} s)",
    ]
    if r["passes"]:
        lines.append(f"  every expert was read {r['passes']} time(s) over: later reads may come from cache")
    if r["inflight"]:
        lines.append(
            "  reads in flight: "
            + ", ".join(f"{d} {v:.2f}" for d, v in r["inflight"].items() if v is not None)
        )
    return "\n".join(lines)
