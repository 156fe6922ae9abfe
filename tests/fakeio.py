"""A fault-injecting BackingIO for tests (like httpx.MockTransport): real reads, chosen failures.

io = FaultyIO()
io.fail("/second/m", "eio")      # every read under that root raises EIO
io.fail("/second/m", "short")    # ... or returns half of what was asked
io.fail("/second/m", "hang")     # reads block until the fault changes, then fill the buffer
                                 # with 0xEE: a late answer only a given-up read may get away with
io.fail("/second/m", None)       # healthy again
"""

from __future__ import annotations

import errno
import os
import time
from typing import Literal

from colifs.backing import OsIO, align_down

Fault = Literal["eio", "short", "open", "hang"] | None


class FaultyIO(OsIO):
    def __init__(self, direct: bool = True) -> None:
        super().__init__(direct)
        self._faults: dict[str, Fault] = {}
        self._paths: dict[int, str] = {}
        self.reads: dict[str, int] = {}  # reads per root, to check where requests went

    def fail(self, root: str, fault: Fault) -> None:
        self._faults[root] = fault

    def _fault(self, path: str) -> tuple[str | None, Fault]:
        for root, fault in self._faults.items():
            if path.startswith(root.rstrip("/") + "/"):
                return root, fault
        return None, None

    def open(self, path: str) -> int:
        if self._fault(path)[1] == "open":
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        fd = super().open(path)
        self._paths[fd] = path
        return fd

    def pread_into(self, fd: int, view: memoryview, offset: int) -> int:
        path = self._paths[fd]
        root, fault = self._fault(path)
        key = root or os.path.dirname(path)
        self.reads[key] = self.reads.get(key, 0) + 1
        if fault == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        if fault == "short":
            return super().pread_into(fd, view[: align_down(len(view) // 2)], offset)
        if fault == "hang":
            while self._fault(path)[1] == "hang":
                time.sleep(0.01)
            view[:] = b"\xee" * len(view)
            return len(view)
        return super().pread_into(fd, view, offset)

    def pread_nowait(self, fd: int, view: memoryview, offset: int) -> int:
        """A faulty root never answers from cache: its reads reach the injected fault."""
        if self._fault(self._paths[fd])[1] is not None:
            return 0
        return super().pread_nowait(fd, view, offset)

    def close(self, fd: int) -> None:
        self._paths.pop(fd, None)
        super().close(fd)
