"""The I/O layer under the read path, swappable (httpx-transport style) so tests can inject faults.

`OsIO` is the real one: read-only file descriptors and positional reads that loop over short
reads. `colifs.fakeio.FaultyIO` wraps it for tests.
"""

from __future__ import annotations

import os
from typing import Protocol


class BackingIO(Protocol):
    """What the read path needs from the drives. Methods block: call them on a worker thread."""

    def open(self, path: str) -> int: ...

    def pread_into(self, fd: int, view: memoryview, offset: int) -> int: ...

    def close(self, fd: int) -> None: ...


class OsIO:
    """Plain POSIX I/O. Files are only ever opened O_RDONLY: a mirror is never written."""

    def open(self, path: str) -> int:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def pread_into(self, fd: int, view: memoryview, offset: int) -> int:
        """Fill `view` from `offset`; fewer bytes only at end of file. EINTR is retried by Python."""
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
        return got

    def close(self, fd: int) -> None:
        os.close(fd)
