"""The pyfuse3 Operations: inode table, lookup/getattr/readdir/open/read, read-only everywhere.

The class receives its parts (tree, served files, reader, stats), so tests can `await ops.read()`
without a mount. Storage errors become FUSE errnos here, at the boundary, and nowhere else.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import pyfuse3

from colifs.formats import tensor_at
from colifs.layout import HEADER, ExpertKey
from colifs.reader import OpenFile, Reader
from colifs.replicas import ServedFile
from colifs.stats import Stats
from colifs.tree import ROOT_INO, Tree

log = logging.getLogger("colifs")

CONTROL_DIR = b".colifs"
CONTROL_INO = 2
STATS_INO = 3
STATS_JSON_INO = 4
_CONTROL_FILES = {b"stats": STATS_INO, b"stats.json": STATS_JSON_INO}
REPLICAS_XATTR = b"user.colifs.replicas"
ROUTE_XATTR = b"user.colifs.route."
_WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
CACHE_TIMEOUT = 3600.0  # the backing files are immutable while mounted

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def fuse_boundary(fn: F) -> F:
    """Map OSError → FUSEError(errno) and any other failure → EIO, once, at the FUSE boundary."""

    @functools.wraps(fn)
    async def wrapper(*args: Any) -> Any:
        try:
            return await fn(*args)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("internal error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


async def _erofs(*_: Any) -> None:
    raise pyfuse3.FUSEError(errno.EROFS)


class ColiFS(pyfuse3.Operations):
    """Read-only view of the primary's tree whose reads are routed by `Reader`."""

    def __init__(self, tree: Tree, files: Mapping[int, ServedFile], reader: Reader, stats: Stats) -> None:
        super().__init__()
        self.tree = tree
        self.files = files
        self.reader = reader
        self.stats = stats
        self._handles: dict[int, OpenFile | bytes] = {}
        self._next_fh = 1
        self._attrs = {ino: self._node_attr(ino) for ino in tree.nodes}
        self._attrs[CONTROL_INO] = self._control_dir_attr()
        if CONTROL_DIR in tree.nodes[ROOT_INO].children:
            log.warning(
                "the primary has its own %s; it is hidden by colifs' control directory", CONTROL_DIR.decode()
            )

    # -- attributes --------------------------------------------------------------------------

    def _node_attr(self, ino: int) -> pyfuse3.EntryAttributes:
        st = self.tree.nodes[ino].st
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = st.st_mode & ~_WRITE_BITS
        a.st_nlink = st.st_nlink if stat.S_ISDIR(st.st_mode) else 1
        a.st_uid, a.st_gid = st.st_uid, st.st_gid
        a.st_size = st.st_size
        a.st_blksize = 1 << 20  # FUSE's largest request: tools size their reads after this
        a.st_blocks = st.st_blocks
        a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
        a.entry_timeout = a.attr_timeout = CACHE_TIMEOUT
        return a

    def _control_dir_attr(self) -> pyfuse3.EntryAttributes:
        root = self._attrs[ROOT_INO]
        a = pyfuse3.EntryAttributes()
        a.st_ino = CONTROL_INO
        a.st_mode = stat.S_IFDIR | 0o555
        a.st_nlink = 2
        a.st_uid, a.st_gid = root.st_uid, root.st_gid
        a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = int(self.stats.started * 1e9)
        a.entry_timeout = a.attr_timeout = CACHE_TIMEOUT
        return a

    def _control_file_attr(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = stat.S_IFREG | 0o444
        a.st_nlink = 1
        a.st_uid, a.st_gid = self._attrs[CONTROL_INO].st_uid, self._attrs[CONTROL_INO].st_gid
        a.st_size = len(self._render(ino))
        a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = time.time_ns()
        a.entry_timeout = a.attr_timeout = 0  # always current: never cached by the kernel
        return a

    def _render(self, ino: int) -> bytes:
        if ino == STATS_INO:
            return self.stats.line().encode()
        return self.stats.json(list(self.files.values())).encode()

    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        if ino in (STATS_INO, STATS_JSON_INO):
            return self._control_file_attr(ino)
        try:
            return self._attrs[ino]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    # -- namespace ---------------------------------------------------------------------------

    def _children(self, ino: int) -> Sequence[tuple[bytes, int]]:
        if ino == CONTROL_INO:
            return sorted(_CONTROL_FILES.items())
        node = self.tree.nodes.get(ino)
        if node is None or not node.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        children = [(name, i) for name, i in node.children.items() if not _shadowed(ino, name)]
        if ino == ROOT_INO:
            children.insert(0, (CONTROL_DIR, CONTROL_INO))
        return children

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if parent_inode == ROOT_INO and name == CONTROL_DIR:
            return self._attr(CONTROL_INO)
        if parent_inode == CONTROL_INO:
            ino = _CONTROL_FILES.get(name)
        else:
            node = self.tree.nodes.get(parent_inode)
            ino = node.children.get(name) if node is not None else None
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(ino)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr(inode)

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self.tree.nodes.get(inode)
        if node is None or not stat.S_ISLNK(node.st.st_mode):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return node.target

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        self._children(inode)  # raises ENOTDIR for anything else
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        children = self._children(fh)
        for i in range(start_id, len(children)):
            name, ino = children[i]
            if not pyfuse3.readdir_reply(token, name, self._attr(ino), i + 1):
                break

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.tree.root)
        out = pyfuse3.StatvfsData()
        out.f_bsize, out.f_frsize = st.f_bsize, st.f_frsize
        out.f_blocks, out.f_bfree, out.f_bavail = st.f_blocks, st.f_bfree, st.f_bavail
        out.f_files, out.f_ffree, out.f_favail = st.f_files, st.f_ffree, st.f_favail
        out.f_namemax = st.f_namemax
        return out

    # -- files -------------------------------------------------------------------------------

    @fuse_boundary
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise pyfuse3.FUSEError(errno.EROFS)
        if inode in (STATS_INO, STATS_JSON_INO):
            # A snapshot per open, read with direct I/O: every reader sees current numbers.
            fh = self._new_fh()
            self._handles[fh] = self._render(inode)
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        f = self.files.get(inode)
        if f is None:
            raise pyfuse3.FUSEError(errno.EISDIR if inode in self.tree.nodes else errno.ENOENT)
        opened = await self.reader.open(f)
        fh = self._new_fh()  # taken after the await: concurrent opens never share a number
        self._handles[fh] = opened
        # keep_cache: the files are immutable, so the page cache stays valid across opens.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    @fuse_boundary
    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray | memoryview:
        h = self._handles[fh]
        if isinstance(h, bytes):
            return h[off : off + size]
        return await self.reader.read(h, off, size)

    @fuse_boundary
    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh)
        if isinstance(h, OpenFile):
            self.reader.release(h)

    @fuse_boundary
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        """`user.colifs.replicas`: the copies that serve the file, one `role path` per line.
        `user.colifs.route.OFFSET` (not listed): the tensor, key and drive of that byte, as JSON."""
        f = self.files.get(inode)
        if f is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        if name == REPLICAS_XATTR:
            checked = " (data SHA-256-checked: colifs stage receipt)"
            lines = [
                f"{self.reader.replicas[i].role} {self.reader.replicas[i].root}"
                + (checked if i in f.vouched else "")
                for i in f.replicas
            ]
            return ("\n".join(lines) + "\n").encode()
        if name.startswith(ROUTE_XATTR):
            try:
                offset = int(name[len(ROUTE_XATTR) :])
            except ValueError:
                raise pyfuse3.FUSEError(pyfuse3.ENOATTR) from None
            if not 0 <= offset < f.size:
                raise pyfuse3.FUSEError(errno.EINVAL)
            return json.dumps(await self._route(f, offset)).encode()
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def _route(self, f: ServedFile, offset: int) -> dict:
        path = os.path.join(self.reader.replicas[0].root, f.relpath)
        tensor = await self.reader.workers[0].run(tensor_at, path, offset)
        key: object = None
        if f.layout is not None:
            extent = f.layout.pieces(offset, offset + 1)[0][2]
            key = "header" if extent == HEADER else f.layout.keys[extent]
        drive = self.reader.route(f, offset)
        return {
            "file": f.relpath,
            "offset": offset,
            "tensor": tensor,
            "key": key._asdict() if isinstance(key, ExpertKey) else key,
            "drive": self.stats.names()[drive],
            "path": self.reader.replicas[drive].root,
            "valid_copies": [self.reader.replicas[i].root for i in f.replicas],
        }

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        return [REPLICAS_XATTR] if inode in self.files else []

    # -- every write path: read-only filesystem -----------------------------------------------

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _erofs  # type: ignore[assignment]
    write = create = setxattr = removexattr = _erofs  # type: ignore[assignment]


def _shadowed(parent: int, name: bytes) -> bool:
    return parent == ROOT_INO and name == CONTROL_DIR
