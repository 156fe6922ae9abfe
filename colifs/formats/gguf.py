"""GGUF header → tensor extents → routing keys. Pure: bytes in, a Layout out.

A GGUF file is: magic `GGUF`, version, tensor count, KV count, the KV metadata, the tensor infos
(name, dims, ggml type, offset relative to the data section), then the data section, which starts
at the next multiple of `general.alignment` (default 32). Only the header is parsed, never data.

MoE experts in GGUF are fused: `blk.L.ffn_{gate,up,down,gate_up}_exps.*` (and `_chexps`) hold
every expert of layer L with the expert as the slowest-varying dimension (the last `ne`), so
expert e is the e-th of n_expert equal slices, keyed (stack "blk", layer L, expert e).

Our own parser, not the `gguf` package's GGUFReader: that one memory-maps the whole file and
builds numpy arrays for every field, vocabulary included; this one reads the header bytes only
(see docs/benchmarks.md for the timing).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable

from colifs.formats.layout import (
    BY_NAME,
    DISAGREED,
    FUSED_CONFIG,
    FUSED_SHAPE,
    ExpertKey,
    Key,
    Layout,
    LayoutError,
)
from colifs.formats.safetensors import MAX_HEADER

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ARRAY_DEPTH = 4  # arrays of arrays: llama.cpp writes none deeper than 2

# ggml type id → (elements per block, bytes per block), as in gguf.constants.GGML_QUANT_SIZES.
GGML_TYPES: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
    15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18),
    21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8),
    28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17),
    40: (64, 36), 41: (128, 18),
}  # fmt: skip

# KV value type → fixed size in bytes (8 STRING and 9 ARRAY are variable).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")

_FUSED = re.compile(r"^(?P<stack>blk)\.(?P<layer>\d+)\.ffn_(?:gate|up|down|gate_up)_(?:ch)?exps\.")


class Truncated(Exception):
    """The buffer ends inside the header: read more of the file and parse again."""


class _Cursor:
    def __init__(self, buf: bytes, file_size: int) -> None:
        self.buf = buf
        self.pos = 0
        self.file_size = file_size

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            if self.pos + n > self.file_size:
                raise LayoutError(f"header runs past the end of the {self.file_size}-byte file")
            raise Truncated
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def count(self, what: str, each: int) -> int:
        """A u64 count of items of at least `each` bytes, refused when it cannot fit the file."""
        n = self.u64()
        if self.pos + n * each > self.file_size:
            raise LayoutError(f"{what} count {n} does not fit in the {self.file_size}-byte file")
        return n

    def string(self) -> bytes:
        return self.take(self.count("string byte", 1))

    def skip_strings(self, n: int) -> None:
        """Skip n length-prefixed strings (a vocabulary: 100k+ of them) without copying any."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = _U64.unpack_from
        for _ in range(n):
            if pos + 8 > end:  # the next length prefix is not in the buffer
                need = pos + 8
                break
            pos += 8 + unpack(buf, pos)[0]
        else:
            if pos <= end:
                self.pos = pos
                return
            need = pos  # the last string runs past the buffer
        if need > self.file_size:
            raise LayoutError(f"header runs past the end of the {self.file_size}-byte file")
        raise Truncated

    def skip_value(self, vtype: int, depth: int = 0) -> None:
        if vtype in _FIXED:
            self.take(_FIXED[vtype])
        elif vtype == _STRING:
            self.string()
        elif vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise LayoutError(f"metadata arrays nested deeper than {MAX_ARRAY_DEPTH}")
            itype = self.u32()
            n = self.count("array", _FIXED.get(itype, 8))
            if itype in _FIXED:
                self.take(n * _FIXED[itype])
            elif itype == _STRING:
                self.skip_strings(n)
            else:
                for _ in range(n):
                    self.skip_value(itype, depth + 1)
        else:
            raise LayoutError(f"unknown metadata value type {vtype}")


def parse_gguf(header: bytes, file_size: int) -> Layout:
    """Build the Layout from the start of a GGUF file (raises Truncated if `header` is too short)."""
    infos, data_start, experts = _infos(header, file_size)
    return _layout(infos, data_start, file_size, experts)


def gguf_tensor_spans(header: bytes, file_size: int) -> list[tuple[int, int, str]]:
    """(start, end, name) of every tensor, in file offsets: what `colifs route` names."""
    infos, data_start, _ = _infos(header, file_size)
    return sorted((data_start + off, data_start + off + n, name) for off, n, name, _ in infos if n)


def _infos(header: bytes, file_size: int) -> tuple[list[tuple[int, int, str, list[int]]], int, int | None]:
    """The tensor infos (data offset, bytes, name, dims), the aligned data start, and the
    routed-expert count the metadata states (None: it states none)."""
    c = _Cursor(header, file_size)
    if file_size < 4 or c.take(4) != MAGIC:
        raise LayoutError("not a GGUF file (bad magic)")
    version = c.u32()
    if version not in (2, 3):
        raise LayoutError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = c.count("tensor", 8 + 4 + 8 + 4 + 8)
    n_kv = c.count("metadata", 8 + 4 + 1)
    alignment, experts = _metadata(c, n_kv)
    infos = [_tensor_info(c, alignment) for _ in range(n_tensors)]
    data_start = -(-c.pos // alignment) * alignment
    if data_start > MAX_HEADER:
        raise LayoutError(f"header of {data_start} bytes is over the {MAX_HEADER}-byte limit")
    return infos, data_start, experts


def _metadata(c: _Cursor, n_kv: int) -> tuple[int, int | None]:
    """The data alignment and the routed-expert count (`<arch>.expert_count`) the metadata states."""
    alignment = DEFAULT_ALIGNMENT
    experts = None
    for _ in range(n_kv):
        key = c.string()
        vtype = c.u32()
        if key == b"general.alignment" and vtype == _UINT32:
            alignment = c.u32()
            if alignment == 0 or alignment & (alignment - 1):
                raise LayoutError(f"general.alignment {alignment} is not a power of two")
        elif key.endswith(b".expert_count") and key.count(b".") == 1 and vtype == _UINT32:
            experts = c.u32() or None
        else:
            c.skip_value(vtype)
    return alignment, experts


def _tensor_info(c: _Cursor, alignment: int) -> tuple[int, int, str, list[int]]:
    """One tensor info: (data offset, bytes, name, dims), checked."""
    name = c.string().decode("utf-8", "replace")
    n_dims = c.u32()
    if not 1 <= n_dims <= MAX_DIMS:
        raise LayoutError(f"tensor {name!r}: {n_dims} dimensions")
    dims = [c.u64() for _ in range(n_dims)]
    ttype, offset = c.u32(), c.u64()
    if ttype not in GGML_TYPES:
        raise LayoutError(f"tensor {name!r}: unknown ggml type {ttype}")
    block, block_bytes = GGML_TYPES[ttype]
    count = 1
    for d in dims:
        count *= d
    if dims[0] % block:
        raise LayoutError(f"tensor {name!r}: first dimension {dims[0]} is not a multiple of {block}")
    if offset % alignment:
        raise LayoutError(f"tensor {name!r}: offset {offset} is not aligned to {alignment}")
    return offset, count // block * block_bytes, name, dims


def _slices(name: str, dims: list[int], nbytes: int, experts: int | None) -> tuple[str, int]:
    """(why the tensor is keyed the way it is, how many expert slices it is cut into: 0 = whole)."""
    m = _FUSED.match(name)
    n_exp = dims[-1] if m and len(dims) >= 2 else 0
    if n_exp and experts is not None and n_exp != experts:
        return DISAGREED, 0
    if n_exp >= 2 and nbytes % n_exp == 0:
        return (FUSED_CONFIG if experts is not None else FUSED_SHAPE), n_exp
    return BY_NAME, 0


def _layout(
    infos: list[tuple[int, int, str, list[int]]], data_start: int, file_size: int, experts: int | None
) -> Layout:
    """Extents in offset order; the padding after a tensor belongs to it (and to its last slice).
    A fused `blk.L.ffn_*_exps` tensor ([..., E] in ggml's order) is cut into E slices when E agrees
    with the metadata's expert count (or, without one, is at least 2)."""
    infos.sort()
    starts: list[int] = []
    keys: list[Key] = []
    why: dict[str, int] = {}
    disagreed: list[str] = []
    pos = 0
    for offset, nbytes, name, dims in infos:
        if offset < pos:
            raise LayoutError(f"tensor {name!r} at data offset {offset} overlaps the previous one")
        if data_start + offset + nbytes > file_size:
            raise LayoutError(f"tensor {name!r} ends past the end of the file ({file_size} bytes)")
        if nbytes == 0:
            continue
        first = data_start + offset if starts else data_start  # leading padding: first tensor's
        reason, n_exp = _slices(name, dims, nbytes, experts)
        if reason == DISAGREED:
            disagreed.append(name)
        if n_exp:
            m = _FUSED.match(name)
            step = nbytes // n_exp
            for e in range(n_exp):
                starts.append(first if e == 0 else data_start + offset + e * step)
                keys.append(ExpertKey(m["stack"], int(m["layer"]), e))  # type: ignore[index]
        else:
            starts.append(first)
            keys.append(name)
        why[reason] = why.get(reason, 0) + 1
        pos = offset + nbytes
    if not starts and data_start < file_size:  # no tensor data, only padding after the header
        starts, keys = [data_start], ["<padding>"]
    return Layout(
        data_start, file_size, tuple(starts), tuple(keys), tuple(sorted(why.items())), tuple(disagreed)
    )


def read_gguf_header(read: Callable[[int, int], bytes], file_size: int) -> tuple[Layout, bytes]:
    """Parse a GGUF header, reading more of the file (`read(offset, n)`) until it is whole.

    Returns the layout and the header bytes up to the aligned data start (what a mirror must match).
    """
    want = min(file_size, 1 << 20)
    buf = read(0, want)
    while True:
        try:
            layout = parse_gguf(buf, file_size)
            break
        except Truncated:
            if len(buf) >= MAX_HEADER:
                raise LayoutError(f"header is over the {MAX_HEADER}-byte limit") from None
            more = read(len(buf), min(file_size, MAX_HEADER, 2 * len(buf)) - len(buf))
            if not more:
                raise LayoutError("header cut short: the file ended while it was read") from None
            buf += more
    end = min(layout.data_start, file_size)
    if len(buf) < end:
        buf += read(len(buf), end - len(buf))
    return layout, buf[:end]
