"""Reading the copies, for both engines: the I/O layer under the pyfuse3 engine's read path and
under every check read (a down mirror's, either engine's), and what both say of a copy (it
changed, it timed out). Swappable (httpx-transport style) so tests can inject faults.

`OsIO` is the real one: read-only descriptors and positional reads that loop over short reads.
With `direct=True` files are opened O_DIRECT where the filesystem allows it: the mount's own page
cache is then the only cache (no double caching) and the drive DMAs straight into our buffers.
Callers read BLOCK-aligned ranges into page-aligned buffers, as O_DIRECT requires.
`tests/fakeio.py` wraps it for tests.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from typing import Protocol

from colifs.replicas import Identity, identity

log = logging.getLogger("colifs")
BLOCK = 4096  # O_DIRECT alignment that is safe on every filesystem here


def align_down(n: int) -> int:
    return n & ~(BLOCK - 1)


def align_up(n: int) -> int:
    return (n + BLOCK - 1) & ~(BLOCK - 1)


class BackingIO(Protocol):
    """What the read path needs from the drives. Methods block: call them on a worker thread."""

    def open(self, path: str) -> int: ...

    def pread_into(self, fd: int, view: memoryview, offset: int) -> int: ...

    def pread_nowait(self, fd: int, view: memoryview, offset: int) -> int:
        """What can be read without blocking (page-cache hits); never blocks, may return 0."""
        ...

    def identity(self, fd: int) -> Identity:
        """(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) of an open file: has it changed?"""
        ...

    def close(self, fd: int) -> None: ...


class OsIO:
    """Plain POSIX I/O. Files are only ever opened O_RDONLY: a mirror is never written."""

    def __init__(self, direct: bool = True) -> None:
        self.direct = direct
        self._refused: set[int] = set()  # st_dev of filesystems that refused O_DIRECT
        self._direct_fds: set[int] = set()

    def open(self, path: str) -> int:
        flags = os.O_RDONLY | os.O_CLOEXEC
        if self.direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT)
                self._direct_fds.add(fd)
                return fd
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
            fd = os.open(path, flags)
            dev = os.fstat(fd).st_dev
            if dev not in self._refused:
                self._refused.add(dev)
                log.warning("%s: its filesystem refuses O_DIRECT; reading it buffered", path)
            return fd
        return os.open(path, flags)

    def pread_into(self, fd: int, view: memoryview, offset: int) -> int:
        """Fill `view` from `offset`; fewer bytes only at end of file. EINTR is retried by Python."""
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            got += n
            if n == 0 or (n % BLOCK and fd in self._direct_fds):
                break  # end of file (an O_DIRECT read is short only there)
        return got

    def pread_nowait(self, fd: int, view: memoryview, offset: int) -> int:
        """RWF_NOWAIT: the part already in page cache, read on the caller's thread (no hand-off).

        O_DIRECT reads always go to the drive, so they are never tried here.
        """
        if fd in self._direct_fds:
            return 0
        try:
            return os.preadv(fd, [view], offset, os.RWF_NOWAIT)
        except OSError:  # EAGAIN (not cached), or a real error the blocking path will report
            return 0

    def identity(self, fd: int) -> Identity:
        return identity(os.fstat(fd))

    def close(self, fd: int) -> None:
        self._direct_fds.discard(fd)
        os.close(fd)


class Changed(Exception):
    """A mirror copy is no longer the file validated at mount (or reload): `expected`, what it was
    checked against (a reload may have validated another copy since)."""

    def __init__(self, what: str, expected: Identity) -> None:
        super().__init__(what)
        self.expected = expected


class TimedOut(Exception):
    """A drive did not answer within its timeout."""


def what_changed(before: Identity, now: Identity) -> str:
    names = ("device", "inode", "size", "mtime", "ctime")
    return ", ".join(f"{n} {a} -> {b}" for n, a, b in zip(names, before, now, strict=True) if a != b)


def check_unchanged(io: BackingIO, fd: int, expect: Identity) -> None:
    """Raise Changed if the open mirror copy is no longer the one validated at mount."""
    now = io.identity(fd)
    if now != expect:
        raise Changed(what_changed(expect, now), expect)


def open_checked(io: BackingIO, path: str, expect: Identity) -> int:
    """Open a mirror copy, if it is still the one validated at mount (blocks)."""
    fd = io.open(path)
    try:
        check_unchanged(io, fd, expect)
    except Changed:
        io.close(fd)
        raise
    return fd


def check_read(io: BackingIO, path: str, expect: Identity, offset: int) -> None:
    """A down mirror's health check: open, read one block, close (blocks; its own buffer, so it
    may be given up on)."""
    fd = open_checked(io, path, expect)
    try:
        buf = mmap.mmap(-1, BLOCK)
        want = min(BLOCK, expect[2] - offset)
        if io.pread_into(fd, memoryview(buf), offset) < want:
            raise OSError(errno.EIO, f"short read at {offset}")
    finally:
        io.close(fd)
