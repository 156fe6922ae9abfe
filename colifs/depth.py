"""Whether the drives need reads in flight, which is what fills give a page-cache reader (the native
engine's reads ahead, native/fill.c). A drive makes each read wait before its bytes flow (an NVMe
~60-100 us): one 128 KiB request in flight then gets a fraction of it, and fills, many reads at
once from every drive, win 1.5x (docs/benchmarks.md, runs 71). A drive that makes no read wait (a
bandwidth cap, RAM) gives one request all of itself, and there fills only cost: the bytes they read
ahead that the reader never asks for, and the daemon's CPU (0.78x against 0.90x without, run 71).
What decides is the bytes a drive holds in flight at full speed, its wait times its rate: a read
waits ~the same for 4 KiB as for 128, so the wait is timed on 4 KiB reads at mount, and the rate is
the probe's or, with given weights, the one the drive delivered while serving (colifs.balance).
"""

from __future__ import annotations

from collections.abc import Sequence

DEPTH_BYTES = 32 << 10  # in flight at full speed: from here one 128 KiB request gets < 80% of a drive
HYSTERESIS = 2.0  # once on, off only below DEPTH_BYTES / 2; once off, on only from DEPTH_BYTES * 2


def in_flight(wait_s: float | None, rate: float | None) -> float | None:
    """The bytes a drive holds in flight at full speed (its bandwidth-delay product), if known."""
    return None if wait_s is None or not rate else wait_s * rate


def needs_depth(held: Sequence[float | None], on: bool) -> bool:
    """Whether fills are to run, given what each drive holds in flight (`in_flight`; None: not known
    yet) and `on`, whether they run now: while a drive's figure is unknown they stay on; a drive
    holding enough in flight turns them on, all drives holding too little turn them off."""
    if on:
        return None in held or any(h >= DEPTH_BYTES / HYSTERESIS for h in held if h is not None)
    return any(h >= DEPTH_BYTES * HYSTERESIS for h in held if h is not None)
