"""Which tensor holds a byte of a served file, for `user.colifs.route.N` (colifs route).

A header can be 100 MB of JSON: parsing it for every lookup would hold the GIL on a FUSE thread
for as long, again and again, at the asking of any user of an `--allow-other` mount, and the
daemon's trio loop (health checks, the balancer, signals, reloads) would wait behind it. A file's
tensors cannot move while it is mounted, so each file's table is built once from its primary's
header, compactly (offsets in arrays, names in one bytes object), and kept until a reload or a
mirror change (`forget`), within a bound on the memory all tables take.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from colifs.formats import format_for
from colifs.formats.layout import LayoutError

LIMIT = 64 << 20  # bytes all tables may take (roughly); the least recently asked go first
_Mounted = tuple[int, int, int]  # the primary file as mounted: st_ino, st_size, st_mtime_ns


class TensorTable:
    """The tensors of one file by offset: their starts and ends, and their names in one blob."""

    __slots__ = ("blob", "cuts", "ends", "starts")

    def __init__(self, spans: Sequence[tuple[int, int, str]]) -> None:
        spans = sorted(spans)
        self.starts = array("q", (s for s, _, _ in spans))
        self.ends = array("q", (e for _, e, _ in spans))
        names = [n.encode() for _, _, n in spans]
        self.cuts = array("q", [0])
        for n in names:
            self.cuts.append(self.cuts[-1] + len(n))
        self.blob = b"".join(names)

    @property
    def nbytes(self) -> int:
        return len(self.blob) + 8 * (len(self.starts) + len(self.ends) + len(self.cuts)) + 200

    def name_at(self, offset: int) -> str | None:
        i = bisect.bisect_right(self.starts, offset) - 1
        if i < 0 or offset >= self.ends[i]:
            return None
        return self.blob[self.cuts[i] : self.cuts[i + 1]].decode()


EMPTY = TensorTable(())


def table_of(path: str, mounted: _Mounted) -> TensorTable:
    """The table of the primary file at `path`; empty when it is not a model file, cannot be read,
    or is no longer the file mounted (a route must never name another file's tensor)."""
    fmt = format_for(path)
    if fmt is None:
        return EMPTY
    try:
        before = os.stat(path)
        size, header, _ = fmt.read(path)
        after = os.stat(path)
    except (OSError, LayoutError):
        return EMPTY
    if {_as_mounted(before), _as_mounted(after)} != {mounted} or size != mounted[1]:
        return EMPTY
    try:
        return TensorTable(fmt.spans(header, size))
    except LayoutError:
        return EMPTY


def _as_mounted(st: os.stat_result) -> _Mounted:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


_Key = tuple[int, _Mounted]  # a file (inode) in one generation (the primary's file as mounted)


class _Store:
    """The tables kept, and the bytes they take."""

    def __init__(self) -> None:
        self.tables: OrderedDict[_Key, TensorTable] = OrderedDict()
        self.nbytes = 0

    def keep(self, key: _Key, table: TensorTable, limit: int) -> None:
        self.tables[key] = table
        self.nbytes += table.nbytes
        while self.nbytes > limit and len(self.tables) > 1:
            _, old = self.tables.popitem(last=False)
            self.nbytes -= old.nbytes


class TensorTables:
    """Each file's table, built on its first route lookup, one build at a time (lookups of other
    files wait for it rather than parse alongside), kept until `forget`."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._store = _Store()
        self._building = threading.Lock()
        self.builds = 0

    def name_at(self, ino: int, path: str, mounted: _Mounted, offset: int) -> str | None:
        """The tensor holding byte `offset` of file `ino`, the primary's file at `path` as mounted
        (`mounted`: a table is kept per file and generation)."""
        store, key = self._store, (ino, mounted)
        table = store.tables.get(key)
        if table is None:
            table = self._build(key, path)
        else:
            with contextlib.suppress(KeyError):  # dropped meanwhile by another lookup's build
                store.tables.move_to_end(key)
        return table.name_at(offset)

    def _build(self, key: _Key, path: str) -> TensorTable:
        with self._building:
            store = self._store  # a `forget` meanwhile leaves this table in a store no one reads
            table = store.tables.get(key)
            if table is None:  # else built while this lookup waited
                table = table_of(path, key[1])
                self.builds += 1
                store.keep(key, table, self.limit)
            return table

    def forget(self) -> None:
        """A reload or a mirror change: every table is built again when next asked for. Never waits
        (the trio loop calls it), not even for a build under way."""
        self._store = _Store()
