"""Check every mirror copy against the primary: size and header (fast), data by SHA-256 (--deep).

The fast check is the mount's own test; --deep also catches bytes changed in place (with the
mtime restored) that no cheap check can see. Both drives are read in parallel.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from colifs.formats import format_for
from colifs.plan import survey
from colifs.progress import Progress
from colifs.receipt import is_ours
from colifs.stage import both_digests
from colifs.tree import Tree


@dataclass
class Row:
    relpath: str
    size: int
    status: str  # ok, missing, size differs, header differs, data differs, extra, ...
    used: bool  # the mount would serve from this copy (size and header match)


def verify(primary: str, mirror: str, deep: bool, quiet: bool) -> list[Row]:
    shards = survey(primary, mirror)
    rows = [Row(s.relpath, s.size, _status(s.on_mirror), s.present) for s in shards]
    if deep:
        rows = _compare_data(primary, mirror, rows, quiet)
    known = {s.relpath for s in shards}
    for node in Tree(mirror).files():
        name = os.path.basename(node.relpath)
        if node.relpath not in known and not is_ours(name) and format_for(os.path.join(mirror, node.relpath)):
            rows.append(Row(node.relpath, node.st.st_size, "extra (not on the primary)", False))
    return rows


def _status(on_mirror: str) -> str:
    if on_mirror == "present":
        return "ok"
    return "size differs" if on_mirror.startswith("size differs") else on_mirror


def _compare_data(primary: str, mirror: str, rows: list[Row], quiet: bool) -> list[Row]:
    """The rows with "data differs" where a copy the mount would use has other bytes."""
    used = [r for r in rows if r.used]
    progress = Progress(2 * sum(r.size for r in used), "comparing data (SHA-256)", quiet)
    differs = set()
    for r in used:
        progress.working_on(r.relpath)
        ours, theirs = both_digests(primary, mirror, r.relpath, progress)
        if ours != theirs:
            differs.add(r.relpath)
    progress.finish()
    return [dataclasses.replace(r, status="data differs") if r.relpath in differs else r for r in rows]
