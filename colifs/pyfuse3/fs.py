"""The pyfuse3 engine's Operations: what `Namespace` shows, reads routed by `Reader`, read-only.

The class receives its parts (namespace, served files, reader), so tests can `await ops.read()`
without a mount. Storage errors become FUSE errnos here, at the boundary, and nowhere else.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pyfuse3

from colifs.backing import BLOCK
from colifs.boundary import request_errno
from colifs.namespace import CONTROL_DIR, STATS_INO, STATS_JSON_INO, Attr, Namespace
from colifs.pyfuse3.reader import OpenFile, Reader

__all__ = ["CONTROL_DIR", "STATS_INO", "ColiFS"]

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def fuse_boundary(fn: F) -> F:
    """Every handler's failure becomes an errno here, once (colifs.boundary): never an exit."""

    @functools.wraps(fn)
    async def wrapper(*args: Any) -> Any:
        try:
            return await fn(*args)
        except pyfuse3.FUSEError:
            raise
        except Exception as e:
            raise pyfuse3.FUSEError(request_errno(e, fn.__name__)) from None

    return wrapper  # type: ignore[return-value]


async def _erofs(*_: Any) -> None:
    raise pyfuse3.FUSEError(errno.EROFS)


def _entry(a: Attr) -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_ino = a.ino
    e.st_mode, e.st_nlink, e.st_uid, e.st_gid = a.mode, a.nlink, a.uid, a.gid
    e.st_size, e.st_blocks = a.size, a.blocks
    # The page size, as ext4 reports it: O_DIRECT readers align their reads to st_blksize (llama.cpp
    # rounds every tensor out to it), so 1 MiB made them read 5% more and each small tensor as 1 MiB.
    e.st_blksize = BLOCK
    e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = a.atime_ns, a.mtime_ns, a.ctime_ns
    e.entry_timeout = e.attr_timeout = a.timeout
    return e


class ColiFS(pyfuse3.Operations):
    """Read-only view of the primary's tree whose reads are routed by `Reader`."""

    def __init__(self, ns: Namespace, reader: Reader, offload: Callable[..., Awaitable[Any]]) -> None:
        super().__init__()
        self.ns = ns
        self.files = ns.files
        self.reader = reader
        self._offload = offload  # runs a blocking call (an xattr reads a header) off the request loop
        self._handles: dict[int, OpenFile | bytes] = {}
        self._direct: set[int] = set()  # handles opened O_DIRECT: their readers wait for each read
        self._next_fh = 1
        self._entries = {
            ino: _entry(ns.attr(ino)) for ino in ns.inodes() if ino not in (STATS_INO, STATS_JSON_INO)
        }

    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        if ino in (STATS_INO, STATS_JSON_INO):
            return _entry(self.ns.attr(ino))
        try:
            return self._entries[ino]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    # -- namespace ---------------------------------------------------------------------------

    @fuse_boundary
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self._attr(self.ns.lookup(parent_inode, name))

    @fuse_boundary
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr(inode)

    @fuse_boundary
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self.ns.tree.nodes.get(inode)
        if node is None or not stat.S_ISLNK(node.st.st_mode):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return node.target

    @fuse_boundary
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        self.ns.children(inode)  # raises ENOTDIR for anything else
        return inode

    @fuse_boundary
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        children = self.ns.children(fh)
        for i in range(start_id, len(children)):
            name, ino = children[i]
            if not pyfuse3.readdir_reply(token, name, self._attr(ino), i + 1):
                break

    @fuse_boundary
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = self.ns.statfs()
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
            self._handles[fh] = self.ns.snapshot(inode, ctx.uid)
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        f = self.files.get(inode)
        if f is None:
            raise pyfuse3.FUSEError(errno.EISDIR if inode in self.ns.tree.nodes else errno.ENOENT)
        opened = await self.reader.open(f)
        fh = self._new_fh()  # taken after the await: concurrent opens never share a number
        self._handles[fh] = opened
        if flags & os.O_DIRECT:
            self._direct.add(fh)
        # keep_cache: the files are immutable, so the page cache stays valid across opens.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    @fuse_boundary
    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray | memoryview:
        handle = self._handles[fh]
        if isinstance(handle, bytes):  # a control file's snapshot
            return handle[off : off + size]
        return await self.reader.read(handle, off, size, fh in self._direct)

    @fuse_boundary
    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh)
        self._direct.discard(fh)
        if isinstance(handle, OpenFile):
            self.reader.release(handle)

    @fuse_boundary
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return await self._offload(self.ns.xattr, inode, name)

    @fuse_boundary
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        return self.ns.xattr_names(inode)

    # -- every write path: read-only filesystem -----------------------------------------------

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _erofs  # type: ignore[assignment]
    write = create = setxattr = removexattr = _erofs  # type: ignore[assignment]
