"""The catalogue of served files, built once at mount: every regular file of the primary's tree,
model files validated against each mirror, the copies a `colifs stage` receipt vouches for, each
extent's routing position and stripe rotation (one per file); and the weights that make partial
mirrors split the traffic as the weights say.

A mirror copy of a model file (safetensors, GGUF) is used only if it has the same size and a
byte-identical header (safetensors: the 8-byte length + JSON; GGUF: everything up to the aligned
data start): then its tensor bytes sit at the same offsets. Only headers are read, never data.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from colifs.formats import Format, format_for, format_of
from colifs.formats.layout import ExpertConfig, Layout, LayoutError
from colifs.formats.moe import Configs
from colifs.receipt import load_receipt, receipt_vouches
from colifs.replicas import Identity, Replica, identity
from colifs.routing import CHUNK, NOT_STRIPED, balanced_weights, expected_shares, positions, stripe_rotation
from colifs.tree import Tree
from colifs.usage import Usage, key_sizes, traffic

log = logging.getLogger("colifs")
MISSING = "missing"  # a mirror without the file: a partial mirror, not a fault


@dataclass(slots=True)
class ServedFile:
    """A regular file of the mount: its format (colifs.formats: "safetensors", "gguf"; None for
    other files), its layout (None = plain bytes) and `copies`, the indices of the replicas whose
    copy may serve it (0, the primary, always).

    `positions` holds the routing position u of each layout extent and `stripes` the file's stripe
    rotation, or NOT_STRIPED (-1) where the extent's key is too small to stripe (see routing.py).
    """

    relpath: str
    size: int
    layout: Layout | None = None
    copies: tuple[int, ...] = (0,)
    note: str = ""
    positions: tuple[float, ...] = field(default=())
    stripes: tuple[int, ...] = field(default=())
    identities: dict[int, Identity] = field(default_factory=dict)  # per valid mirror, at mount
    vouched: tuple[int, ...] = ()  # mirrors whose `colifs stage` receipt still vouches for its data
    fmt: str | None = None
    reloaded: dict[int, int] = field(default_factory=dict)  # per mirror: reload verdicts applied
    # The primary's file at mount: its headers and run table are that file's, so a later open must
    # find the same one (None: not known, not checked).
    primary_identity: Identity | None = None
    primary_changed: bool = False  # found replaced or changed: its opens fail (EIO) until remounted

    def drop(self, replica: int, why: str) -> None:
        """Stop using a mirror for this file (it changed after mount); notes say why."""
        self.copies = tuple(r for r in self.copies if r != replica)
        self.note = "; ".join(x for x in (self.note, why) if x)

    def recheck(self, replica: int, ident: Identity | None, root: str, why: str) -> None:
        """A reload's verdict on a mirror's copy (colifs.reload): usable as `ident`, or not (why);
        the notes about that mirror are replaced."""
        self.reloaded[replica] = self.reloaded.get(replica, 0) + 1
        notes = [x for x in self.note.split("; ") if x and not x.startswith(f"mirror {root}:")]
        if ident is None:  # a copy that does not serve is vouched for by no receipt either
            self.copies = tuple(r for r in self.copies if r != replica)
            self.vouched = tuple(r for r in self.vouched if r != replica)
            self.identities.pop(replica, None)
            notes.append(f"mirror {root}: {why}")
        else:
            self.copies = tuple(sorted({*self.copies, replica}))
            self.identities[replica] = ident
        self.note = "; ".join(notes)

    def refuse(self, what: str) -> bool:
        """The primary's file is no longer the one mounted (`what` changed): noted once; False when
        it was already."""
        if self.primary_changed:
            return False
        self.primary_changed = True
        why = f"the primary changed since mount ({what}): opens fail (EIO) until it is mounted again"
        self.note = "; ".join(x for x in (self.note, why) if x)
        return True

    def generation(self, replica: int) -> int:
        """How many reload verdicts changed the mirror's copy: the native engine counts alike
        (file_t.copy_gen), so an event about an older copy is told apart."""
        return self.reloaded.get(replica, 0)

    def vouch(self, replicas: tuple[int, ...]) -> None:
        """The mirrors whose receipt vouches for the copy, read again (a reload)."""
        self.vouched = replicas

    @property
    def is_model(self) -> bool:
        return self.fmt is not None


def mirror_problem(
    mirror_path: str, size: int, header: bytes, not_on: int | None = None
) -> tuple[str | None, Identity | None]:
    """(why the mirror copy cannot serve the file or None, its identity when it can). `not_on`:
    the device of the mount itself (while serving): a copy there, reached by a symlink into the
    mount say, would have the mount read its own files."""
    try:
        st = os.stat(mirror_path)
    except FileNotFoundError:
        return MISSING, None
    except OSError as e:
        return f"cannot stat ({e.strerror})", None
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file", None
    if not_on is not None and st.st_dev == not_on:
        return "a file of the mount itself (a symlink into it?): the mount would read its own files", None
    if st.st_size != size:
        return f"size differs ({st.st_size} bytes, primary {size})", None
    try:
        fd = os.open(mirror_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            theirs = os.pread(fd, len(header), 0)
            ident = identity(os.fstat(fd))
        finally:
            os.close(fd)
    except OSError as e:
        return f"cannot read header ({e.strerror})", None
    if theirs != header:
        return "header differs", None
    return (None, ident) if ident == identity(st) else ("changed while it was checked", None)


def validate(
    path: str, relpath: str, replicas: list[Replica], fmt: Format, experts: ExpertConfig | None = None
) -> ServedFile:
    """Parse the primary copy's header (fused experts cut as the config `experts` says) and
    check every mirror; one warning per problem. A file of that format by its content only (not
    its name) whose header does not parse is a plain file."""
    try:
        size, header, layout = fmt.read(path, experts)
    except (LayoutError, OSError) as e:
        problem = (
            f"cannot read its header ({e.strerror})" if isinstance(e, OSError) else f"malformed header: {e}"
        )
        named = format_of(relpath) is not None
        note = f"{problem}; served from the primary as plain bytes"
        log.warning("%s: %s%s", relpath, "" if named else f"starts like a {fmt.name} file but ", note)
        return ServedFile(relpath, _size_or_zero(path), note=note, fmt=fmt.name if named else None)
    if layout.disagreed:
        count = f"config's {experts.count} experts" if experts is not None else "metadata's expert count"
        log.warning(
            "%s: %d fused-expert tensors disagree with the %s (shape, or a dense layer; first: %s); "
            "keyed by name, without per-expert routing",
            relpath, len(layout.disagreed), count, layout.disagreed[0],
        )  # fmt: skip
    valid = [0]
    notes = []
    idents: dict[int, Identity] = {}
    for r in replicas[1:]:
        problem, ident = mirror_problem(os.path.join(r.root, relpath), size, header)
        if ident is not None:
            valid.append(r.index)
            idents[r.index] = ident
        else:  # a missing copy is what a partial mirror is: counted in the mount's summary line
            notes.append(f"mirror {r.root}: {problem}")
            level = logging.DEBUG if problem == MISSING else logging.WARNING
            log.log(level, "%s: mirror %s: %s; served without this mirror", relpath, r.root, problem)
    return ServedFile(relpath, size, layout, tuple(valid), "; ".join(notes), identities=idents, fmt=fmt.name)


def _size_or_zero(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


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
    vouched = vouched_copies(checked, tree, replicas)
    where = positions(k for f in checked.values() if f.layout for k in f.layout.keys)
    key_bytes = key_sizes(f.layout for f in checked.values() if f.layout is not None)
    # Keys smaller than two chunks stay whole on one drive, in both routing modes.
    striped = {k for k, n in key_bytes.items() if n >= 2 * CHUNK}
    return {
        ino: _routed(f, where, striped, vouched.get(ino, ()), identity(tree.nodes[ino].st))
        for ino, f in checked.items()
    }


def _routed(
    f: ServedFile, where: Mapping, striped: set, vouched: tuple[int, ...], primary: Identity
) -> ServedFile:
    """`f` with its extents' routing positions, stripe rotations, receipt-vouched copies and the
    identity of the primary's file it was read from."""
    keys = f.layout.keys if f.layout is not None else ()
    rotation = stripe_rotation(f.relpath)
    return dataclasses.replace(
        f,
        positions=tuple(where[k] for k in keys),
        stripes=tuple(rotation if k in striped else NOT_STRIPED for k in keys),
        vouched=vouched,
        primary_identity=primary,
    )


def vouched_copies(
    files: Mapping[int, ServedFile], tree: Tree, replicas: Sequence[Replica]
) -> dict[int, tuple]:
    """Per file, the mirrors whose `colifs stage` receipt still vouches for its copy (SHA-256-checked)."""
    out: dict[int, tuple[int, ...]] = {}
    for r in replicas[1:]:
        if not any(r.index in f.copies for f in files.values()):
            continue  # nothing to vouch for (a mirror removed, or empty): its receipt is not read
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
