"""`colifs top MOUNTPOINT`: a live view of a mount, redrawn every second from its stats.json.

Rates are differences between two readings of the counters, so they are what the drives served
in that interval. `render` is pure (two readings in, a frame out); `run` reads, draws, and on a
terminal exits on `q` or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from typing import TextIO

HOTTEST = 5


def _balance(balance: dict) -> str:
    """`, adaptive (measured 912 / 301 MB/s, last change 3 s ago)`"""
    if not balance["adaptive"]:
        return ", fixed"
    rates = " / ".join("?" if r is None else f"{r:g}" for r in balance["measured_mb_per_s"])
    last = balance["last_change"]
    ago = f"last change {time.time() - last['at']:.0f} s ago" if last["at"] else "no change yet"
    return f", adaptive (measured {rates} MB/s, {ago})"


def _cpu(prev: dict, cur: dict, dt: float) -> list[str]:
    """`daemon CPU 0.45 cores now, 1.12 s per GB served now, 1.10 since mount`: what the mount
    takes from the cores the engine computes on (no line from an older daemon: no figures)."""
    if "cpu" not in cur or "cpu" not in prev:
        return []
    spent = cur["cpu"]["seconds"] - prev["cpu"]["seconds"]
    served = sum(c["bytes_served"] for c in cur["replicas"])
    served -= sum(c["bytes_served"] for c in prev["replicas"])
    now = f"{spent / (served / 1e9):.2f}" if served > 0 else "-"
    total = cur["cpu"]["per_gb_served"]
    return [
        f"daemon CPU {spent / dt if dt > 0 else 0:.2f} cores now, {now} s per GB served now, "
        f"{'-' if total is None else f'{total:.2f}'} since mount"
    ]


def render(prev: dict, cur: dict, dt: float) -> str:
    """One frame: per drive MB/s now and on average, byte share vs weight share, health; fallbacks;
    the daemon's CPU; the layers that moved the most bytes in the interval."""
    up = max(cur["uptime_s"], 1e-9)
    lines = [
        f"colifs top {cur['mountpoint']}  up {cur['uptime_s']:.0f} s  routing {cur['routing']}  "
        f"weights {cur['weights_source']}" + _balance(cur["balance"])
    ]
    head = f"{'drive':<9} {'state':<6} {'MB/s now':>9} {'MB/s avg':>9} {'bytes':>7} {'weight':>7}"
    lines.append(f"{head} {'in flight':>9} {'errors':>7} {'timeouts':>8}  path")
    for i, c in enumerate(cur["replicas"]):
        p = prev["replicas"][i] if i < len(prev["replicas"]) else c  # a mirror added meanwhile: 0 now
        now = (c["bytes_served"] - p["bytes_served"]) / dt / 1e6 if dt > 0 else 0.0
        health = c.get("health")
        state = "-" if health is None else health["state"]
        timeouts = "-" if health is None else str(health["timeouts"])
        lines.append(
            f"{c['name']:<9} {state:<6} {now:>9.1f} {c['bytes_served'] / up / 1e6:>9.1f} "
            f"{c['byte_share']:>7.1%} {c['weight_share']:>7.1%} {c['in_flight']:>9} {c['read_errors']:>7} "
            f"{timeouts:>8}  {c['path']}"
        )
        if health is not None and health["state"] == "down":
            wait = f"down {health['down_for_s']} s, next check in {health['next_check_in_s']} s"
            lines.append(f"{'':<9} {wait}: {health['last_error']}")
    fell = cur["fallbacks"] - prev["fallbacks"]
    lines.append(f"fallbacks {cur['fallbacks']} ({fell / dt if dt > 0 else 0:.1f}/s now)")
    lines += _cpu(prev, cur, dt)
    moved = []
    for layer, row in cur["layers_routed_bytes"].items():
        before = prev["layers_routed_bytes"].get(layer, [0] * len(row))
        delta = sum(row) - sum(before)
        if delta > 0:
            moved.append((delta, layer))
    moved.sort(reverse=True)
    hot = (
        ", ".join(f"{layer} {d / dt / 1e6:.1f} MB/s" for d, layer in moved[:HOTTEST])
        or "none in this interval"
    )
    lines.append(f"hottest layers: {hot}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _keys(stream: TextIO) -> Iterator[Callable[[float], str]]:
    """A function waiting up to t seconds for a key on a terminal (cbreak mode, restored after)."""
    if not stream.isatty():
        yield lambda t: (time.sleep(t), "")[1]
        return
    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:

        def wait(t: float) -> str:
            ready, _, _ = select.select([fd], [], [], t)
            return stream.read(1) if ready else ""

        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run(read: Callable[[], dict], interval: float, count: int | None, out: TextIO = sys.stdout) -> None:
    """Draw a frame every `interval` s; `count` frames, or until q / Ctrl-C."""
    clear = "\033[H\033[2J" if out.isatty() else ""
    prev, t_prev = read(), time.monotonic()
    shown = 0
    with _keys(sys.stdin) as wait:
        while count is None or shown < count:
            key = wait(interval)
            if key in ("q", "Q"):
                return
            cur, t = read(), time.monotonic()
            out.write(clear + render(prev, cur, t - t_prev) + ("" if clear else "\n"))
            out.flush()
            prev, t_prev = cur, t
            shown += 1
