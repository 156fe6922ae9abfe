"""The pyfuse3 engine's lifecycle: mount `ColiFS` with pyfuse3, serve every request as a task on
one trio thread, unmount. The portable reference the native engine is held to."""

from __future__ import annotations

from collections.abc import Sequence

import pyfuse3

from colifs.pyfuse3.fs import ColiFS
from colifs.pyfuse3.reader import Reader
from colifs.pyfuse3.workers import DriveWorkers

# Requests the daemon takes off /dev/fuse at once. A request waiting for its drive holds one (a
# coroutine, cheap); with too few, one slow drive's backlog would hold them all and starve the
# other drives (head-of-line blocking). The per-drive thread count bounds the real I/O.
MAX_TASKS = 1024


class Pyfuse3Engine:
    """Mounts the operations and runs pyfuse3's loop; owns the per-drive worker threads."""

    def __init__(
        self,
        ops: ColiFS,
        reader: Reader,
        workers: list[DriveWorkers],
        mountpoint: str,
        options: Sequence[str],
    ) -> None:
        self.ops = ops
        self.reader = reader
        self.workers = workers  # shared with the reader: a mirror added while serving adds its own
        self.mountpoint = mountpoint
        self.options = set(options)
        self._mounted = False

    def mount(self) -> None:
        """Raises RuntimeError when the kernel refuses."""
        pyfuse3.init(self.ops, self.mountpoint, self.options)
        self._mounted = True

    async def run(self) -> None:
        """Serve until unmounted (from outside, or after `stop`)."""
        await pyfuse3.main(max_tasks=MAX_TASKS)

    async def watch(self) -> None:
        await self.reader.watch()

    def stop(self) -> None:
        pyfuse3.terminate()

    def close(self) -> None:
        if self._mounted:
            self._mounted = False
            pyfuse3.close(unmount=True)
        for w in self.workers:
            w.close()
        for w in self.reader.retired_workers:  # told to end already: a call stuck there is left behind
            w.close(0.0)
