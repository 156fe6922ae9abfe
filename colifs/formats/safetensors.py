"""safetensors header → sorted tensor extents → routing keys. Pure: bytes in, a Layout out.

A file is the header (8-byte little-endian length N, then N bytes of JSON) followed by the
tensor data, tensor after tensor with no gap.
"""

from __future__ import annotations

import struct

from colifs import jsonin
from colifs.formats.experts import fused_cuts, tensor_key
from colifs.formats.layout import (
    BY_NAME,
    DENSE_LAYER,
    DISAGREED,
    EXPERT_NAME,
    ExpertConfig,
    ExpertKey,
    Key,
    Layout,
    LayoutError,
)  # fmt: skip

MAX_HEADER = 100_000_000  # the limit safetensors itself enforces

# Bits per element, as safetensors defines them (F4/F6 pack several elements per byte).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}  # fmt: skip


def header_length(first8: bytes, file_size: int) -> int:
    """The JSON length N from the first 8 bytes, checked against the file size."""
    if len(first8) < 8 or file_size < 8:
        raise LayoutError(f"file is {file_size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", first8[:8])
    if n > MAX_HEADER:
        raise LayoutError(f"header length {n} is over the {MAX_HEADER}-byte limit")
    if 8 + n > file_size:
        raise LayoutError(f"header length {n} runs past the end of the {file_size}-byte file")
    return n


def _nbytes(name: str, info: object) -> tuple[int, int, list[int]]:
    """(begin, end, shape) of one tensor entry, each field checked."""
    if not isinstance(info, dict):
        raise LayoutError(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype is None or shape is None or offsets is None:
        raise LayoutError(f"tensor {name!r}: entry lacks dtype, shape or data_offsets")
    if dtype not in DTYPE_BITS:
        raise LayoutError(f"tensor {name!r}: unknown dtype {dtype!r}")
    bits = _elements(name, shape) * DTYPE_BITS[dtype]
    if not (type(offsets) is list and len(offsets) == 2 and _is_count(offsets[0]) and _is_count(offsets[1])):
        raise LayoutError(f"tensor {name!r}: data_offsets is not [begin, end]")
    begin, end = offsets
    if end < begin or bits % 8 or bits // 8 != end - begin:
        raise LayoutError(f"tensor {name!r}: data_offsets {offsets} do not match shape {shape} × {dtype}")
    return begin, end, shape


def _elements(name: str, shape: object) -> int:
    """The element count of a shape: a list of non-negative integers (checked in the same pass:
    a big checkpoint has ~100k tensors)."""
    if type(shape) is not list:
        raise LayoutError(f"tensor {name!r}: shape is not a list of non-negative integers")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise LayoutError(f"tensor {name!r}: shape is not a list of non-negative integers")
        count *= d
    return count


def _is_count(v: object) -> bool:
    return type(v) is int and v >= 0


def parse_header(header: bytes, file_size: int, config: ExpertConfig | None = None) -> Layout:
    """Build the Layout from the first 8+N bytes of a file of `file_size` bytes; `config` is what
    the model's config says about its experts (None: no config says).

    Raises LayoutError for anything safetensors itself would refuse, plus trailing bytes.
    """
    data_start, entries = _entries(header, file_size)
    named = [tensor_key(name) for _, _, name, _ in entries]  # each name keyed once: ~100k of them
    cuts, by_name = fused_cuts(
        [
            (name, shape, end - begin)
            for (begin, end, name, shape), key in zip(entries, named, strict=True)
            if not isinstance(key, ExpertKey)
        ],
        config,
    )
    starts: list[int] = []
    keys: list[Key] = []
    why: dict[str, int] = {}
    pos = 0
    for (begin, end, name, _), key in zip(entries, named, strict=True):
        if begin != pos:
            what = "overlaps the previous one" if begin < pos else f"leaves a gap at {pos}"
            raise LayoutError(f"tensor {name!r} at data offset {begin} {what}")
        if name in cuts:
            stack, layer, n_exp, reason = cuts[name]
            step = (end - begin) // n_exp
            for e in range(n_exp):
                starts.append(data_start + begin + e * step)
                keys.append(ExpertKey(stack, layer, e))
        else:
            reason = EXPERT_NAME if isinstance(key, ExpertKey) else by_name.get(name, BY_NAME)
            starts.append(data_start + begin)
            keys.append(key)
        why[reason] = why.get(reason, 0) + 1
        pos = end
    if data_start + pos != file_size:
        if data_start + pos > file_size:
            raise LayoutError(f"tensor data ends at {data_start + pos}, past the end ({file_size})")
        raise LayoutError(f"{file_size - data_start - pos} trailing bytes after the last tensor")
    disagreed = tuple(n for n, r in by_name.items() if r in (DISAGREED, DENSE_LAYER))
    return Layout(data_start, file_size, tuple(starts), tuple(keys), tuple(sorted(why.items())), disagreed)


def tensor_spans(header: bytes, file_size: int) -> list[tuple[int, int, str]]:
    """(start, end, name) of every tensor, in file offsets: what `colifs route` names."""
    data_start, entries = _entries(header, file_size)
    return [(data_start + b, data_start + e, name) for b, e, name, _ in entries]


def _entries(header: bytes, file_size: int) -> tuple[int, list[tuple[int, int, str, list[int]]]]:
    """The data start and the non-empty tensor entries (begin, end, name, shape), by offset."""
    n = header_length(header, file_size)
    if len(header) < 8 + n:
        raise LayoutError(f"header is {len(header) - 8} bytes, {n} expected")
    try:
        text = header[8 : 8 + n].decode("utf-8")
    except UnicodeDecodeError as e:
        raise LayoutError(f"header is not valid UTF-8 (byte {e.start})") from None
    try:
        meta = jsonin.loads(text)
    except jsonin.BadJSON as e:
        raise LayoutError(f"header is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise LayoutError("header JSON is not an object")
    data_start = 8 + n
    entries = []
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        begin, end, shape = _nbytes(name, info)
        if end > begin:  # zero-size tensors occupy no bytes and route nothing
            entries.append((begin, end, name, shape))
    entries.sort()
    return data_start, entries
