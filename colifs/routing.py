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
from collections.abc import Iterable, Mapping, Sequence

from colifs.formats.layout import ExpertKey, Key


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def digest(key: Key) -> int:
    """A stable 64-bit digest of a key."""
    if isinstance(key, ExpertKey):
        return _digest(f"expert\0{key.stack}\0{key.layer}\0{key.expert}")
    return _digest(f"name\0{key}")


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


SCALE = 1 << 32  # positions and interval bounds in fixed point: Python and the native engine agree


def fixed(u: float) -> int:
    """A position u in [0, 1) as a 32-bit integer (what the native engine's tables hold)."""
    return min(int(u * SCALE), SCALE - 1)


def bounds(weights: Sequence[float]) -> list[int]:
    """The upper end of each replica's interval of [0, SCALE): replica i serves positions p with
    bounds[i-1] <= p < bounds[i]. A weight of 0 gives an empty interval; from the last positive
    weight on, every bound is SCALE (rounding never leaves a position without a replica)."""
    total = sum(weights)
    last = max(i for i, w in enumerate(weights) if w > 0)
    out, acc = [], 0.0
    for i, w in enumerate(weights):
        acc += w
        out.append(SCALE if i >= last else min(SCALE, int(acc / total * SCALE)))
    return out


def pick_fixed(p: int, bounds: Sequence[int]) -> int:
    """The replica whose interval holds the fixed-point position p (as native/drives.c picks)."""
    for i, b in enumerate(bounds):
        if p < b:
            return i
    return 0  # unreachable: the last bound is SCALE


def pick(u: float, weights: Sequence[float]) -> int:
    """The replica whose interval holds u. A weight of 0 (no valid copy, or down) is never picked.

    At least one weight must be positive (the reader sends a request whose weights are all 0 to
    the primary without asking).
    """
    return pick_fixed(fixed(u), bounds(weights))


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
NOT_STRIPED = -1  # the stripe rotation of a key kept whole on one drive (native/engine.h: the same)


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


def stripe_rotation(relpath: str, slots: int = STRIPE_SLOTS) -> int:
    """Where in the sequence a file's chunks start. One rotation for the whole file, so the striped
    bytes of any stretch of it split in the weights' ratio to within a chunk (a fused tensor's
    experts straddle chunks: a rotation per key made each straddling chunk a coin toss, and a
    sweep's windows uneven). Per file, so shards laid out alike do not stripe alike."""
    return _digest(f"file\0{relpath}") % slots


# -- partial mirrors: keys they hold get more than the plain weights --------------------------------


def expected_shares(weights: Sequence[float], traffic: Mapping[tuple[int, ...], float]) -> list[float]:
    """Each drive's expected share of the bytes when every file is split by `weights` restricted
    to the replicas holding it; `traffic` is the traffic per set of replicas."""
    total = sum(traffic.values())
    got = [0.0] * len(weights)
    for held, t in traffic.items():
        w = sum(weights[i] for i in held)
        for i in held:
            got[i] += t * weights[i] / w
    return [g / total for g in got] if total else got


def balanced_weights(
    weights: Sequence[float], traffic: Mapping[tuple[int, ...], float], rounds: int = 500
) -> list[float]:
    """One weight per replica such that, with each file split among the replicas holding it, the
    expected bytes per drive come as close to `weights`' shares as the copies allow.

    Plain weights give a mirror holding a share c of the traffic only c x its weight share; here
    its weight rises until its bytes reach its share, or until it serves every key it holds (a
    cap: then the primary's weight on those files tends to 0). Iterative proportional fitting:
    each round scales every weight by target / expected; deterministic for given inputs. With
    full copies the weights come back unchanged.
    """
    target = [w / sum(weights) for w in weights]
    v = list(target)
    for _ in range(rounds):
        got = expected_shares(v, traffic)
        if max(abs(g - t) for g, t in zip(got, target, strict=True)) < 1e-6:
            break
        v = [x * (t / g) if g > 0 else x for x, t, g in zip(v, target, got, strict=True)]
        norm = sum(v)
        v = [max(x / norm, 1e-12) for x in v]  # kept positive: a drive never vanishes entirely
    return v
