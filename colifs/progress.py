"""Progress on stderr for long work (stage, verify --deep): bytes, rate, ETA.

On a terminal one line is redrawn at most 4 times a second; otherwise (a log, CI) a line every
10 s, so logs stay short. Quiet mode prints nothing. Thread-safe: several readers may add.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from colifs.units import human


class Progress:
    def __init__(self, total: int, label: str, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.total = total
        self.label = label
        self.done = 0
        self.quiet = quiet
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._start = self._last = time.monotonic()
        self._lock = threading.Lock()
        self.note = ""

    def working_on(self, note: str) -> None:
        """What the progress line names now (a shard)."""
        self.note = note

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if not self.quiet and now - self._last >= (0.25 if self._tty else 10.0):
                self._last = now
                self._draw(now, final=False)

    def finish(self) -> None:
        if not self.quiet:
            self._draw(time.monotonic(), final=True)

    def _draw(self, now: float, final: bool) -> None:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        pct = 100 * self.done / self.total if self.total else 100.0
        eta = "" if final else f", ETA {int(left // 60)}:{int(left % 60):02d}"
        line = (
            f"{self.label}: {human(self.done)} of {human(self.total)} ({pct:.0f}%), "
            f"{rate / 1e6:.0f} MB/s{eta}{(' ' + self.note) if self.note and not final else ''}"
        )
        if self._tty:
            self._stream.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self._stream.write(line + "\n")
        self._stream.flush()
