"""Builds a mount's whole object graph from its configuration, in one place: `serve` mounts what
this returns, and the tests drive the same graph without a mount (`await asm.ops.read(...)`).

Each part receives what it needs at construction; state has one owner (health: the engine that
reads; usage: the tally or the native counters, saved by the recorder; kernel knobs: Tuning),
and `Stats` only asks them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from colifs.backing import BackingIO, OsIO
from colifs.balance import Activity, Adaptive, Balancer
from colifs.catalogue import ServedFile, build_files, describe, partial_weights, traffic_by_copies
from colifs.checks import check_mountpoint, check_roots
from colifs.config import MountConfig, mount_options
from colifs.devices import one_drive
from colifs.health import Health
from colifs.kernel import Tuning
from colifs.logs import RecentWarnings
from colifs.looplag import LoopLag
from colifs.namespace import Namespace
from colifs.probe import ProbeResult, probe, read_wait, table, weights_from
from colifs.readplan import Router
from colifs.recorder import Tally, UsageRecorder, hidden, load_history, usage_file
from colifs.reload import Reloader, Reloads, Weight
from colifs.replicas import Identity, Replica
from colifs.stats import Counters, DriveCounters, MountInfo, Stats
from colifs.tree import Tree
from colifs.usage import Usage

if TYPE_CHECKING:
    from colifs.pyfuse3.reader import Reader
    from colifs.pyfuse3.workers import DriveWorkers

log = logging.getLogger("colifs")


class _Membership(Protocol):
    """What an engine does when a mirror joins or leaves while serving (colifs mirror add/remove)."""

    def set_root(self, index: int, root: str) -> None: ...  # a removed mirror's slot, another directory

    def add_drive(self, root: str, weights: list[float]) -> None: ...  # one more, no copy on it yet

    # A removed mirror's slot gets a generation of its own; what counts the calls left in the old one.
    def retire_drive(self, index: int) -> Callable[[], int]: ...


class Engine(Protocol):
    """What `serve` runs: either engine, built but not mounted."""

    def mount(self) -> None: ...  # RuntimeError when the kernel refuses

    async def run(self) -> None: ...  # serves until unmounted (or stopped)

    async def watch(self) -> None: ...  # health checks for the life of the mount

    def stop(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Assembly:
    """A mount, built: what `serve` needs, and what tests look at."""

    mountpoint: str
    stats: Stats
    engine: Engine
    recorder: UsageRecorder
    tuning: Tuning
    adaptive: Adaptive
    reloader: Reloader
    loop: LoopLag  # how late the trio loop runs (stats.json `loop`): `serve` runs its task


@dataclass
class _Routing:
    replicas: list[Replica]  # with their weights (probed, when they were)
    weights: list[float]  # for the files the mirrors hold (partial mirrors get more)
    probe: tuple[dict, ...]
    partial: dict | None
    by_set: dict[tuple[int, ...], float] | None  # traffic per set of copies, when mirrors are partial
    probed_mb_per_s: float | None = None  # the drives' MB/s added, when the probe measured every one

    def probed_rates(self) -> list[float | None]:
        """Each drive's probed bytes/s (None: not probed)."""
        by_index = {p["path"]: p["mb_per_s"] for p in self.probe}
        return [by_index[r.root] * 1e6 if by_index.get(r.root) else None for r in self.replicas]

    def held(self, weights: list[float]) -> list[float]:
        """Plain weights -> the weights for the files the mirrors hold (partial mirrors get more)."""
        return weights if self.by_set is None else partial_weights(weights, self.by_set)[0]

    def place(self, root: str, weight: float, index: int | None) -> int:
        """A mirror directory joins (colifs mirror add): in a removed one's slot, or (None) in a new
        one; its index. Every part holds this one list of replicas, so each sees it."""
        if index is None:
            self.replicas.append(Replica(len(self.replicas), root, weight))
            return len(self.replicas) - 1
        self.replicas[index] = replace(self.replicas[index], root=root)
        return index

    def recount(self, files: Mapping[int, ServedFile], history: Usage, weights: list[float]) -> None:
        """The traffic per set of copies (at mount, and again once a reload changed the copies),
        and the weights for the files the mirrors hold, from the plain `weights`."""
        nrep = len(self.replicas)
        self.by_set = traffic_by_copies(files, history, nrep) if nrep > 1 and history else None
        self.partial = None if self.by_set is None else partial_weights(weights, self.by_set)[1]
        self.weights = self.held(weights)


def assemble(
    cfg: MountConfig, io: BackingIO | None = None, warnings: RecentWarnings | None = None
) -> Assembly:
    """Check the paths, build the catalogue and routing, and wire the engine `cfg` names. `io` is the
    pyfuse3 engine's backing I/O (tests inject faults there); `warnings` feeds stats.json."""
    replicas = check_roots([cfg.primary, *cfg.mirrors], cfg.weights, revision=cfg.revision)
    mnt = check_mountpoint(cfg.mountpoint, [r.root for r in replicas])
    usage_path = usage_file(cfg.usage, cfg.usage_file, replicas)
    t0 = time.monotonic()
    tree = Tree(replicas[0].root, hidden(usage_path, replicas[0].root), cfg.store_roots)
    files = build_files(tree, replicas)
    history, saving = load_history(usage_path)
    log.debug("built in %.3f s: %d nodes, %d files", time.monotonic() - t0, len(tree.nodes), len(files))
    groups = one_drive([r.root for r in replicas])
    routing = _routing(cfg, replicas, files, history, groups)
    health = [Health() for _ in routing.replicas]  # [0], the primary's, is never failed
    router = Router(routing.weights, cfg.routing != "expert", health)
    info = MountInfo(
        mnt, cfg.engine, cfg.routing, cfg.weights_source, routing.probe, routing.partial, cfg.revision
    )
    # Copies on one drive measure each other's load: their rates could not move a split.
    adaptive = cfg.adaptive_weights and not groups
    if cfg.adaptive_weights and groups:
        log.info("adaptive weights: off, copies share a drive; the weights stay as mounted")
    # Queue routing evens out backlogs itself: there only readers waiting on one drive move the split.
    balancer = Balancer(
        [r.weight for r in routing.replicas], fixed=not adaptive, by_utilization=cfg.routing != "queue"
    )
    cfg = replace(cfg, knobs=cfg.knobs.for_drives(routing.probed_mb_per_s))
    if cfg.knobs.by_speed:
        log.info("readahead %d KiB: %s", cfg.knobs.read_ahead_kb, cfg.knobs.why)
    parts = _Parts(
        cfg, mnt, tree, files, routing, info, health, router, balancer, warnings or RecentWarnings(),
        history, Reloads(), groups,
    )  # fmt: skip
    if cfg.engine == "native":
        return parts.native(usage_path, saving, history.runs)
    return parts.pyfuse3(usage_path, saving, history.runs, io or OsIO(direct=cfg.backing_io == "direct"))


TIMING_PROBE_S = 0.3  # s per drive: a probe for the drives' rates alone (no weights to choose)


def _timed(
    cfg: MountConfig,
    replicas: list[Replica],
    files: Mapping[int, ServedFile],
    groups: list[list[int]],
    weigh: bool,
) -> list[ProbeResult]:
    """The drives' rates: a probe long enough to weigh them, or (weights given, or one drive) a short
    one for the native engine, whose fills, passthrough (colifs.depth) and readahead (colifs.kernel)
    follow the drives' speed from the first open: there the order of magnitude is enough."""
    if cfg.probe_seconds <= 0 or not (weigh or cfg.engine == "native"):
        return []
    seconds = cfg.probe_seconds if weigh else min(cfg.probe_seconds, TIMING_PROBE_S)
    probed = probe(replicas, list(files.values()), seconds, groups)
    for line in table(probed).splitlines():
        if weigh or not line.startswith("suggested:"):
            log.info("probe: %s", line)
    return probed


def _routing(
    cfg: MountConfig,
    replicas: list[Replica],
    files: Mapping[int, ServedFile],
    history: Usage,
    groups: list[list[int]],
) -> _Routing:
    """The weights: given, or probed; raised for the mirrors' files when mirrors are partial."""
    weigh = cfg.weights is None and len(replicas) > 1
    probed = _timed(cfg, replicas, files, groups, weigh)
    speeds = weights_from(probed) if probed else []
    if weigh and speeds:
        replicas = [replace(r, weight=w) for r, w in zip(replicas, speeds, strict=True)]
    log.info("%s", describe(replicas, cfg.weights_source, files))
    plain = [r.weight for r in replicas]
    measured = all(p.mb_per_s for p in probed) and bool(probed)
    shown = tuple(p.shown() for p in probed)
    routing = _Routing(replicas, plain, shown, None, None, sum(speeds) if measured else None)
    routing.recount(files, history, plain)
    if routing.partial is not None:
        _say_partial(routing.partial, routing.weights)
    return routing


def _say_partial(partial: dict, weights: list[float]) -> None:
    log.info(
        "partial mirror(s): holding %s of the traffic in the usage history; weights %s; "
        "expected byte split %s",
        " / ".join(f"{100 * x:.0f}%" for x in partial["coverage"][1:]),
        ":".join(f"{w:.3g}" for w in weights),
        " / ".join(f"{100 * x:.0f}%" for x in partial["predicted_byte_share"]),
    )


@dataclass(frozen=True)
class _Parts:
    """What both engines are built from."""

    cfg: MountConfig
    mnt: str
    tree: Tree
    files: dict[int, ServedFile]
    routing: _Routing
    info: MountInfo
    health: list[Health]
    router: Router
    balancer: Balancer
    warnings: RecentWarnings
    history: Usage  # the usage history read at mount: the partial-mirror weights' traffic
    reloads: Reloads
    groups: list[list[int]]  # replicas whose copies share a drive (colifs.devices)
    loop: LoopLag = field(default_factory=LoopLag)

    @property
    def replicas(self) -> list[Replica]:
        return self.routing.replicas

    def _reloader(
        self, stats: Stats, set_copy: Callable[[ServedFile, int, Identity | None], bool],
        apply: Callable[[list[float]], None], engine: _Membership, changed: Callable[[], None],
    ) -> Reloader:  # fmt: skip
        def reweigh(weight: Weight | None) -> None:
            if weight is not None:
                value = weight.value * (self.balancer.weights[0] if weight.of_primary else 1.0)
                why = "measured by colifs mirror add" if weight.of_primary else "given by colifs mirror add"
                self.balancer.set_weight(weight.drive, value, why)
            self.routing.recount(self.files, self.history, self.balancer.weights)
            stats.set_partial(self.routing.partial)
            apply(self.routing.weights)

        def place(root: str, weight: float | None, index: int | None) -> int:
            if index is not None:
                engine.set_root(index, root)
                self.balancer.forget(index)
                return self.routing.place(root, 1.0, index)
            w = self.balancer.weights[0] if weight is None else weight  # until measured
            with stats.changing():  # the engine first: if it cannot, nothing changed
                engine.add_drive(root, self.routing.held([*self.balancer.weights, w]))
                index = self.routing.place(root, w, None)
                self.health.append(Health())
                self.balancer.grow(w)
                stats.grow()
            return index

        return Reloader(
            self.tree, self.files, self.replicas, self.health, set_copy, reweigh, place, self.reloads,
            engine.retire_drive,
            mountpoint=self.mnt, revision=self.cfg.revision,
            io=OsIO(direct=self.cfg.backing_io == "direct"), set_copy_blocks=self.cfg.engine == "native",
            changed=changed,
        )  # fmt: skip

    def _adaptive(
        self,
        activity: Callable[[], tuple],
        apply: Callable[[list[float]], None],
        tuning: Tuning,
        speeds: Callable[[list[float | None]], None] | None = None,
    ) -> Adaptive:
        """`speeds`: gets the drives' measured rates. The readahead follows the drives' saturated
        speed, unless copies share a drive (each would count that drive's speed)."""
        listeners: list[Callable[[Balancer], None]] = []
        if speeds is not None:
            listeners.append(lambda b: speeds(list(b.rates)))
        if not self.groups:

            def follow(b: Balancer) -> None:
                live = [h.up and h.removed_at is None for h in self.health]
                tuning.follow(b.capacity_mb_per_s(live), b.saturated_windows)

            listeners.append(follow)
        return Adaptive(self.balancer, activity, self.routing.held, apply, listeners)

    def _stats(
        self,
        counters: DriveCounters,
        in_flight: Callable[[], list[int]],
        recorder: UsageRecorder,
        tuning: Tuning,
    ) -> Stats:
        return Stats(
            self.replicas, self.info, counters, self.health, in_flight, recorder.status, tuning.applied,
            self.warnings.lines, self.balancer.as_dict, self.reloads.as_dict, self.loop.as_dict,
        )  # fmt: skip

    def _namespace(self, stats: Stats) -> Namespace:
        return Namespace(self.tree, self.files, stats, self.replicas, self.router.drive_at)

    def pyfuse3(self, usage_path: str | None, saving: bool, runs: int, io: BackingIO) -> Assembly:
        from colifs.pyfuse3.engine import Pyfuse3Engine
        from colifs.pyfuse3.fs import ColiFS
        from colifs.pyfuse3.reader import Reader

        cfg = self.cfg
        workers = [_drive_workers(cfg, r.index) for r in self.replicas]
        tally = Tally() if saving else None
        recorder = UsageRecorder(usage_path, saving, runs, tally)
        tuning = Tuning(cfg.knobs)
        stats = self._stats(Counters(len(self.replicas)), lambda: [w.busy for w in workers], recorder, tuning)
        reader = Reader(
            self.replicas, workers, io, stats, self.health, self.router, tally, list(self.files.values())
        )
        ns = self._namespace(stats)
        ops = ColiFS(ns, reader, workers[0].run)
        options = mount_options(cfg.allow_other, cfg.fuse_options)
        engine = Pyfuse3Engine(ops, reader, workers, self.mnt, options)
        adaptive = self._adaptive(
            lambda: Activity(stats.bytes_served, [w.busy_seconds for w in workers], reader.waiting.seconds()),
            reader.set_weights,
            tuning,
        )
        membership = _Pyfuse3Membership(reader, cfg)
        reloader = self._reloader(stats, reader.set_copy, reader.set_weights, membership, ns.tensors.forget)
        return Assembly(self.mnt, stats, engine, recorder, tuning, adaptive, reloader, self.loop)

    def native(self, usage_path: str | None, saving: bool, runs: int) -> Assembly:
        from colifs.native import NativeCounters, NativeEngine, key_table

        cfg = self.cfg
        served = list(self.files.values())
        counters = NativeCounters(len(self.replicas), key_table(served), served)
        recorder = UsageRecorder(usage_path, saving, runs, counters)
        tuning = Tuning(cfg.knobs)
        stats = self._stats(counters, counters.in_flight, recorder, tuning)
        ns = self._namespace(stats)
        options = mount_options(cfg.allow_other, cfg.fuse_options)
        waits = self._waits() if cfg.fill_mib > 0 else []
        engine = NativeEngine(
            ns,
            counters,
            self.health,
            self.router,
            self.mnt,
            options,
            direct=cfg.backing_io == "direct",
            fuse_threads=cfg.fuse_threads,
            drive_threads=cfg.threads_per_drive,
            mirror_timeout=cfg.mirror_timeout,
            fill_mib=cfg.fill_mib,
            waits=waits,
            rates=self.routing.probed_rates(),
            passthrough=cfg.passthrough,
            queue_routing=cfg.routing == "queue",
            direct_reads=cfg.direct_reads,
        )
        adaptive = self._adaptive(counters.activity, engine.set_weights, tuning, engine.set_speeds)
        reloader = self._reloader(stats, engine.set_copy, engine.set_weights, engine, ns.tensors.forget)
        return Assembly(self.mnt, stats, engine, recorder, tuning, adaptive, reloader, self.loop)

    def _waits(self) -> list[float | None]:
        """What a read of each drive waits before its bytes flow (colifs.depth): timed at mount unless
        --no-probe (then fills run, as for drives that need them)."""
        if self.cfg.probe_seconds <= 0:
            return []
        waits = [read_wait(r, list(self.files.values())) for r in self.routing.replicas]
        log.info(
            "a 4 KiB read waits %s",
            ", ".join("-" if w is None else f"{w * 1e6:.0f} us" for w in waits),
        )
        return waits


@dataclass(frozen=True)
class _Pyfuse3Membership:
    """The pyfuse3 engine opens copies from the shared replicas' roots: a new mirror needs only
    its workers, and the weights for it."""

    reader: Reader
    cfg: MountConfig

    def set_root(self, index: int, root: str) -> None:
        """Workers of its own for the directory that takes the slot (the reader builds each path
        from the replicas' roots): none of them is stuck in a call on the old one."""
        self.reader.renew(index, _drive_workers(self.cfg, index))

    def retire_drive(self, index: int) -> Callable[[], int]:
        """The removed mirror's workers retire (they end once their calls return); the slot gets
        new ones. What counts the calls left in the old ones."""
        old = self.reader.renew(index, _drive_workers(self.cfg, index))
        return lambda: old.in_calls

    def add_drive(self, root: str, weights: list[float]) -> None:
        self.reader.grow(_drive_workers(self.cfg, len(self.reader.workers)))
        self.reader.set_weights(weights)


def _drive_workers(cfg: MountConfig, index: int) -> DriveWorkers:
    """The pyfuse3 engine's threads for replica `index`: a mirror's reads time out, the primary's
    never."""
    from colifs.pyfuse3.workers import DriveWorkers

    name, timeout = (f"mirror{index}", cfg.mirror_timeout) if index else ("primary0", None)
    return DriveWorkers(name, cfg.threads_per_drive, timeout)
