"""The read planner: which drive serves each byte of a file. Pure: the pyfuse3 engine plans every
request with it, the native engine gets its run tables from it, and `colifs route` (through the
mount's `Router`) asks it. Counting what was read is the caller's.

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

from colifs.catalogue import ServedFile
from colifs.formats.layout import HEADER, Key
from colifs.health import Health
from colifs.routing import CHUNK, NOT_STRIPED, STRIPE_SLOTS, bounds, fixed, pick, pick_fixed, stripe_sequence

PLAIN = -2  # the extent of a file without a layout: plain bytes, always from the primary

Piece = tuple[int, int, int, int]  # start, stop, drive, extent (an index, HEADER or PLAIN)
Run = tuple[int, int, int]  # start, stop, drive: what one backing read fetches


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
        rotation = f.stripes[extent] if striping else NOT_STRIPED
        if rotation == NOT_STRIPED:
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


def merge(plan: Sequence[Piece]) -> list[Run]:
    """Pieces as (start, stop, drive) runs, neighbours on the same drive merged."""
    runs: list[Run] = []
    for start, stop, drive, _ in plan:
        if runs and runs[-1][2] == drive:
            runs[-1] = (runs[-1][0], stop, drive)
        else:
            runs.append((start, stop, drive))
    return runs


def plan(f: ServedFile, weights: Sequence[float], striping: bool, off: int, end: int) -> list[Run]:
    """[off, end) of `f` as the runs to read, each from one drive."""
    return merge(pieces(f, weights, striping, off, end))


class Router:
    """The drive that serves a byte now: the weights, the routing mode and which mirrors are up
    (their `Health`, shared with the engine that reads)."""

    def __init__(self, weights: Sequence[float], striping: bool, health: Sequence[Health]) -> None:
        self.weights = list(weights)  # per replica, for files the mirrors hold
        self.striping = striping
        self._health = health

    def drive_at(self, f: ServedFile, offset: int) -> int:
        down = {d for d, h in enumerate(self._health) if d and not h.up}
        weights = usable_weights(self.weights, set(f.copies) - down)
        return pieces(f, weights, self.striping, offset, offset + 1)[0][2]


def usable_weights(weights: Sequence[float], usable: set[int] | frozenset[int]) -> list[float]:
    """The weights with 0 for every replica not in `usable` (the primary always is)."""
    return [w if i == 0 or i in usable else 0.0 for i, w in enumerate(weights)]


def run_table(f: ServedFile, striping: bool, key_ids: Mapping[Key, int]) -> tuple[bytes, bytes, bytes, bytes]:
    """The native engine's table of `f`, independent of the weights: segment starts (u64), key ids
    (i32, -1: header or plain bytes, always the primary's), fixed-point positions (u32) and stripe
    rotations (i8, NOT_STRIPED for keys kept whole). The engine picks each piece's drive from the
    routes in force (`route_columns`), so new weights never rebuild a table.

    Segments follow the layout's extents; neighbours with the same key and route are merged.
    """
    starts, keys, where, rotations = array("Q"), array("i"), array("I"), array("b")
    layout = f.layout
    last: tuple[int, int, int] | None = None
    plain = [(0, f.size, PLAIN)] if f.size else []
    for start, _stop, extent in layout.pieces(0, f.size) if layout is not None else plain:
        if extent < 0:
            row = (-1, 0, NOT_STRIPED)
        else:
            rotation = f.stripes[extent] if striping else NOT_STRIPED
            row = (key_ids[layout.keys[extent]], fixed(f.positions[extent]), rotation)  # type: ignore[union-attr]
        if row != last:
            last = row
            starts.append(start)
            keys.append(row[0])
            where.append(row[1])
            rotations.append(row[2])
    return starts.tobytes(), keys.tobytes(), where.tobytes(), rotations.tobytes()


def route_columns(weights: Sequence[float]) -> bytes:
    """What the native engine routes by, for each set of usable mirrors (column c: bit d-1 = mirror
    d usable): the replicas' interval bounds (u64 each, `routing.bounds`) then the stripe sequence
    (STRIPE_SLOTS u8), with 0 weight for the mirrors outside the set. Small (a few KiB at most):
    swapped whole when the weights change."""
    out = bytearray()
    for c in range(1 << (len(weights) - 1)):
        w = usable_weights(weights, {d for d in range(1, len(weights)) if (c >> (d - 1)) & 1})
        out += array("Q", bounds(w)).tobytes()
        out += bytes(_sequence(tuple(w)))
    return bytes(out)


def table_drive(columns: bytes, nrep: int, col: int, key: int, where: int, rotation: int, at: int) -> int:
    """The drive the native engine gives the byte at `at` of a segment (native/drives.c
    `segment_drive`, in Python for the tests)."""
    if key < 0:
        return 0
    width = 8 * nrep + STRIPE_SLOTS
    row = columns[col * width : (col + 1) * width]
    if rotation != NOT_STRIPED:
        return row[8 * nrep + (at // CHUNK + rotation) % STRIPE_SLOTS]
    return pick_fixed(where, array("Q", row[: 8 * nrep]).tolist())
