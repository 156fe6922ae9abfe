"""Per-drive counters and their two renderings: the one-line `stats` and `stats.json`."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from colifs import __version__
from colifs.health import Health
from colifs.logs import one_line
from colifs.replicas import Replica, ServedFile


class DriveCounters(Protocol):
    """What each drive delivered: counted by the pyfuse3 engine's reader (`Counters`) or by the native
    engine, in memory Python reads (`colifs.native.NativeCounters`)."""

    @property
    def bytes_served(self) -> Sequence[int]: ...

    @property
    def reads(self) -> Sequence[int]: ...

    @property
    def read_errors(self) -> Sequence[int]: ...

    @property
    def fallbacks(self) -> int: ...

    @property
    def layers(self) -> dict[str, list[int]]: ...

    @property
    def prefetch(self) -> dict[str, int]: ...

    def failed(self, drive: int) -> None: ...


class Counters:
    """The pyfuse3 engine's counters, kept by its reader on the loop's thread."""

    def __init__(self, n: int) -> None:
        self.bytes_served = [0] * n
        self.reads = [0] * n
        self.read_errors = [0] * n
        self.fallbacks = 0
        # Bytes per (stack.layer) per replica as routing decided them (before any fallback).
        self.layers: dict[str, list[int]] = {}
        self.prefetch: dict[str, int] = {}  # the pyfuse3 engine does not prefetch

    def served(self, drive: int, nbytes: int) -> None:
        self.bytes_served[drive] += nbytes
        self.reads[drive] += 1

    def failed(self, drive: int) -> None:
        self.read_errors[drive] += 1

    def fell_back(self) -> None:
        self.fallbacks += 1

    def routed(self, layer: str, drive: int, nbytes: int) -> None:
        row = self.layers.get(layer)
        if row is None:
            row = self.layers[layer] = [0] * len(self.reads)
        row[drive] += nbytes


class Stats:
    """Counters of what each drive actually delivered to the mount (a fallback counts on the primary)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        weights_source: str,
        mountpoint: str,
        counters: DriveCounters | None = None,
        engine: str = "pyfuse3",
    ) -> None:
        self.replicas = list(replicas)
        self.weights_source = weights_source
        self.mountpoint = mountpoint
        self.started = time.time()
        n = len(replicas)
        self.counters: DriveCounters = counters or Counters(n)
        self.last_error: list[str | None] = [None] * n
        self.warnings: deque[str] = deque(maxlen=50)
        self.kernel: dict[str, int | None] = {}  # readahead and FUSE queue, as read back from sysfs
        self.probe: list[dict] = []  # the startup bandwidth probe, when weights were probed
        self.routing = "stripe"
        self.engine = engine
        self.usage: dict = {"file": None}  # where usage is saved, and how that went
        self.partial: dict | None = None  # a partial mirror's routing: coverage, weights, prediction
        self.in_flight: Callable[[], list[int]] = lambda: [0] * n  # reads queued or running per drive
        self.health: list[Health] = [Health() for _ in replicas]  # replaced by the reader's

    @property
    def bytes_served(self) -> Sequence[int]:
        return self.counters.bytes_served

    @property
    def reads(self) -> Sequence[int]:
        return self.counters.reads

    @property
    def read_errors(self) -> Sequence[int]:
        return self.counters.read_errors

    @property
    def fallbacks(self) -> int:
        return self.counters.fallbacks

    # The pyfuse3 reader's calls (the native engine counts in its own memory).

    def served(self, drive: int, nbytes: int) -> None:
        assert isinstance(self.counters, Counters)
        self.counters.served(drive, nbytes)

    def failed(self, drive: int, problem: str) -> None:
        self.counters.failed(drive)
        self.last_error[drive] = problem

    def fell_back(self) -> None:
        assert isinstance(self.counters, Counters)
        self.counters.fell_back()

    def routed(self, layer: str, drive: int, nbytes: int) -> None:
        assert isinstance(self.counters, Counters)
        self.counters.routed(layer, drive, nbytes)

    def names(self) -> list[str]:
        mirrors = len(self.replicas) - 1
        return ["primary"] + (["mirror"] if mirrors == 1 else [f"mirror{i}" for i in range(1, mirrors + 1)])

    def line(self) -> str:
        """`MIRROR: primary 12.31 GB (4567 reads) | mirror 4.10 GB (1522 reads) | fallbacks 0`"""
        parts = [
            f"{name} {self.bytes_served[i] / 1e9:.2f} GB ({self.reads[i]} reads"
            + ("" if self.health[i].up else ", DOWN")
            + ")"
            for i, name in enumerate(self.names())
        ]
        return "MIRROR: " + " | ".join(parts) + f" | fallbacks {self.fallbacks}\n"

    def as_dict(self, files: Sequence[ServedFile]) -> dict:
        total = sum(self.bytes_served) or 1
        in_flight = self.in_flight()
        weight_sum = sum(r.weight for r in self.replicas)
        return {
            "version": __version__,
            "pid": os.getpid(),
            "mountpoint": self.mountpoint,
            "uptime_s": round(time.time() - self.started, 3),
            "weights_source": self.weights_source,
            "routing": self.routing,
            "engine": self.engine,
            "prefetch": self.counters.prefetch,
            "kernel": self.kernel,
            "probe": self.probe,
            "replicas": [
                {
                    "name": name,
                    "path": r.root,
                    "role": r.role,
                    "weight": r.weight,
                    "weight_share": r.weight / weight_sum,
                    "bytes_served": self.bytes_served[i],
                    "byte_share": self.bytes_served[i] / total,
                    "reads": self.reads[i],
                    "in_flight": in_flight[i],
                    "read_errors": self.read_errors[i],
                    "last_error": self.last_error[i],
                    **({"health": self.health[i].as_dict()} if i else {}),
                }
                for i, (r, name) in enumerate(zip(self.replicas, self.names(), strict=True))
            ],
            "fallbacks": self.fallbacks,
            "usage": self.usage,
            "partial_mirror": self.partial,
            "files": {
                f.relpath: {
                    "replicas": [self.replicas[i].root for i in f.replicas],
                    "vouched_by_receipt": [self.replicas[i].root for i in f.vouched if i in f.replicas],
                    "note": f.note,
                    "tensors_keyed": dict(f.layout.keying) if f.layout is not None else {},
                }
                for f in files
                if f.is_model
            },
            "layers_routed_bytes": dict(sorted(self.counters.layers.items())),
            "recent_warnings": list(self.warnings),
        }

    def json(self, files: Sequence[ServedFile]) -> str:
        return json.dumps(self.as_dict(files), indent=1) + "\n"


class KeepWarnings(logging.Handler):
    """Keeps the latest warnings in stats.json: a daemon's stderr is gone once it is ready."""

    def __init__(self, stats: Stats) -> None:
        super().__init__(logging.WARNING)
        self._stats = stats

    def emit(self, record: logging.LogRecord) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        self._stats.warnings.append(f"{stamp} {one_line(record.getMessage())}")
