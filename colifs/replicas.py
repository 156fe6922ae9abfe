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
from colifs.layout import Layout, LayoutError

log = logging.getLogger("colifs")


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
    """A regular file of the mount: its layout (None = plain bytes) and the replicas that may serve it.

    `positions` holds the routing position u of each layout extent and `stripes` its key's stripe
    rotation, or -1 where the key is too small to stripe (see routing.py).
    """

    relpath: str
    size: int
    layout: Layout | None = None
    replicas: tuple[int, ...] = (0,)
    note: str = ""
    positions: tuple[float, ...] = field(default=())
    stripes: tuple[int, ...] = field(default=())

    @property
    def is_model(self) -> bool:
        return format_of(self.relpath) is not None


def mirror_problem(mirror_path: str, size: int, header: bytes) -> str | None:
    """Why the mirror copy at `mirror_path` cannot serve the file, or None when it can."""
    try:
        st = os.stat(mirror_path)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot stat ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size != size:
        return f"size differs ({st.st_size} bytes, primary {size})"
    try:
        fd = os.open(mirror_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            theirs = os.pread(fd, len(header), 0)
        finally:
            os.close(fd)
    except OSError as e:
        return f"cannot read header ({e.strerror})"
    return None if theirs == header else "header differs"


def validate(path: str, relpath: str, replicas: list[Replica], fmt: Format) -> ServedFile:
    """Parse the primary copy's header and check every mirror; one warning per problem."""
    try:
        size, header, layout = fmt.read(path)
    except (LayoutError, OSError) as e:
        reason = e.strerror if isinstance(e, OSError) else str(e)
        note = f"malformed header: {reason}; served from the primary as plain bytes"
        log.warning("%s: %s", relpath, note)
        return ServedFile(relpath, _size_or_zero(path), note=note)
    valid = [0]
    notes = []
    for r in replicas[1:]:
        problem = mirror_problem(os.path.join(r.root, relpath), size, header)
        if problem is None:
            valid.append(r.index)
        else:
            notes.append(f"mirror {r.root}: {problem}")
            log.warning("%s: mirror %s: %s; served without this mirror", relpath, r.root, problem)
    return ServedFile(relpath, size, layout, tuple(valid), "; ".join(notes))


def _size_or_zero(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
