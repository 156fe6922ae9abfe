"""The read planner: which drive serves each byte of a file. Pure: the pyfuse3 engine plans every
request with it, the native engine gets its run tables from it, and `colifs route` asks it.

A request [off, end) is cut into pieces, each inside one layout extent and (for striped keys) one
CHUNK; each piece gets a drive. Expert routing: a key's bytes all go to `pick(position, weights)`.
Stripe routing: a key of two chunks or more is cut at absolute CHUNK boundaries, chunk c going to
seq[(c + rotation) % len(seq)]. Weights are per replica, 0 for a replica that must not serve the
file (no valid copy, down, dropped).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from functools import lru_cache

from colifs.layout import HEADER, Key
from colifs.replicas import ServedFile
from colifs.routing import CHUNK, pick, stripe_sequence

PLAIN = -2  # the extent of a file without a layout: plain bytes, always from the primary

Piece = tuple[int, int, int, int]  # start, stop, drive, extent (an index, HEADER or PLAIN)


@lru_cache(maxsize=256)
def _sequence(weights: tuple[float, ...]) -> tuple[int, ...]:
    return stripe_sequence(weights)


def pieces(f: ServedFile, weights: Sequence[float], striping: bool, off: int, end: int) -> list[Piece]:
    """[off, end) of `f` as (start, stop, drive, extent) pieces, in order."""
    layout = f.layout
    end = min(end, f.size)
    if layout is None:
        return [(off, end, 0, PLAIN)] if off < end else []
    out: list[Piece] = []
    seq: tuple[int, ...] | None = None
    for start, stop, extent in layout.pieces(off, end):
        if extent == HEADER:
            out.append((start, stop, 0, HEADER))
            continue
        rotation = f.stripes[extent] if striping else -1
        if rotation < 0:
            out.append((start, stop, pick(f.positions[extent], weights), extent))
            continue
        if seq is None:
            seq = _sequence(tuple(weights))
        while start < stop:
            chunk = start // CHUNK
            piece_end = min(stop, (chunk + 1) * CHUNK)
            out.append((start, piece_end, seq[(chunk + rotation) % len(seq)], extent))
            start = piece_end
    return out


def merge(plan: Sequence[Piece]) -> list[tuple[int, int, int]]:
    """Pieces as (start, stop, drive) runs, neighbours on the same drive merged."""
    runs: list[tuple[int, int, int]] = []
    for start, stop, drive, _ in plan:
        if runs and runs[-1][2] == drive:
            runs[-1] = (runs[-1][0], stop, drive)
        else:
            runs.append((start, stop, drive))
    return runs


def usable_weights(weights: Sequence[float], usable: set[int] | frozenset[int]) -> list[float]:
    """The weights with 0 for every replica not in `usable` (the primary always is)."""
    return [w if i == 0 or i in usable else 0.0 for i, w in enumerate(weights)]


def run_table(
    f: ServedFile, weights: Sequence[float], striping: bool, key_ids: Mapping[Key, int]
) -> tuple[bytes, bytes, bytes]:
    """The native engine's table of `f`: segment starts (u64), key ids (i32, -1: header or plain) and,
    per segment, one drive (u8) for each set of usable mirrors (column c: bit d-1 = mirror d).

    Every column cuts the file at the same places (extents, and CHUNKs inside striped keys), so a
    segment is a piece of every column; neighbours with the same key and drives are merged.
    """
    n = len(weights)
    columns = []
    for c in range(1 << (n - 1)):
        usable = {d for d in f.replicas if d and (c >> (d - 1)) & 1}
        columns.append(pieces(f, usable_weights(weights, usable), striping, 0, f.size))
    starts, keys, drives = array("Q"), array("i"), bytearray()
    last: tuple[int, tuple[int, ...]] | None = None
    for row in zip(*columns, strict=True):
        start, _, _, extent = row[0]
        key = -1 if extent < 0 else key_ids[f.layout.keys[extent]]  # type: ignore[union-attr]
        here = (key, tuple(p[2] for p in row))
        if here == last:
            continue
        last = here
        starts.append(start)
        keys.append(key)
        drives.extend(here[1])
    return starts.tobytes(), keys.tobytes(), bytes(drives)
