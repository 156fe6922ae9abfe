"""Which tensors are routed experts, by their names: the MoE families' naming rules (one tensor
per expert, fused experts with the expert as dimension 0) and how a fused tensor is cut. This is
where a new family goes; every format's parser asks it. Pure.
"""

from __future__ import annotations

import functools
import re

from colifs.formats.layout import (
    BY_NAME,
    DENSE_LAYER,
    DISAGREED,
    FUSED_CONFIG,
    FUSED_SHAPE,
    UNEVEN,
    ExpertConfig,
    ExpertKey,
    Key,
)  # fmt: skip

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
