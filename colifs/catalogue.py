"""The catalogue of served files, built once at mount: every regular file of the primary's tree,
model files validated against each mirror (colifs.replicas), the copies a `colifs stage` receipt
vouches for, each extent's routing position and stripe rotation (one per file); and the weights
that make partial mirrors split the traffic as the weights say.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence

from colifs.formats import format_for
from colifs.moe import Configs
from colifs.receipt import load_receipt, receipt_vouches
from colifs.replicas import Replica, ServedFile, validate
from colifs.routing import CHUNK, NOT_STRIPED, balanced_weights, expected_shares, positions, stripe_rotation
from colifs.tree import Tree
from colifs.usage import Usage, key_sizes, traffic


def build_files(tree: Tree, replicas: Sequence[Replica]) -> dict[int, ServedFile]:
    """Every regular file of the tree by inode; model files (safetensors, GGUF, by name or content)
    validated and routed."""
    configs = Configs(tree.root)
    checked: dict[int, ServedFile] = {}
    for node in tree.files():
        path = os.path.join(tree.root, node.relpath)
        fmt = format_for(path)
        if fmt is None:
            checked[node.ino] = ServedFile(node.relpath, node.st.st_size)
        else:
            checked[node.ino] = validate(path, node.relpath, replicas, fmt, configs.experts_for(node.relpath))
    vouched = _vouched(checked, tree, replicas)
    where = positions(k for f in checked.values() if f.layout for k in f.layout.keys)
    key_bytes = key_sizes(f.layout for f in checked.values() if f.layout is not None)
    # Keys smaller than two chunks stay whole on one drive, in both routing modes.
    striped = {k for k, n in key_bytes.items() if n >= 2 * CHUNK}
    return {ino: _routed(f, where, striped, vouched.get(ino, ())) for ino, f in checked.items()}


def _routed(f: ServedFile, where: Mapping, striped: set, vouched: tuple[int, ...]) -> ServedFile:
    """`f` with its extents' routing positions, stripe rotations and receipt-vouched copies."""
    keys = f.layout.keys if f.layout is not None else ()
    rotation = stripe_rotation(f.relpath)
    return dataclasses.replace(
        f,
        positions=tuple(where[k] for k in keys),
        stripes=tuple(rotation if k in striped else NOT_STRIPED for k in keys),
        vouched=vouched,
    )


def _vouched(files: Mapping[int, ServedFile], tree: Tree, replicas: Sequence[Replica]) -> dict[int, tuple]:
    """Per file, the mirrors whose `colifs stage` receipt still vouches for its copy (SHA-256-checked)."""
    out: dict[int, tuple[int, ...]] = {}
    for r in replicas[1:]:
        receipt = load_receipt(r.root)
        if not receipt:
            continue
        for ino, f in files.items():
            if r.index in f.copies and receipt_vouches(
                receipt.get(f.relpath), f.size, tree.nodes[ino].st.st_mtime_ns, f.identities[r.index][3]
            ):
                out[ino] = (*out.get(ino, ()), r.index)
    return out


def traffic_by_copies(
    files: Mapping[int, ServedFile], history: Usage, nrep: int
) -> dict[tuple[int, ...], float] | None:
    """The traffic in the usage history per set of replicas holding it; None when every mirror is
    full (or nothing was ever read): then no correction is needed."""
    layouts = {f.relpath: f.layout for f in files.values() if f.layout is not None}
    expected = traffic(layouts, history)
    by_set: dict[tuple[int, ...], float] = defaultdict(float)
    for f in files.values():
        if f.layout is not None:
            by_set[f.copies] += expected[f.relpath]
    total = sum(by_set.values())
    if total <= 0 or by_set.get(tuple(range(nrep)), 0.0) >= total:
        return None
    return dict(by_set)


def partial_weights(
    weights: Sequence[float], by_set: Mapping[tuple[int, ...], float]
) -> tuple[list[float], dict]:
    """Weights such that, with partial mirrors, the bytes split as `weights` say (as far as the
    copies allow), from the traffic per set of copies (`traffic_by_copies`); and what stats.json
    shows of it."""
    total = sum(by_set.values())
    balanced = balanced_weights(weights, by_set)
    scale = weights[0] / balanced[0] if balanced[0] > 1e-9 else sum(weights)
    return [w * scale for w in balanced], {
        "coverage": [sum(t for s, t in by_set.items() if i in s) / total for i in range(len(weights))],
        "plain_weights": list(weights),
        "weights_for_held_files": [w * scale for w in balanced],
        "predicted_byte_share": expected_shares(balanced, by_set),
        "plain_byte_share": expected_shares(weights, by_set),
    }


def describe(replicas: Sequence[Replica], source: str, files: Mapping[int, ServedFile]) -> str:
    """The mount's first log line: each replica, its weight, how many model files it serves."""
    models = [f for f in files.values() if f.is_model]
    parts = []
    for r in replicas:
        held = sum(1 for f in models if r.index in f.copies)
        parts.append(f"{r.role} {r.root} (weight {r.weight:g}, {held}/{len(models)} model files)")
    return f"weights {source}: " + ", ".join(parts)
