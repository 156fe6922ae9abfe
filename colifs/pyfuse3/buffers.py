"""Reusable page-aligned read buffers: no allocation, zeroing or page faults per request.

A fresh 1 MiB buffer per request costs ~256 page faults plus zeroing, most of the daemon's CPU.
Pooled buffers are anonymous mmaps (page-aligned, as O_DIRECT needs).

When may a buffer be reused? pyfuse3 replies to a read synchronously right after the handler
returns (`fuse_read_async`: `buf = await ops.read(...)`, then `fuse_reply_buf` with no await in
between), so a buffer handed back with `lend()` is free by the time any other task runs: the next
`take()` reclaims it.
"""

from __future__ import annotations

import mmap

from colifs.backing import BLOCK, align_up

REQUEST = 1 << 20  # the largest FUSE read request (libfuse 3.14 negotiates max_pages=256)
BUFFER = REQUEST + 2 * BLOCK  # a request rounded out to BLOCK at both ends


class BufferPool:
    """Buffers of BUFFER bytes; larger requests (never sent by FUSE) get a one-off buffer."""

    def __init__(self, keep: int = 128) -> None:
        self._free: list[mmap.mmap] = []
        self._lent: list[mmap.mmap] = []
        self._keep = keep

    def take(self, nbytes: int) -> mmap.mmap:
        if self._lent:
            self._free.extend(self._lent[: self._keep - len(self._free)])
            self._lent.clear()
        if nbytes > BUFFER:
            return mmap.mmap(-1, align_up(nbytes))
        return self._free.pop() if self._free else mmap.mmap(-1, BUFFER)

    def lend(self, buf: mmap.mmap) -> None:
        """`buf` is being returned to pyfuse3: reusable from the next `take()` on."""
        if len(buf) == BUFFER:
            self._lent.append(buf)
