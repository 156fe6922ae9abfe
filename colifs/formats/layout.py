"""What every model format produces: a Layout (the file's extents and the routing key of each),
the keys (a routed expert, else the tensor's name) and why each tensor got its key. Pure.

A Layout cuts a file's data part into extents, each with the routing key of the tensor (or
fused-expert slice) it holds, so that a read range can be split into pieces that each belong to
exactly one key.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

HEADER = -1  # the extent index of the header bytes: always served by the primary


class ExpertKey(NamedTuple):
    """One routed MoE expert. `stack` keeps MTP layers apart from the main stack."""

    stack: str
    layer: int
    expert: int


Key = ExpertKey | str  # a tensor that is not a routed expert is keyed by its name


class ExpertConfig(NamedTuple):
    """What a model's config says about its routed experts (colifs.formats.moe reads it)."""

    count: int  # routed experts per MoE layer
    layers: frozenset[int] | None = None  # the MoE layers, when the config states them


class LayoutError(ValueError):
    """The header is malformed; the message is the reason, short enough for one warning line."""


# Why a tensor got its key (`colifs route`, stats.json).
BY_NAME = "by name"
EXPERT_NAME = "expert, by its name"
FUSED_CONFIG = "fused experts, cut by the config's count"
FUSED_SHAPE = "fused experts, cut by shape (no config)"
DISAGREED = "fused-expert name, shape disagrees with the config: by name"
DENSE_LAYER = "fused-expert name in a layer the config makes dense: by name"
UNEVEN = "fused-expert name, leading dimensions differ in its layer (no config): by name"


@dataclass(frozen=True, slots=True)
class Layout:
    """Extents of one file: extent i is [starts[i], starts[i+1]) (the last ends at `size`).

    The header [0, data_start) is not an extent: `pieces` gives it the extent index HEADER.
    """

    data_start: int
    size: int
    starts: tuple[int, ...]
    keys: tuple[Key, ...]
    keying: tuple[tuple[str, int], ...] = ()  # (why, tensors) for each way a tensor got its key
    disagreed: tuple[str, ...] = ()  # fused-expert names the config contradicts (shape or layer)

    def extents(self) -> Iterator[tuple[int, int, Key]]:
        """(start, end, key) of every extent, in file order."""
        ends = (*self.starts[1:], self.size) if self.starts else ()
        return zip(self.starts, ends, self.keys, strict=True)

    def pieces(self, off: int, end: int) -> list[tuple[int, int, int]]:
        """Cut [off, end) into (start, end, extent) pieces, in order, each inside one extent.

        The extent is an index into `starts`/`keys`, or HEADER for the header bytes.
        """
        end = min(end, self.size)
        out: list[tuple[int, int, int]] = []
        if off >= end:
            return out
        if off < self.data_start:
            out.append((off, min(end, self.data_start), HEADER))
            off = self.data_start
        i = bisect_right(self.starts, off) - 1
        while off < end:
            stop = self.starts[i + 1] if i + 1 < len(self.starts) else self.size
            piece_end = min(stop, end)
            out.append((off, piece_end, i))
            off = piece_end
            i += 1
        return out
