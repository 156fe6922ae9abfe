"""Check every mirror copy against the primary: size and header (fast), data by SHA-256 (--deep).

The fast check is the mount's own test; --deep also catches bytes changed in place (with the
mtime restored) that no cheap check can see. Both drives are read in parallel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from colifs.formats import format_of
from colifs.plan import survey
from colifs.progress import Progress
from colifs.stage import both_digests, is_ours
from colifs.tree import Tree


@dataclass
class Row:
    relpath: str
    size: int
    status: str  # ok, missing, size differs, header differs, data differs, extra, ...
    used: bool  # the mount would serve from this copy (size and header match)


def verify(primary: str, mirror: str, deep: bool, quiet: bool) -> list[Row]:
    rows = []
    shards = survey(primary, mirror)
    for s in shards:
        status = "ok" if s.present else s.on_mirror
        if status.startswith("size differs"):
            status = "size differs"
        rows.append(Row(s.relpath, s.size, status, s.present))
    if deep:
        used = [r for r in rows if r.used]
        progress = Progress(2 * sum(r.size for r in used), "comparing data (SHA-256)", quiet)
        for r in used:
            progress.note = r.relpath
            ours, theirs = both_digests(primary, mirror, r.relpath, progress)
            if ours != theirs:
                r.status = "data differs"
        progress.finish()
    known = {s.relpath for s in shards}
    for node in Tree(mirror).files():
        name = os.path.basename(node.relpath)
        if node.relpath not in known and not is_ours(name) and format_of(node.relpath):
            rows.append(Row(node.relpath, node.st.st_size, "extra (not on the primary)", False))
    return rows
