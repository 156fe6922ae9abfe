"""The reference for the cached-ceiling benchmark: the least a pyfuse3 filesystem can do.

Serves every file of one flat directory read-only with an inline `os.pread` per request (no
routing, no threads). Usage: python contrib/bench/bare_fs.py SOURCE MOUNTPOINT (unmount with
fusermount3 -u).
"""

from __future__ import annotations

import errno
import os
import stat
import sys

import pyfuse3
import trio


class BareFS(pyfuse3.Operations):
    def __init__(self, source: str) -> None:
        super().__init__()
        names = sorted(os.listdir(source))
        self.inodes = {os.fsencode(n): i + 2 for i, n in enumerate(names)}
        self.fds = {i + 2: os.open(os.path.join(source, n), os.O_RDONLY) for i, n in enumerate(names)}

    async def getattr(self, inode: int, ctx: object = None) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.entry_timeout = a.attr_timeout = 300
        if inode == pyfuse3.ROOT_INODE:
            a.st_mode = stat.S_IFDIR | 0o555
        else:
            a.st_mode = stat.S_IFREG | 0o444
            a.st_size = os.fstat(self.fds[inode]).st_size
        return a

    async def lookup(self, parent: int, name: bytes, ctx: object = None) -> pyfuse3.EntryAttributes:
        if name not in self.inodes:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await self.getattr(self.inodes[name])

    async def open(self, inode: int, flags: int, ctx: object) -> pyfuse3.FileInfo:
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return os.pread(self.fds[fh], size, off)


def main() -> None:
    pyfuse3.init(BareFS(sys.argv[1]), sys.argv[2], {"ro", "fsname=barefs"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close()


if __name__ == "__main__":
    main()
