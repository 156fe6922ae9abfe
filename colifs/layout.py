"""safetensors header → sorted tensor extents → routing keys. Pure: bytes in, a Layout out.

A file is the header (8-byte little-endian length N, then N bytes of JSON) followed by the
tensor data, tensor after tensor with no gap. A Layout cuts the data part into extents, each
with the routing key of the tensor (or fused-expert slice) it holds, so that a read range can be
split into pieces that each belong to exactly one key.
"""

from __future__ import annotations

import functools
import re
import struct
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from colifs import jsonin

MAX_HEADER = 100_000_000  # the limit safetensors itself enforces
HEADER = -1  # the extent index of the header bytes: always served by the primary

# Bits per element, as safetensors defines them (F4/F6 pack several elements per byte).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}  # fmt: skip


class ExpertKey(NamedTuple):
    """One routed MoE expert. `stack` keeps MTP layers apart from the main stack."""

    stack: str
    layer: int
    expert: int


Key = ExpertKey | str  # a tensor that is not a routed expert is keyed by its name


class ExpertConfig(NamedTuple):
    """What a model's config says about its routed experts (colifs.moe reads it)."""

    count: int  # routed experts per MoE layer
    layers: frozenset[int] | None = None  # the MoE layers, when the config states them


class LayoutError(ValueError):
    """The header is malformed; the message is the reason, short enough for one warning line."""


# One tensor per expert: `<stack>.<L>.[...].experts.<E>.<anything>`. `shared_experts` never matches
# because `experts` must follow a dot directly.
_PER_EXPERT = re.compile(r"^(?P<stack>.+?)\.(?P<layer>\d+)\.(?:.+\.)?experts\.(?P<expert>\d+)\.")
# Fused tensors with the expert as dimension 0: gpt-oss `experts.gate_up_proj_blocks`,
# Llama-4 `experts.gate_up_proj`, GraniteMoE / JetMoE `input_linear` / `output_linear`; DBRX's
# `ffn.experts.mlp.w1` is row-fused ([E·I, H]: see _ROW_FUSED).
_FUSED = re.compile(
    r"^(?P<stack>.+?)\.(?P<layer>\d+)\.(?:.+\.)?"
    r"(?:experts\.(?!\d+\.)[^.]+|(?:block_sparse_moe|moe|mlp)\.(?:input|output)_linear\.)"
)
# Row-fused: dimension 0 is experts × rows, so only a config's expert count can cut it.
_ROW_FUSED = re.compile(r"\.ffn\.experts\.mlp\.")
# Never an expert, whatever its shape: routers and gates, shared experts, norms, routing statistics.
_NOT_EXPERT = {"router", "gate", "shared_expert", "shared_experts", "moe_statics", "shared_expert_gate"}

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


def tensor_key(name: str) -> Key:
    """The routing key of a one-tensor-per-expert name, else the name itself.

    Exactly what `_PER_EXPERT` matches (a property test holds them equal), by splitting on dots:
    the backtracking regex took 3x longer, and a big checkpoint has ~100k names. When the name's
    last `.experts.N.` can be the one matched, what comes before it decides the rest: a model's
    ~6 tensors per expert share that prefix, so it is worked out once per expert.
    """
    at = name.rfind(".experts.")
    if at < 0:
        return name
    number, dot, _ = name[at + 9 :].partition(".")
    if dot and number.isdecimal() and "." in name[:at]:
        found = _key_before(name[:at])
        if found is None:
            return name
        stack, layer, expert = found
        return ExpertKey(stack, layer, int(number) if expert is None else expert)
    parts = name.split(".")
    m = _match(parts)
    return name if m is None else ExpertKey(".".join(parts[: m[0]]), int(parts[m[0]]), int(parts[m[1] + 1]))


@functools.lru_cache(maxsize=1 << 16)
def _key_before(prefix: str) -> tuple[str, int, int | None] | None:
    """(stack, layer, expert) of every name `<prefix>.experts.N.<rest>` with no `.experts.` in
    `<rest>`: expert None means N; None: they are keyed by name."""
    parts = [*prefix.split("."), "experts", "0", ""]
    m = _match(parts)
    if m is None:
        return None
    j, k = m
    return ".".join(parts[:j]), int(parts[j]), None if k == len(parts) - 3 else int(parts[k + 1])


def _match(parts: list[str]) -> tuple[int, int] | None:
    """(layer component, `experts` component) the regex would match in these dot-split parts."""
    at = [i for i in range(2, len(parts) - 2) if parts[i] == "experts" and parts[i + 1].isdecimal()]
    if not at:
        return None
    # Like the regex: the first layer (a number component after a non-empty stack) for which some
    # "experts.N." follows, the last such one (greedy), with nothing or a non-empty run between;
    # `.` never matches a newline.
    stack = parts[0]
    for j in range(1, at[-1]):
        if stack and "\n" not in stack and parts[j].isdecimal():
            k = _last_experts_after(parts, j, at)
            if k is not None:
                return j, k
        stack += "." + parts[j]
    return None


def _last_experts_after(parts: list[str], j: int, at: list[int]) -> int | None:
    """The last `experts` component after layer component j with nothing or a one-line run between."""
    for k in reversed(at):
        if k <= j:
            return None
        between = ".".join(parts[j + 1 : k])
        if k == j + 1 or (between and "\n" not in between):
            return k
    return None


Fused = dict[str, tuple[str, int, int, int]]  # name → stack, layer, dim 0, bytes
Cuts = tuple[dict[str, tuple[str, int, int, str]], dict[str, str]]  # (name → cut, name → why whole)


def never_expert(name: str) -> bool:
    """Routers, gates, shared experts and norms are never experts."""
    return any(c in _NOT_EXPERT or "norm" in c for c in name.split("."))


def fused_cuts(entries: list[tuple[str, list[int], int]], config: ExpertConfig | None) -> Cuts:
    """Which tensors of a file (name, shape, bytes) are fused experts, and how to cut them. The
    names given are those that are not one-tensor-per-expert names (`tensor_key` gives no ExpertKey).

    Returns ({name: (stack, layer, slices, why)}, {name: why it is keyed by name}). With the
    config's count E, a fused-expert name is cut into E slices when dimension 0 is E (or E × rows
    for a row-fused layout) and its layer is one the config makes MoE; otherwise it is keyed by
    name. Without a config, dimension 0 is the count, but only when all fused tensors of that layer
    agree on it.
    """
    found: Fused = {}
    for name, shape, nbytes in entries:
        m = _FUSED.match(name)
        if m and len(shape) >= 2 and not never_expert(name):
            found[name] = (m["stack"], int(m["layer"]), shape[0], nbytes)
    return _cuts_by_config(found, config) if config is not None else _cuts_by_shape(found)


def _cuts_by_config(found: Fused, config: ExpertConfig) -> Cuts:
    cuts: dict[str, tuple[str, int, int, str]] = {}
    by_name: dict[str, str] = {}
    e = config.count
    for name, (stack, layer, dim0, nbytes) in found.items():
        fits = dim0 == e or (_ROW_FUSED.search(name) is not None and dim0 % e == 0)
        if config.layers is not None and layer not in config.layers:
            by_name[name] = DENSE_LAYER
        elif fits and e >= 2 and nbytes % e == 0:
            cuts[name] = (stack, layer, e, FUSED_CONFIG)
        else:
            by_name[name] = DISAGREED
    return cuts, by_name


def _cuts_by_shape(found: Fused) -> Cuts:
    """Without a config: dimension 0 is the count when every fused tensor of the layer agrees."""
    cuts: dict[str, tuple[str, int, int, str]] = {}
    by_name: dict[str, str] = {}
    dims: dict[tuple[str, int], set[int]] = {}
    for stack, layer, dim0, _ in found.values():
        dims.setdefault((stack, layer), set()).add(dim0)
    for name, (stack, layer, dim0, nbytes) in found.items():
        if _ROW_FUSED.search(name) or len(dims[stack, layer]) > 1:
            by_name[name] = UNEVEN if len(dims[stack, layer]) > 1 else BY_NAME
        elif dim0 >= 2 and nbytes % dim0 == 0:
            cuts[name] = (stack, layer, dim0, FUSED_SHAPE)
    return cuts, by_name


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
