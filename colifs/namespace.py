"""What the mount shows, for both engines: inodes and their attributes, directory listings, the
control files and the extended attributes. Errors are OSErrors; each engine turns them into its
FUSE replies (pyfuse3: colifs.pyfuse3.fs, native: colifs.native).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from colifs.catalogue import ServedFile
from colifs.formats.layout import HEADER, ExpertKey
from colifs.replicas import Replica
from colifs.stats import Stats
from colifs.tensors import TensorTables
from colifs.tree import ROOT_INO, Tree

log = logging.getLogger("colifs")

CONTROL_DIR = b".colifs"
CONTROL_INO = 2
STATS_INO = 3
STATS_JSON_INO = 4
CONTROL_FILES = {b"stats": STATS_INO, b"stats.json": STATS_JSON_INO}
REPLICAS_XATTR = b"user.colifs.replicas"
ROUTE_XATTR = b"user.colifs.route."
ENOATTR = errno.ENODATA
WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
CACHE_TIMEOUT = 3600.0  # the backing files are immutable while mounted
CONTROL_STEP = 64  # bytes: a control file's size grows in steps of this, with 1/8 room to spare
SHARED_FOR = 0.5  # s a control file's rendering is shown to other users before a new one is made


def _room(n: int) -> int:
    """The size a control file of n bytes grows to: rarely changing, little padding."""
    return -(-(n + n // 8) // CONTROL_STEP) * CONTROL_STEP


@dataclass(frozen=True, slots=True)
class Attr:
    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    blocks: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    timeout: float  # entry and attribute timeout: 0 for control files (always current)


class Namespace:
    """The read-only view of the primary's tree, with colifs' control directory at its root."""

    def __init__(
        self,
        tree: Tree,
        files: Mapping[int, ServedFile],
        stats: Stats,
        replicas: Sequence[Replica],
        drive_at: Callable[[ServedFile, int], int],
    ) -> None:
        self.tree = tree
        self.files = files
        self.stats = stats
        self.replicas = replicas  # shared: a mirror added in a removed one's slot changes its root
        self._drive_at = drive_at  # the drive that serves a byte now (the engine knows health)
        self._control_sizes: dict[int, int] = {}  # grows only (see snapshot)
        self._shared: dict[int, tuple[float, bytes]] = {}  # per control file: (made at, rendering)
        self._rendering = threading.Lock()  # other users' renderings: one at a time
        self.tensors = TensorTables()  # route lookups: each file's tensors, kept until `forget`
        self._attrs = {ino: self._node_attr(ino) for ino in tree.nodes}
        root = self._attrs[ROOT_INO]
        started = int(stats.started * 1e9)
        self._attrs[CONTROL_INO] = Attr(
            CONTROL_INO, stat.S_IFDIR | 0o555, 2, root.uid, root.gid, 0, 0, started, started, started,
            CACHE_TIMEOUT,
        )  # fmt: skip
        if CONTROL_DIR in tree.nodes[ROOT_INO].children:
            log.warning(
                "the primary has its own %s; it is hidden by colifs' control directory", CONTROL_DIR.decode()
            )

    def _node_attr(self, ino: int) -> Attr:
        st = self.tree.nodes[ino].st
        nlink = st.st_nlink if stat.S_ISDIR(st.st_mode) else 1
        return Attr(
            ino, st.st_mode & ~WRITE_BITS, nlink, st.st_uid, st.st_gid, st.st_size, st.st_blocks,
            st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, CACHE_TIMEOUT,
        )  # fmt: skip

    def inodes(self) -> list[int]:
        """Every inode the mount shows (the tree's, the control directory and its files)."""
        return [*self._attrs, *CONTROL_FILES.values()]

    def attr(self, ino: int) -> Attr:
        if ino in (STATS_INO, STATS_JSON_INO):
            d = self._attrs[CONTROL_INO]
            now = time.time_ns()
            size = self.control_size(ino)
            blocks = -(-size // 512)  # not sparse: cp copies what it reads, never pads to the size
            return Attr(ino, stat.S_IFREG | 0o444, 1, d.uid, d.gid, size, blocks, now, now, now, 0)
        try:
            return self._attrs[ino]
        except KeyError:
            raise OSError(errno.ENOENT, "no such inode") from None

    def children(self, ino: int) -> list[tuple[bytes, int]]:
        """A directory's entries in readdir order (the control directory first at the root)."""
        if ino == CONTROL_INO:
            return sorted(CONTROL_FILES.items())
        node = self.tree.nodes.get(ino)
        if node is None or not node.is_dir:
            raise OSError(errno.ENOTDIR, "not a directory")
        children = [(name, i) for name, i in node.children.items() if ino != ROOT_INO or name != CONTROL_DIR]
        if ino == ROOT_INO:
            children.insert(0, (CONTROL_DIR, CONTROL_INO))
        return children

    def lookup(self, parent: int, name: bytes) -> int:
        if parent == ROOT_INO and name == CONTROL_DIR:
            return CONTROL_INO
        if parent == CONTROL_INO:
            ino = CONTROL_FILES.get(name)
        else:
            node = self.tree.nodes.get(parent)
            ino = node.children.get(name) if node is not None else None
        if ino is None:
            raise OSError(errno.ENOENT, "no such entry")
        return ino

    def statfs(self) -> os.statvfs_result:
        """The primary's filesystem: its size and free space are what the mount reports."""
        return os.statvfs(self.tree.root)

    def snapshot(self, ino: int, uid: int | None = None) -> bytes:
        """A control file's content now, as an open reads it: padded with spaces (before its last
        newline; JSON allows them) to the file's size, which only grows, in steps. So every
        snapshot has the size a stat showed before it, and cp, sendfile (which reads up to the
        size) and json.load all get whole content, however the numbers change in between.

        `uid`, the caller: the daemon's own user and root (who steer the mount anyway) get one
        rendered now; other users (an --allow-other mount) one at most SHARED_FOR seconds old,
        the same for all of them, so no number of them makes the daemon render more than about
        twice a second."""
        owner = uid is None or uid in (0, os.geteuid())
        data = self.render(ino) if owner else self._shared_rendering(ino)
        size = self._control_sizes.get(ino, 0)
        if len(data) > size:
            size = self._control_sizes[ino] = _room(len(data))
        return data[:-1] + b" " * (size - len(data)) + data[-1:]

    def _shared_rendering(self, ino: int) -> bytes:
        """A recent rendering: a new one once the last is SHARED_FOR old, made by one caller while
        the others take the last one (none waits, unless there is none yet)."""
        last = self._shared.get(ino)
        if last is not None and time.monotonic() - last[0] < SHARED_FOR:
            return last[1]
        if not self._rendering.acquire(blocking=last is None):
            return last[1]  # type: ignore[index]  # another caller renders it now
        try:
            last = self._shared.get(ino)
            if last is None or time.monotonic() - last[0] >= SHARED_FOR:
                last = self._shared[ino] = (time.monotonic(), self.render(ino))
            return last[1]
        finally:
            self._rendering.release()

    def control_size(self, ino: int) -> int:
        size = self._control_sizes.get(ino)
        return len(self.snapshot(ino)) if size is None else size

    def render(self, ino: int) -> bytes:
        """A control file's content now."""
        if ino == STATS_INO:
            return self.stats.line().encode()
        return self.stats.json(list(self.files.values())).encode()

    def xattr_names(self, ino: int) -> list[bytes]:
        return [REPLICAS_XATTR] if ino in self.files else []

    def xattr(self, ino: int, name: bytes) -> bytes:
        """`user.colifs.replicas`: the copies that serve the file, one `role path` per line.
        `user.colifs.route.OFFSET` (not listed): the tensor, key and drive of that byte, as JSON.
        Blocks the first time for a file (it reads the file's header): call it off the request
        loop."""
        f = self.files.get(ino)
        if f is None:
            raise OSError(ENOATTR, "no such attribute")
        if name == REPLICAS_XATTR:
            checked = " (data SHA-256-checked: colifs stage receipt)"
            lines = [
                f"{self.replicas[i].role} {self.replicas[i].root}" + (checked if i in f.vouched else "")
                for i in f.copies
            ]
            return ("\n".join(lines) + "\n").encode()
        if name.startswith(ROUTE_XATTR):
            try:
                offset = int(name[len(ROUTE_XATTR) :])
            except ValueError:
                raise OSError(ENOATTR, "no such attribute") from None
            if not 0 <= offset < f.size:
                raise OSError(errno.EINVAL, "offset outside the file")
            return json.dumps(self._route(ino, f, offset)).encode()
        raise OSError(ENOATTR, "no such attribute")

    def _route(self, ino: int, f: ServedFile, offset: int) -> dict:
        st = self.tree.nodes[ino].st  # the primary's file as mounted: the tensors are its
        path = os.path.join(self.replicas[0].root, f.relpath)
        tensor = self.tensors.name_at(ino, path, (st.st_ino, f.size, st.st_mtime_ns), offset)
        key: object = None
        if f.layout is not None:
            extent = f.layout.pieces(offset, offset + 1)[0][2]
            key = "header" if extent == HEADER else f.layout.keys[extent]
        drive = self._drive_at(f, offset)
        return {
            "file": f.relpath,
            "offset": offset,
            "tensor": tensor,
            "key": key._asdict() if isinstance(key, ExpertKey) else key,
            "drive": self.stats.names()[drive],
            "path": self.replicas[drive].root,
            "valid_copies": [self.replicas[i].root for i in f.copies],
            "tensors_keyed": dict(f.layout.keying) if f.layout is not None else {},
        }
