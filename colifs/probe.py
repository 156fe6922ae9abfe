"""Startup bandwidth probe: how fast each replica reads with the engine's access pattern.

Per replica, one after the other: `parallel` threads read ~19 MB pieces (an expert's size in big
MoE models) at spread offsets of the largest model files that replica holds, with O_DIRECT (the
page cache would fake the result), for at most `seconds`. The weights are the MB/s figures, but
copies on one drive (colifs.devices) share that drive's figure: probed one at a time, each of them
measured the whole drive.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from colifs.backing import BLOCK, align_down
from colifs.catalogue import ServedFile
from colifs.devices import as_one_drive
from colifs.replicas import Replica

log = logging.getLogger("colifs")

PIECE = 19 << 20
SUB = 4 << 20  # a piece is read in sub-reads so that a slow drive still stops near the deadline
GOLDEN = 0.6180339887498949  # spreads successive offsets evenly over a file without a seed
PROBE_TARGETS = 256  # the places a probe reads from (it reads what it can of them in its time)


@dataclass
class ProbeResult:
    replica: Replica
    mb_per_s: float | None  # None: it holds no model file to read
    nbytes: int
    seconds: float
    direct: bool
    one_drive_with: tuple[int, ...] = ()  # the replicas (indices) on this one's drive, itself included

    def shown(self) -> dict:
        """As stats.json shows it."""
        return {
            "path": self.replica.root,
            "mb_per_s": self.mb_per_s,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "direct": self.direct,
        }


def _places(
    replica: Replica, files: Sequence[ServedFile], count: int, fraction: Callable[[int], float], room: int
) -> list[tuple[str, int]]:
    """(path, offset) pairs over the data of the replica's largest model files, taken in turn: the
    j-th of a file at `fraction(j)` of its data, with `room` bytes of it left after the offset."""
    held = sorted(
        (f for f in files if f.layout is not None and replica.index in f.copies),
        key=lambda f: f.size,
        reverse=True,
    )[:8]
    out = []
    for k in range(count if held else 0):
        f = held[k % len(held)]
        assert f.layout is not None
        span = max(0, f.size - f.layout.data_start - room)
        off = align_down(f.layout.data_start + int(fraction(k // len(held)) * span))
        out.append((os.path.join(replica.root, f.relpath), off))
    return out


def _targets(replica: Replica, files: Sequence[ServedFile], count: int) -> list[tuple[str, int]]:
    """Where the probe reads its pieces: spread evenly over the files' data, without a seed."""
    return _places(replica, files, count, lambda j: j * GOLDEN % 1.0, PIECE)


def _open(path: str) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC), True
    except OSError:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # at least start cold
        return fd, False


def probe_replica(
    replica: Replica, files: Sequence[ServedFile], seconds: float = 2.0, parallel: int = 4
) -> ProbeResult:
    """Read for about `seconds` (a little more to let the last reads land) and time it."""
    targets = _targets(replica, files, PROBE_TARGETS)
    if not targets:
        return ProbeResult(replica, None, 0, 0.0, True)
    lock = threading.Lock()
    queue = iter(targets)
    done = [0]
    direct = [True]
    deadline = time.monotonic() + seconds

    last = [0.0]

    def work() -> None:
        buf = mmap.mmap(-1, SUB)
        fds: dict[str, int] = {}
        try:
            while time.monotonic() < deadline:
                with lock:
                    item = next(queue, None)
                if item is None:
                    return
                path, off = item
                if path not in fds:
                    fds[path], ok = _open(path)
                    direct[0] &= ok
                for sub in range(off, off + PIECE, SUB):
                    if time.monotonic() >= deadline:
                        return
                    n = os.preadv(fds[path], [buf], sub)
                    with lock:
                        done[0] += n
                        last[0] = time.monotonic()
                    if n < SUB:
                        break
        finally:
            for fd in fds.values():
                os.close(fd)

    t0 = time.monotonic()
    threads = [threading.Thread(target=work, daemon=True) for _ in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = max(last[0] - t0, 1e-9)
    return ProbeResult(replica, done[0] / elapsed / 1e6, done[0], elapsed, direct[0])


def _spread(k: int) -> float:
    """The k-th of a sequence that fills [0, 1) evenly, halving its gaps (van der Corput): unlike
    the probe's own sequence it does not come back next to the places the probe read."""
    x, d = 0.0, 0.5
    while k:
        x += d * (k & 1)
        k >>= 1
        d /= 2
    return x


def wait_targets(replica: Replica, files: Sequence[ServedFile], reads: int) -> list[tuple[str, int]]:
    """Where read_wait reads: outside every piece the probe reads, where the files leave room (a
    cache under the drive, a VM host's or the drive's own, could answer a block just read at
    once); the rest at the probe's places (a model of a few GB, which its pieces cover: the
    median still holds against a few such reads)."""
    probed = _targets(replica, files, PROBE_TARGETS)
    starts: dict[str, list[int]] = {}
    for path, off in probed:
        starts.setdefault(path, []).append(off)
    candidates = _places(replica, files, 64 * reads, lambda j: _spread(j + 1), BLOCK)
    out = [(path, off) for path, off in candidates if not any(a <= off < a + PIECE for a in starts[path])][
        :reads
    ]
    return out + probed[: reads - len(out)]


def read_wait(replica: Replica, files: Sequence[ServedFile], reads: int = 16) -> float | None:
    """How long a 4 KiB read of the replica's drive waits (the median of `reads`, O_DIRECT, spread
    over its largest model files, where the probe did not just read): what its bytes wait before
    they flow (colifs.depth). None: it holds no model file, or its filesystem refuses O_DIRECT
    (RAM: nothing to wait for)."""
    buf = mmap.mmap(-1, BLOCK)
    times: list[float] = []
    fds: dict[str, int] = {}
    try:
        for path, off in wait_targets(replica, files, reads):
            if path not in fds:
                fds[path], direct = _open(path)
                if not direct:
                    return None
            t = time.perf_counter()
            os.preadv(fds[path], [buf], off)
            times.append(time.perf_counter() - t)
    finally:
        for fd in fds.values():
            os.close(fd)
        buf.close()
    return sorted(times)[len(times) // 2] if times else None


def probe(
    replicas: Sequence[Replica],
    files: Sequence[ServedFile],
    seconds: float,
    groups: Sequence[Sequence[int]],
) -> list[ProbeResult]:
    """Probe every replica in turn (one at a time: they may share a controller or a bus); `groups`:
    the copies that share a drive (colifs.devices.one_drive)."""
    results = []
    for r in replicas:
        res = probe_replica(r, files, seconds)
        if not res.direct:
            log.warning(
                "probe of %s: its filesystem refuses O_DIRECT, so the page cache may inflate the result",
                r.root,
            )
        results.append(res)
    for group in groups:
        for i in group:
            results[i] = replace(results[i], one_drive_with=tuple(group))
    return results


def weights_from(results: Sequence[ProbeResult]) -> list[float]:
    """MB/s per replica, to 3 significant digits; a replica with nothing to read gets the primary's."""
    primary = results[0].mb_per_s or 1.0
    rates = [r.mb_per_s or primary for r in results]
    groups = {r.one_drive_with for r in results if r.one_drive_with}
    return [float(f"{w:.3g}") for w in as_one_drive(rates, sorted(groups))]


def table(results: Sequence[ProbeResult]) -> str:
    rows = [f"{'replica':<8} {'path':<40} {'MB/s':>9} {'read':>9} {'O_DIRECT':>8}"]
    for r in results:
        rate = "-" if r.mb_per_s is None else f"{r.mb_per_s:.1f}"
        direct = "yes" if r.direct else "NO"
        others = [i for i in r.one_drive_with if results[i] is not r]
        shared_with = ", ".join("the primary" if i == 0 else f"mirror {i}" for i in others)
        rows.append(
            f"{r.replica.role:<8} {r.replica.root:<40} {rate:>9} {r.nbytes / 1e6:>7.0f}MB {direct:>8}"
            + (f"  one drive with {shared_with}" if shared_with else "")
        )
    w = weights_from(results)
    rows.append("suggested: --weights " + ",".join(f"{x:g}" for x in w))
    return "\n".join(rows)
