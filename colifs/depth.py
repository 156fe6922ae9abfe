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

DEPTH_BYTES = 40 << 10  # in flight at full speed: from here one 128 KiB request gets < 77% of a drive
HYSTERESIS = 2.0  # once decided on, off only below DEPTH_BYTES / 2; once off, on only from DEPTH_BYTES * 2


def in_flight(wait_s: float | None, rate: float | None) -> float | None:
    """The bytes a drive holds in flight at full speed (its bandwidth-delay product), if known."""
    return None if wait_s is None or not rate else wait_s * rate


def needs_depth(held: Sequence[float | None], was: bool | None) -> bool | None:
    """Whether fills are to run, given what each drive holds in flight (`in_flight`; None: not known
    yet) and `was`, the last decision (None: none yet). None: not decided, a drive's figure is not
    known yet (fills run meanwhile). The first decision is on the figures alone: fills that ran
    while a rate was not known do not stay on by the hysteresis meant to keep a decision steady
    (run 71l: a RAM drive holding 17-28 KB kept fills on that cost it 0.57x)."""
    known = [h for h in held if h is not None]
    if any(h >= DEPTH_BYTES * HYSTERESIS for h in known):
        return True
    if len(known) < len(held):
        return None
    if was is None:
        return any(h >= DEPTH_BYTES for h in known)
    if was:
        return any(h >= DEPTH_BYTES / HYSTERESIS for h in known)
    return False
