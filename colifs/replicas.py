"""Replicas and the per-file decision of which of them may serve it (mount-time validation).

A mirror copy of a model file (safetensors, GGUF) is used only if it has the same size and a
byte-identical header (safetensors: the 8-byte length + JSON; GGUF: everything up to the aligned
data start): then its tensor bytes sit at the same offsets. Only headers are read, never data.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field

from colifs.formats import Format, format_of
from colifs.layout import ExpertConfig, Layout, LayoutError

log = logging.getLogger("colifs")
MISSING = "missing"  # a mirror without the file: a partial mirror, not a fault


Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


def identity(st: os.stat_result) -> Identity:
    """What must not change for a validated mirror copy to stay usable."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True, slots=True)
class Replica:
    """One copy of the model directory. Index 0 is the primary, the source of truth."""

    index: int
    root: str
    weight: float

    @property
    def role(self) -> str:
        return "primary" if self.index == 0 else "mirror"


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

    def drop(self, replica: int, why: str) -> None:
        """Stop using a mirror for this file (it changed after mount); notes say why."""
        self.copies = tuple(r for r in self.copies if r != replica)
        self.note = "; ".join(x for x in (self.note, why) if x)

    @property
    def is_model(self) -> bool:
        return self.fmt is not None


def mirror_problem(mirror_path: str, size: int, header: bytes) -> tuple[str | None, Identity | None]:
    """(why the mirror copy cannot serve the file or None, its identity when it can)."""
    try:
        st = os.stat(mirror_path)
    except FileNotFoundError:
        return MISSING, None
    except OSError as e:
        return f"cannot stat ({e.strerror})", None
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file", None
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
