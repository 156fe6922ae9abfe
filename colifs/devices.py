"""Which copies share a drive: reading two copies on one disk adds no bandwidth.

A replica's drive is the set of whole disks under its filesystem, read from sysfs: a partition
counts as its disk, a device-mapper or md device (LVM, dm-crypt, RAID) as the disks it is built
on. A filesystem with no block device of its own (tmpfs, btrfs subvolumes, NFS, FUSE) is known
only by its device number, so two directories on it share a drive and nothing else is known. A
loop device counts as a drive of its own: its image may sit on any disk, and a throttled loop
device is how the benchmarks simulate a drive.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("colifs")

SYS = Path("/sys")


def drive_of(path: str, sys: Path = SYS) -> frozenset[str]:
    """The disks holding `path`'s filesystem (names as in /sys/block), or its device number."""
    dev = os.stat(path).st_dev
    disks = _disks(f"{os.major(dev)}:{os.minor(dev)}", sys, depth=0) if os.major(dev) else frozenset()
    return disks or frozenset({f"dev {os.major(dev)}:{os.minor(dev)}"})


def _disks(majmin: str, sys: Path, depth: int) -> frozenset[str]:
    try:
        node = (sys / "dev" / "block" / majmin).resolve(strict=True)
    except OSError:
        return frozenset()
    if (node / "partition").exists():
        node = node.parent
    slaves = sorted((node / "slaves").iterdir()) if (node / "slaves").is_dir() else []
    if not slaves or depth > 8:
        return frozenset({node.name})
    out: set[str] = set()
    for s in slaves:
        try:
            out |= _disks((s / "dev").read_text().strip(), sys, depth + 1)
        except OSError:
            out.add(s.name)
    return frozenset(out)


def shared(drives: Sequence[frozenset[str]]) -> list[list[int]]:
    """Groups (of two or more replica indices, in order) whose drives overlap, transitively."""
    group = list(range(len(drives)))

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for i in range(len(drives)):
        for j in range(i):
            if drives[i] & drives[j]:
                group[root(i)] = root(j)
    by_root: dict[int, list[int]] = {}
    for i in range(len(drives)):
        by_root.setdefault(root(i), []).append(i)
    return [g for g in by_root.values() if len(g) > 1]


def one_drive(roots: Sequence[str]) -> list[list[int]]:
    """The groups of `shared` copies of these replica roots, each named in one warning."""
    groups = shared([drive_of(r) for r in roots])
    for group in groups:
        log.warning(
            "%s are on one drive: reading them all adds no bandwidth, so they count as one drive",
            ", ".join(roots[i] for i in group),
        )
    return groups


def as_one_drive(weights: Sequence[float], groups: Sequence[Sequence[int]]) -> list[float]:
    """Probed weights with the copies of each group sharing one drive's rate: each of them was
    probed alone, so the drive delivers the best of their figures in all, split evenly among the
    copies (any split of one drive's reads gives the same bandwidth; even keeps every copy
    usable for the files only it holds)."""
    out = list(weights)
    for g in groups:
        rate = max(weights[i] for i in g)
        for i in g:
            out[i] = rate / len(g)
    return out
