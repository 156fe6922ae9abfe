"""A fault-injecting pass-through FUSE filesystem, to serve a mirror that misbehaves on demand.

    python tests/faultfs.py SOURCE MOUNTPOINT CONTROL

Serves the files of the flat directory SOURCE read-only. Every read looks at the CONTROL file:
`ok` passes the bytes through, `eio` fails with EIO, `short` returns half of them, `hang` holds
the read until the mode changes (then answers it as the new mode says), `hang-open` holds every
open until the mode changes (reads pass), `hang-open-direct` only the O_DIRECT ones (a reader's
open through a mount waits while the mount's own header reads pass), `stale` fails (EIO) every
read on a file opened before it was set, as the old descriptors of a filesystem mounted again do
(new opens read), `hang-flush` holds every close (FLUSH) until the mode changes, `hang-all` holds
every call that reaches the file system (getattr of its root included: a mount whose drive stopped
answering). Files are
opened with direct_io so that no read is answered from the kernel's cache: a fault takes effect
at once. `slow MBPS` passes the bytes through at MBPS MB/s in all (a drive that slowed down).
Test tool only: it reads CONTROL on the loop thread (the data on worker threads).
"""

from __future__ import annotations

import errno
import os
import sys

import pyfuse3
import trio


class FaultFS(pyfuse3.Operations):
    def __init__(self, source: str, control: str) -> None:
        super().__init__()
        self.source = source
        self.control = control
        names = sorted(os.listdir(source))
        self.inodes = {os.fsencode(n): i + 2 for i, n in enumerate(names)}
        self.paths = {i + 2: os.path.join(source, n) for i, n in enumerate(names)}
        self.fds: dict[int, int] = {}
        self.free_at = 0.0  # `slow`: when the "drive" has served what it was asked so far
        self.opened: dict[int, int] = {}  # fh -> the open's serial number
        self.serial = 0
        self.last_mode = "ok"
        self.stale_before = 0  # `stale`: opens with a lower serial fail their reads

    def _mode(self) -> str:
        with open(self.control) as f:
            mode = f.read().strip()
        if mode == "stale" and self.last_mode != "stale":
            self.stale_before = self.serial + 1
        self.last_mode = mode
        return mode

    async def _unless_hung(self) -> None:
        while self._mode() == "hang-all":
            await trio.sleep(0.05)

    async def getattr(self, inode: int, ctx: object = None) -> pyfuse3.EntryAttributes:
        await self._unless_hung()
        st = os.lstat(self.source if inode == pyfuse3.ROOT_INODE else self.paths[inode])
        a = pyfuse3.EntryAttributes()
        for name in ("st_mode", "st_size", "st_uid", "st_gid", "st_mtime_ns", "st_ctime_ns", "st_atime_ns"):
            setattr(a, name, getattr(st, name))
        a.st_ino = inode
        a.st_nlink = 1
        a.entry_timeout = a.attr_timeout = 0
        return a

    async def lookup(self, parent: int, name: bytes, ctx: object = None) -> pyfuse3.EntryAttributes:
        if name not in self.inodes:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await self.getattr(self.inodes[name])

    async def opendir(self, inode: int, ctx: object) -> int:
        await self._unless_hung()
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        items = sorted(self.inodes.items())
        for i in range(start_id, len(items)):
            name, ino = items[i]
            if not pyfuse3.readdir_reply(token, name, await self.getattr(ino), i + 1):
                break

    async def open(self, inode: int, flags: int, ctx: object) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        while (mode := self._mode()) in ("hang-open", "hang-all") or (
            mode == "hang-open-direct" and flags & os.O_DIRECT
        ):
            await trio.sleep(0.05)
        fd = os.open(self.paths[inode], os.O_RDONLY)
        self.fds[fd] = inode
        self.serial += 1
        self.opened[fd] = self.serial
        return pyfuse3.FileInfo(fh=fd, direct_io=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        mode = self._mode()
        while mode in ("hang", "hang-all"):
            await trio.sleep(0.05)
            mode = self._mode()
        if mode == "eio" or (mode == "stale" and self.opened.get(fh, 0) < self.stale_before):
            raise pyfuse3.FUSEError(errno.EIO)
        if mode.startswith("slow "):
            self.free_at = max(trio.current_time(), self.free_at) + size / (float(mode.split()[1]) * 1e6)
            await trio.sleep_until(self.free_at)
        data = await trio.to_thread.run_sync(os.pread, fh, size, off)  # reads overlap, as on a drive
        return data[: len(data) // 2] if mode == "short" else data

    async def flush(self, fh: int) -> None:
        while self._mode() == "hang-flush":
            await trio.sleep(0.05)

    async def release(self, fh: int) -> None:
        self.fds.pop(fh, None)
        self.opened.pop(fh, None)
        os.close(fh)

    async def statfs(self, ctx: object) -> pyfuse3.StatvfsData:
        await self._unless_hung()
        return pyfuse3.StatvfsData()


def main() -> None:
    source, mountpoint, control = sys.argv[1:4]
    pyfuse3.init(FaultFS(source, control), mountpoint, {"ro", "fsname=faultfs"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close()


if __name__ == "__main__":
    main()
