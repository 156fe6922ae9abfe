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

from colifs.health import Health
from colifs.layout import HEADER, Key
from colifs.replicas import ServedFile
from colifs.routing import CHUNK, pick, stripe_sequence

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


def run_table(
    f: ServedFile, weights: Sequence[float], striping: bool, key_ids: Mapping[Key, int]
) -> tuple[bytes, bytes, bytes]:
    """The native engine's table of `f`: segment starts (u64), key ids (i32, -1: header or plain) and,
    per segment, one drive (u8) for each set of usable mirrors (column c: bit d-1 = mirror d).

    Every column cuts the file where `pieces()` does (extents, and CHUNKs inside striped keys), and
    gives each piece the drive `pieces()` gives it with that column's weights (a property test holds
    them equal); neighbours with the same key and drives are merged. One pass over the extents:
    a big checkpoint has ~100k extents and ~700k chunks.
    """
    columns = [
        usable_weights(weights, {d for d in f.copies if d and (c >> (d - 1)) & 1})
        for c in range(1 << (len(weights) - 1))
    ]
    starts, keys, drives = array("Q"), array("i"), bytearray()
    last: tuple[int, tuple[int, ...]] | None = None

    def emit(start: int, key: int, row: tuple[int, ...]) -> None:
        nonlocal last
        if (key, row) != last:
            last = (key, row)
            starts.append(start)
            keys.append(key)
            drives.extend(row)

    primary = (0,) * len(columns)
    layout = f.layout
    if layout is None:
        if f.size:
            emit(0, -1, primary)
        return starts.tobytes(), keys.tobytes(), bytes(drives)
    by_chunk: list[tuple[int, ...]] = []  # striped drives of each column, per sequence slot
    for start, stop, extent in layout.pieces(0, f.size):
        if extent == HEADER:
            emit(start, -1, primary)
            continue
        key = key_ids[layout.keys[extent]]
        rotation = f.stripes[extent] if striping else -1
        if rotation < 0:
            emit(start, key, tuple(pick(f.positions[extent], w) for w in columns))
            continue
        if not by_chunk:
            by_chunk = list(zip(*(_sequence(tuple(w)) for w in columns), strict=True))
        row = by_chunk[(start // CHUNK + rotation) % len(by_chunk)]
        emit(start, key, row)
        last = (key, _chunks(start, stop, key, rotation, by_chunk, row, starts, keys, drives))
    return starts.tobytes(), keys.tobytes(), bytes(drives)


def _chunks(
    start: int, stop: int, key: int, rotation: int, by_chunk: list[tuple[int, ...]], row: tuple[int, ...],
    starts: array, keys: array, drives: bytearray,
) -> tuple[int, ...]:  # fmt: skip
    """The segments of a striped key after its first chunk (the hot loop: ~700k chunks in a big
    checkpoint); returns the drives of its last segment."""
    slots = len(by_chunk)
    for chunk in range(start // CHUNK + 1, (stop - 1) // CHUNK + 1):
        nxt = by_chunk[(chunk + rotation) % slots]
        if nxt != row:
            row = nxt
            starts.append(chunk * CHUNK)
            keys.append(key)
            drives.extend(row)
    return row
