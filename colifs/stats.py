"""Per-drive counters and their two renderings: the one-line `stats` and `stats.json`."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from colifs import __version__
from colifs.catalogue import ServedFile
from colifs.health import Health
from colifs.replicas import Replica


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
    def spilled(self) -> Sequence[int]:
        """Bytes the routes gave each drive that went to another, the drive having a backlog."""
        ...

    @property
    def fallbacks(self) -> int: ...

    @property
    def late_reads_skipped(self) -> int: ...

    @property
    def layers(self) -> dict[str, list[int]]: ...

    def grow(self) -> None:
        """One more drive (a mirror added while serving), counted from 0."""
        ...

    @property
    def fills(self) -> dict[str, int]: ...

    @property
    def passthrough(self) -> dict[str, int]: ...

    def failed(self, drive: int) -> None: ...


class Counters:
    """The pyfuse3 engine's counters, kept by its reader on the loop's thread."""

    def __init__(self, n: int) -> None:
        self.bytes_served = [0] * n
        self.reads = [0] * n
        self.read_errors = [0] * n
        self.spilled = [0] * n  # the pyfuse3 engine routes by the weights alone (no --routing queue)
        self.fallbacks = 0
        self.late_reads_skipped = 0  # a read given up on before it starts is cancelled, never run
        # Bytes per (stack.layer) per replica as routing decided them (before any fallback).
        self.layers: dict[str, list[int]] = {}
        self.fills: dict[str, int] = {}  # the pyfuse3 engine reads no fills
        self.passthrough: dict[str, int] = {}  # nor pass opens through to the kernel

    def grow(self) -> None:
        for per_drive in (
            self.bytes_served,
            self.reads,
            self.read_errors,
            self.spilled,
            *self.layers.values(),
        ):
            per_drive.append(0)

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


@dataclass(frozen=True)
class MountInfo:
    """What a mount is, decided before it serves."""

    mountpoint: str
    engine: str  # native or pyfuse3
    routing: str  # stripe or expert
    weights_source: str
    probe: tuple[dict, ...] = ()  # the startup bandwidth probe, when weights were probed
    partial: dict | None = None  # a partial mirror's routing: coverage, weights, prediction
    revision: str = "main"  # the Hugging Face cache revision a repository directory serves


def daemon_cpu(served: int) -> dict:
    """The daemon's CPU since it started (every thread's, user and system) and per GB it served:
    what the mount costs the machine next to what it delivers. Fills put pages into the page cache
    themselves, so their share of the memory cgroup's reclaim is in it too (docs/benchmarks.md,
    run 76)."""
    t = os.times()
    seconds = t.user + t.system
    per_gb = round(seconds / (served / 1e9), 4) if served else None
    return {"seconds": round(seconds, 3), "per_gb_served": per_gb}


class Stats:
    """Counters of what each drive actually delivered to the mount (a fallback counts on the primary),
    and the mount's state as its owners report it (health, queues, usage saving, kernel knobs)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        info: MountInfo,
        counters: DriveCounters,
        health: Sequence[Health],
        in_flight: Callable[[], list[int]],
        usage: Callable[[], dict],
        kernel: Callable[[], dict],
        warnings: Callable[[], list[str]],
        balance: Callable[[], dict],
        reloads: Callable[[], dict],
        loop: Callable[[], dict] = dict,
    ) -> None:
        self.replicas = replicas  # shared: a mirror added in a removed one's slot changes its root
        self.info = info
        self.started = time.time()
        self.counters = counters
        self.health = health  # [0], the primary's, is never failed
        self.in_flight = in_flight  # reads queued or running per drive
        self._usage = usage
        self._kernel = kernel
        self._warnings = warnings
        self._balance = balance  # the weights in force and the drives' measured rates
        self._reloads = reloads  # how many reloads ran, and what the last one changed
        self._loop = loop  # how late the daemon's trio loop runs (colifs.looplag)
        self.last_error: list[str | None] = [None] * len(replicas)
        self.control_socket: str | None = None  # where the daemon takes commands (colifs.control)
        self._lock = threading.Lock()  # per-drive state growing (changing) vs a snapshot of it

    def listening(self, path: str | None) -> None:
        """Where the daemon's control socket is (None: it has none), for stats.json: the clients
        take it from there."""
        self.control_socket = path

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

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """While a mirror joins (colifs mirror add), every per-drive list grows in turn: a snapshot
        (the native engine renders one on a FUSE thread) waits until all have."""
        with self._lock:
            yield

    def grow(self) -> None:
        """One more drive (a mirror added while serving, under `changing`): its counters from 0."""
        self.counters.grow()
        self.last_error.append(None)

    def set_partial(self, partial: dict | None) -> None:
        """The partial-mirror routing, computed again (a reload changed the copies)."""
        self.info = replace(self.info, partial=partial)

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
        with self._lock:
            return self._line()

    def _line(self) -> str:
        parts = [
            f"{name} {self.bytes_served[i] / 1e9:.2f} GB ({self.reads[i]} reads"
            + (", REMOVED" if self.health[i].removed_at else "" if self.health[i].up else ", DOWN")
            + ")"
            for i, name in enumerate(self.names())
        ]
        return "MIRROR: " + " | ".join(parts) + f" | fallbacks {self.fallbacks}\n"

    def as_dict(self, files: Sequence[ServedFile]) -> dict:
        with self._lock:
            return self._as_dict(files)

    def _as_dict(self, files: Sequence[ServedFile]) -> dict:
        total = sum(self.bytes_served) or 1
        in_flight = self.in_flight()
        balance = self._balance()
        return {
            "version": __version__,
            "pid": os.getpid(),
            "uid": os.geteuid(),
            "control_socket": self.control_socket,
            "mountpoint": self.info.mountpoint,
            "uptime_s": round(time.time() - self.started, 3),
            "weights_source": self.info.weights_source,
            "revision": self.info.revision,
            "routing": self.info.routing,
            "engine": self.info.engine,
            "cpu": daemon_cpu(sum(self.bytes_served)),
            "fills": self.counters.fills,
            "passthrough": self.counters.passthrough,
            "kernel": self._kernel(),
            "probe": list(self.info.probe),
            "balance": balance,
            "replicas": [
                {
                    "name": name,
                    "path": r.root,
                    "role": r.role,
                    "weight": balance["weights"][i],
                    "weight_share": balance["shares"][i],
                    "measured_mb_per_s": balance["measured_mb_per_s"][i],
                    "saturated_mb_per_s": balance["saturated_mb_per_s"][i],
                    "waited_alone": balance["alone"][i],
                    "bytes_served": self.bytes_served[i],
                    "byte_share": self.bytes_served[i] / total,
                    "reads": self.reads[i],
                    "in_flight": in_flight[i],
                    "bytes_spilled": self.counters.spilled[i],
                    "read_errors": self.read_errors[i],
                    "last_error": self.last_error[i],
                    **({"health": self.health[i].as_dict()} if i else {}),
                }
                for i, (r, name) in enumerate(zip(self.replicas, self.names(), strict=True))
            ],
            "fallbacks": self.fallbacks,
            "late_reads_skipped": self.counters.late_reads_skipped,
            "usage": self._usage(),
            "partial_mirror": self.info.partial,
            "reload": self._reloads(),
            "loop": self._loop(),
            "files": {
                f.relpath: {
                    "replicas": [self.replicas[i].root for i in f.copies],
                    "vouched_by_receipt": [self.replicas[i].root for i in f.vouched if i in f.copies],
                    "note": f.note,
                    "tensors_keyed": dict(f.layout.keying) if f.layout is not None else {},
                }
                for f in files
                if f.is_model
            },
            "layers_routed_bytes": dict(sorted(self.counters.layers.items())),
            "recent_warnings": self._warnings(),
        }

    def json(self, files: Sequence[ServedFile]) -> str:
        return json.dumps(self.as_dict(files), indent=1) + "\n"
