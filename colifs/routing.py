"""Weighted deterministic routing of keys to replicas. Pure.

Every key gets a fixed position u in [0, 1); `pick(u, weights)` cuts [0, 1) into one interval per
replica, as wide as its weight, and returns the replica whose interval holds u.

- Names: u = a 64-bit BLAKE2b digest of the name / 2**64. Deterministic on every machine and
  Python version (never `hash()`), and uniform, so the share of keys follows the weights.
- Routed experts: within one (stack, layer), experts are ranked by their digest and expert e gets
  u = (rank + 0.5) / n. One decode step touches several experts of one layer; ranking gives each
  layer an exact quota (the split follows the weights as closely as the count allows) instead of
  the clusters an independent hash per expert produces.

Changing the weights moves the interval boundaries only, so only the keys between the old and the
new boundary move (for two replicas that is the minimum possible).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Sequence

from colifs.layout import ExpertKey, Key


def digest(key: Key) -> int:
    """A stable 64-bit digest of a key."""
    if isinstance(key, ExpertKey):
        text = f"expert\0{key.stack}\0{key.layer}\0{key.expert}"
    else:
        text = f"name\0{key}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def positions(keys: Iterable[Key]) -> dict[Key, float]:
    """The position u of every key: per-layer ranks for experts, a digest for names."""
    out: dict[Key, float] = {}
    layers: dict[tuple[str, int], set[int]] = defaultdict(set)
    for key in keys:
        if isinstance(key, ExpertKey):
            layers[key.stack, key.layer].add(key.expert)
        elif key not in out:
            out[key] = digest(key) / 2**64
    for (stack, layer), experts in layers.items():
        ranked = sorted((digest(ExpertKey(stack, layer, e)), e) for e in experts)
        for rank, (_, e) in enumerate(ranked):
            out[ExpertKey(stack, layer, e)] = (rank + 0.5) / len(ranked)
    return out


def pick(u: float, weights: Sequence[float]) -> int:
    """The replica whose interval holds u. A weight of 0 (no valid copy, or down) is never picked.

    At least one weight must be positive (the reader sends a request whose weights are all 0 to
    the primary without asking).
    """
    total = 0.0
    for w in weights:
        total += w
    target = u * total
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if w > 0 and target < acc:
            return i
    return max(i for i, w in enumerate(weights) if w > 0)  # u rounding onto the very top


def parse_weights(text: str, count: int) -> list[float]:
    """`9,3` (or `9:3`, `9 3`) → [9.0, 3.0]; exactly one positive number per replica."""
    parts = [p for p in text.replace(":", ",").replace(" ", ",").split(",") if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"weights {text!r}: not a list of numbers") from None
    if len(values) != count:
        raise ValueError(f"weights {text!r}: {len(values)} given, {count} replicas")
    if not all(v > 0 and v != float("inf") for v in values):
        raise ValueError(f"weights {text!r}: every weight must be a positive finite number")
    return values


# -- striping: one key's bytes spread over the drives ---------------------------------------------

CHUNK = 1 << 20  # stripe unit: FUSE's largest request, so an aligned request is never split
STRIPE_SLOTS = 64  # length of the weighted round-robin sequence (weights resolved to 1/64)


def stripe_sequence(weights: Sequence[float], slots: int = STRIPE_SLOTS) -> tuple[int, ...]:
    """A weighted round-robin order of replicas: any window of consecutive chunks is spread in the
    ratio of the weights (smooth weighted round-robin over integer shares): within one chunk for
    two drives, within 4/3 with three or with ratios 64 slots only approximate (tested).

    Shares are the weights rounded to 1/slots by largest remainder; a replica of weight 0 (no
    valid copy) gets none. At least one weight must be positive.
    """
    total = sum(weights)
    exact = [w / total * slots for w in weights]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (exact[i] - shares[i], -i), reverse=True)
    for i in by_remainder[: slots - sum(shares)]:
        shares[i] += 1
    current = [0] * len(weights)
    out = []
    for _ in range(slots):
        for i, s in enumerate(shares):
            current[i] += s
        best = max(range(len(weights)), key=lambda i: (current[i], -i))
        current[best] -= slots
        out.append(best)
    return tuple(out)


def stripe_rotation(key: Key, slots: int = STRIPE_SLOTS) -> int:
    """Where in the sequence a key's chunks start: keys read at the same time start apart."""
    return digest(key) % slots


# -- a partial mirror: keys it holds get more than the plain weights --------------------------------


def partial_mirror_weights(weights: Sequence[float], coverage: float) -> tuple[list[float], float]:
    """Weights for the files a partial mirror holds, and the mirror's expected share of all bytes.

    `coverage` is the share of the traffic (from usage history) that falls in keys the mirror
    holds. Plain weights give the mirror only coverage x its share; raising its share among the
    keys it holds to share / coverage makes the expected byte split match the weights, capped at
    every held key (the primary then serves none of them). Two replicas only; the primary's
    weight may come out 0 (pick() then never picks it for those files).
    """
    w0, w1 = weights
    share = w1 / (w0 + w1)
    if coverage <= 0:
        return [w0, w1], 0.0
    held = min(1.0, share / coverage)  # the mirror's share among the keys it holds
    if held >= 1.0:
        return [0.0, w1], coverage
    return [w0 * (1 - held), w0 * held], held * coverage
