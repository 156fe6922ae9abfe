"""Mount lifecycle: check paths → build (tree, headers, mirror validation, routing) → init → serve →
until unmounted (`colifs umount`, umount(8)) or signalled (SIGTERM/SIGINT/SIGHUP: unmount once no
process uses the mount).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import signal
import stat
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import pyfuse3
import trio

from colifs.backing import BackingIO, OsIO
from colifs.errors import MountError, QuietError
from colifs.formats import format_of
from colifs.fs import ColiFS
from colifs.kernel import Knobs, MountEntry, mount_at, mount_type, tune
from colifs.moe import Configs
from colifs.namespace import STATS_INO, Namespace
from colifs.native import NativeCounters, NativeEngine, key_table
from colifs.probe import ProbeResult, probe, table, weights_from
from colifs.reader import Reader
from colifs.replicas import Replica, ServedFile, validate
from colifs.routing import CHUNK, balanced_weights, expected_shares, positions, stripe_rotation
from colifs.stage import load_receipt, receipt_vouches
from colifs.stats import KeepWarnings, Stats
from colifs.tree import Tree
from colifs.unmount import Busy, UnmountFailed, unmount
from colifs.usage import USAGE_NAME, BadUsageFile, Usage, key_sizes, traffic
from colifs.usage import load as load_usage
from colifs.usage import save as save_usage
from colifs.workers import DriveWorkers

log = logging.getLogger("colifs")

# Chosen by the benchmarks in docs/benchmarks.md (buffered and mmap readers, one and many, slow and
# fast drives): the native engine's requests are cheap, so the kernel's readahead reads little past
# an expert's end; a pyfuse3 request costs ~20 µs of Python, so there fewer, bigger ones win.
DEFAULT_READ_AHEAD_KB = {"native": 128, "pyfuse3": 512}
DEFAULT_MAX_BACKGROUND = 256
# Requests the daemon takes off /dev/fuse at once. A request waiting for its drive holds one (a
# coroutine, cheap); with too few, one slow drive's backlog would hold them all and starve the
# other drives (head-of-line blocking). The per-drive thread count bounds the real I/O.
MAX_TASKS = 1024
PREFETCH_MAX = 64 << 20  # bytes one expert's first page-cache read may read ahead (--prefetch expert)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
BUSY_RETRY = 0.5  # s between unmount attempts after a stop signal while the mount is in use
BUSY_WARN_INTERVAL = 60.0  # s between the warnings naming who still uses it


@dataclass
class MountConfig:
    primary: str
    mirrors: list[str]
    mountpoint: str
    weights: list[float] | None = None  # None: probed (or equal when probe_seconds is 0)
    weights_source: str = "probed"
    probe_seconds: float = 2.0
    threads_per_drive: int = 8
    backing_io: str = "direct"  # or "buffered"
    routing: str = "stripe"  # or "expert" (see docs/benchmarks.md: the routing study)
    prefetch: str = "off"  # or "expert": page-cache readers get whole experts (native engine)
    engine: str = "native"  # or "pyfuse3": the portable reference engine
    fuse_threads: int = 16  # native engine: FUSE request threads (primary reads run on them)
    knobs: Knobs = field(
        default_factory=lambda: Knobs(DEFAULT_READ_AHEAD_KB["native"], DEFAULT_MAX_BACKGROUND)
    )
    allow_other: bool = False
    mirror_timeout: float | None = 5.0  # a mirror read unanswered after this is re-read from the primary
    usage: bool = True  # count what is served per key and file, and save it
    usage_file: str | None = None  # default: PRIMARY/.colifs-usage.json
    usage_interval: float = 60.0  # seconds between saves (and one at unmount)
    fuse_options: list[str] = field(default_factory=list)


def mount_options(allow_other: bool, extra: Sequence[str]) -> list[str]:
    """The FUSE mount options of either engine (default_permissions: the kernel checks modes)."""
    options = {"default_permissions", "ro", "fsname=colifs", "subtype=colifs", "noatime"}
    if allow_other:
        options.add("allow_other")
    options.update(extra)
    return sorted(options)


def _same_or_inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_roots(
    paths: list[str], weights: list[float] | None = None, error: type[QuietError] = MountError
) -> list[Replica]:
    """Resolve the replica directories (primary first); `error` with one clear line if one is bad."""
    roots = []
    for i, path in enumerate(paths):
        real = os.path.realpath(path)
        if not os.path.isdir(real):
            what = "does not exist" if not os.path.exists(real) else "is not a directory"
            raise error(f"{'mirror' if i else 'primary'} {path} {what}")
        roots.append(real)
    seen = {}
    for root in roots:
        st = os.stat(root)
        ident = (st.st_dev, st.st_ino)
        if ident in seen:
            raise error(f"{root} and {seen[ident]} are the same directory")
        seen[ident] = root
    weights = weights or [1.0] * len(roots)
    if len(weights) != len(roots):
        raise error(f"{len(weights)} weights for {len(roots)} replicas")
    return [Replica(i, root, w) for i, (root, w) in enumerate(zip(roots, weights, strict=True))]


def check_paths(cfg: MountConfig) -> tuple[list[Replica], str]:
    """Resolve and check the directories; raises MountError with one clear line."""
    replicas = check_roots([cfg.primary, *cfg.mirrors], cfg.weights)
    roots = [r.root for r in replicas]
    try:
        mnt_st = os.stat(cfg.mountpoint)
    except FileNotFoundError:
        raise MountError(f"mountpoint {cfg.mountpoint} does not exist") from None
    except OSError as e:
        raise MountError(f"mountpoint {cfg.mountpoint}: {e.strerror}") from None
    if not stat.S_ISDIR(mnt_st.st_mode):
        raise MountError(f"mountpoint {cfg.mountpoint} is not a directory")
    mnt = os.path.realpath(cfg.mountpoint)
    for root in roots:
        if _same_or_inside(mnt, root):
            raise MountError(f"mountpoint {cfg.mountpoint} is inside {root}")
    if mount_type(mnt) is not None:
        try:
            os.listdir(mnt)
        except OSError as e:
            if e.errno == errno.ENOTCONN:
                raise MountError(
                    f"mountpoint {cfg.mountpoint} is a stale mount (its daemon is gone); "
                    f"run: colifs umount {cfg.mountpoint}"
                ) from None
        raise MountError(f"mountpoint {cfg.mountpoint} is already a mount point")
    if os.listdir(mnt):
        raise MountError(f"mountpoint {cfg.mountpoint} is not empty")
    return replicas, mnt


def build_files(tree: Tree, replicas: list[Replica]) -> dict[int, ServedFile]:
    """Every regular file of the tree; model files (safetensors, GGUF) validated and routed."""
    files: dict[int, ServedFile] = {}
    configs = Configs(tree.root)
    for node in tree.files():
        fmt = format_of(node.relpath)
        if fmt is not None:
            path = os.path.join(tree.root, node.relpath)
            files[node.ino] = validate(path, node.relpath, replicas, fmt, configs.experts_for(node.relpath))
        else:
            files[node.ino] = ServedFile(node.relpath, node.st.st_size)
    _vouch(files, tree, replicas)
    where = positions(k for f in files.values() if f.layout for k in f.layout.keys)
    key_bytes = key_sizes(f.layout for f in files.values() if f.layout is not None)
    # Keys smaller than two chunks stay whole on one drive, in both routing modes.
    rotation = {k: stripe_rotation(k) if n >= 2 * CHUNK else -1 for k, n in key_bytes.items()}
    for f in files.values():
        if f.layout is not None:
            f.positions = tuple(where[k] for k in f.layout.keys)
            f.stripes = tuple(rotation[k] for k in f.layout.keys)
    return files


def _vouch(files: dict[int, ServedFile], tree: Tree, replicas: list[Replica]) -> None:
    """Mark the mirror copies a `colifs stage` receipt still vouches for (data SHA-256-checked)."""
    for r in replicas[1:]:
        receipt = load_receipt(r.root)
        if not receipt:
            continue
        for ino, f in files.items():
            if r.index in f.replicas and receipt_vouches(
                receipt.get(f.relpath), f.size, tree.nodes[ino].st.st_mtime_ns, f.identities[r.index][3]
            ):
                f.vouched += (r.index,)


def _usage_path(cfg: MountConfig, replicas: list[Replica]) -> str:
    """Where usage is saved: never on a mirror."""
    path = os.path.abspath(cfg.usage_file or os.path.join(replicas[0].root, USAGE_NAME))
    real = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    for r in replicas[1:]:
        if _same_or_inside(real, r.root):
            raise MountError(f"usage file {path} is inside mirror {r.root}: colifs never writes to a mirror")
    if not os.path.isdir(os.path.dirname(real)):
        raise MountError(f"usage file {path}: directory {os.path.dirname(path)} does not exist")
    return real


def _hide_usage(usage_path: str | None, root: str) -> Callable[[str], bool]:
    """The usage file changes while mounted: kept out of the (snapshot) tree, with its temporaries."""
    if usage_path is None or not _same_or_inside(usage_path, root):
        return lambda _: False
    rel = os.path.relpath(usage_path, root)
    return lambda relpath: relpath == rel or relpath.startswith(rel + ".tmp.")


def _partial_routing(
    files: dict[int, ServedFile], weights: list[float], history: Usage
) -> tuple[list[float], dict | None]:
    """Weights such that, with partial mirrors, the bytes split as the weights say (as far as the
    copies allow), from the traffic in the usage history. None when every mirror is full."""
    layouts = {f.relpath: f.layout for f in files.values() if f.layout is not None}
    expected = traffic(layouts, history)
    by_set: dict[tuple[int, ...], float] = defaultdict(float)
    for f in files.values():
        if f.layout is not None:
            by_set[f.replicas] += expected[f.relpath]
    total = sum(by_set.values())
    full = tuple(range(len(weights)))
    if total <= 0 or by_set.get(full, 0.0) >= total:
        return weights, None  # full mirrors: plain weights are right (or nothing was ever read)
    balanced = balanced_weights(weights, by_set)
    scale = weights[0] / balanced[0] if balanced[0] > 1e-9 else sum(weights)
    return [w * scale for w in balanced], {
        "coverage": [sum(t for s, t in by_set.items() if i in s) / total for i in range(len(weights))],
        "plain_weights": weights,
        "weights_for_held_files": [w * scale for w in balanced],
        "predicted_byte_share": expected_shares(balanced, by_set),
        "plain_byte_share": expected_shares(weights, by_set),
    }


class UsageSource(Protocol):
    """Where the served usage accumulates: the pyfuse3 reader, or the native engine's counters."""

    def take_usage(self) -> Usage: ...

    def restore_usage(self, usage: Usage) -> None: ...


async def _keep_usage(source: UsageSource, stats: Stats, interval: float) -> None:
    while True:
        await trio.sleep(interval)
        pending = source.take_usage()  # on the loop's thread; written on another
        # Nothing served yet still carries this run's count: kept for a later save, like a failed one.
        if not pending or not await trio.to_thread.run_sync(_write_usage, stats, pending):
            source.restore_usage(pending)


def _write_usage(stats: Stats, pending: Usage) -> bool:
    """Add this run's counts to the usage file; False (warned once) when it cannot be written."""
    path = stats.usage["file"]
    try:
        save_usage(path, pending)
    except (OSError, BadUsageFile) as e:
        if stats.usage.get("last_error") is None:
            log.warning("usage file %s: cannot save (%s); kept in memory, tried again later", path, e)
        stats.usage["last_error"] = str(e)
        return False
    stats.usage["last_saved"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    stats.usage["last_error"] = None
    return True


def describe(replicas: list[Replica], source: str, files: dict[int, ServedFile]) -> str:
    models = [f for f in files.values() if f.is_model]
    parts = []
    for r in replicas:
        held = sum(1 for f in models if r.index in f.replicas)
        parts.append(f"{r.role} {r.root} (weight {r.weight:g}, {held}/{len(models)} model files)")
    return f"weights {source}: " + ", ".join(parts)


def serve(
    cfg: MountConfig,
    on_ready: Callable[[], None] = lambda: None,
    io: BackingIO | None = None,
) -> None:
    """Build, mount and serve until unmounted or signalled; always leaves nothing mounted."""
    replicas, mnt = check_paths(cfg)
    usage_path = _usage_path(cfg, replicas) if cfg.usage else None
    t0 = time.monotonic()
    tree = Tree(replicas[0].root, _hide_usage(usage_path, replicas[0].root))
    files = build_files(tree, replicas)
    history, saving = Usage(), usage_path is not None
    if usage_path is not None:
        try:
            history = load_usage(usage_path)
        except BadUsageFile as e:
            saving = False
            log.warning("%s; not updated this run (fix or move it)", e)
        if saving and not os.access(os.path.dirname(usage_path), os.W_OK | os.X_OK):
            saving = False  # a read-only model drive is common: say so once, not every minute
            log.warning(
                "usage file %s cannot be written there (read-only?); usage is not kept this run "
                "(--usage-file elsewhere, or --no-usage)",
                usage_path,
            )
    probed: list[ProbeResult] = []
    if cfg.weights is None and cfg.probe_seconds > 0 and len(replicas) > 1:
        probed = probe(replicas, list(files.values()), cfg.probe_seconds)
        for line in table(probed).splitlines():
            log.info("probe: %s", line)
        replicas = [replace(r, weight=w) for r, w in zip(replicas, weights_from(probed), strict=True)]
    native = cfg.engine == "native"
    keys = key_table(list(files.values())) if native else []
    counters = NativeCounters(len(replicas), keys, list(files.values())) if native else None
    stats = Stats(replicas, cfg.weights_source, mnt, counters, cfg.engine)
    stats.probe = [
        {
            "path": p.replica.root,
            "mb_per_s": p.mb_per_s,
            "bytes": p.nbytes,
            "seconds": p.seconds,
            "direct": p.direct,
        }
        for p in probed
    ]
    keep = KeepWarnings(stats)
    log.addHandler(keep)
    try:
        log.info("%s", describe(replicas, cfg.weights_source, files))
        weights = [r.weight for r in replicas]
        if len(replicas) > 1 and history:
            weights, stats.partial = _partial_routing(files, weights, history)
            if stats.partial is not None:
                log.info(
                    "partial mirror(s): holding %s of the traffic in the usage history; weights %s; "
                    "expected byte split %s",
                    " / ".join(f"{100 * x:.0f}%" for x in stats.partial["coverage"][1:]),
                    ":".join(f"{w:.3g}" for w in weights),
                    " / ".join(f"{100 * x:.0f}%" for x in stats.partial["predicted_byte_share"]),
                )
        stats.usage = {"file": usage_path, "saving": saving, "history_runs": history.runs, "last_saved": None}
        stats.routing = cfg.routing
        log.debug("built in %.3f s: %d nodes, %d files", time.monotonic() - t0, len(tree.nodes), len(files))
        options = mount_options(cfg.allow_other, cfg.fuse_options)
        if counters is not None:
            _serve_native(cfg, mnt, tree, files, stats, counters, weights, options, saving, on_ready)
        else:
            _serve_pyfuse3(cfg, mnt, tree, files, stats, weights, options, saving, on_ready, io)
    finally:
        log.removeHandler(keep)
    log.debug("unmounted %s", mnt)


def _serve_pyfuse3(
    cfg: MountConfig,
    mnt: str,
    tree: Tree,
    files: dict[int, ServedFile],
    stats: Stats,
    weights: list[float],
    options: list[str],
    saving: bool,
    on_ready: Callable[[], None],
    io: BackingIO | None,
) -> None:
    """The portable reference engine: pyfuse3, every request a task on one trio thread."""
    if cfg.prefetch != "off":
        log.warning(
            "--prefetch %s needs the native engine; the pyfuse3 engine does not prefetch", cfg.prefetch
        )
    workers = [
        DriveWorkers(f"{r.role}{r.index}", cfg.threads_per_drive, cfg.mirror_timeout if r.index else None)
        for r in stats.replicas
    ]
    reader = Reader(
        stats.replicas,
        workers,
        io or OsIO(direct=cfg.backing_io == "direct"),
        stats,
        routing=cfg.routing,
        files=list(files.values()),
        usage=Usage(runs=1) if saving else None,
        weights=weights,
    )
    stats.in_flight = lambda: [w.busy for w in workers]
    ops = build_ops(tree, files, reader, stats)
    tasks = [reader.watch]
    if reader.usage is not None:
        tasks.append(functools.partial(_keep_usage, reader, stats, cfg.usage_interval))
    try:
        with _signals_recorded() as early:
            try:
                pyfuse3.init(ops, mnt, set(options))
            except RuntimeError as e:
                raise MountError(f"cannot mount on {mnt}: {e}") from None
            try:
                loop = functools.partial(pyfuse3.main, max_tasks=MAX_TASKS)
                trio.run(_main, mnt, cfg.knobs, stats, on_ready, early, loop, pyfuse3.terminate, tasks)
            finally:
                pyfuse3.close(unmount=True)
                if reader.usage:  # what was served since the last save: `colifs umount` waits for it
                    _write_usage(stats, reader.usage)
    finally:
        for w in workers:
            w.close()


def _serve_native(
    cfg: MountConfig,
    mnt: str,
    tree: Tree,
    files: dict[int, ServedFile],
    stats: Stats,
    counters: NativeCounters,
    weights: list[float],
    options: list[str],
    saving: bool,
    on_ready: Callable[[], None],
) -> None:
    """The native engine: libfuse's multi-threaded loop in C, no Python per read."""
    engine = NativeEngine(
        tree,
        files,
        stats,
        counters,
        weights,
        cfg.routing == "stripe",
        mnt,
        options,
        direct=cfg.backing_io == "direct",
        fuse_threads=cfg.fuse_threads,
        drive_threads=cfg.threads_per_drive,
        mirror_timeout=cfg.mirror_timeout,
        prefetch_max=PREFETCH_MAX if cfg.prefetch == "expert" else 0,
    )
    stats.in_flight = counters.in_flight
    tasks = [engine.watch]
    if saving:
        tasks.append(functools.partial(_keep_usage, counters, stats, cfg.usage_interval))
    with _signals_recorded() as early:
        try:
            engine.mount()
        except RuntimeError as e:
            raise MountError(f"cannot mount on {mnt}: {e}") from None
        try:
            trio.run(_main, mnt, cfg.knobs, stats, on_ready, early, engine.run, engine.stop, tasks)
        finally:
            engine.close()
            if saving and (pending := counters.take_usage()):
                _write_usage(stats, pending)


def build_ops(tree: Tree, files: dict[int, ServedFile], reader: Reader, stats: Stats) -> ColiFS:
    """The pyfuse3 Operations over `reader`, as `serve` builds them (tests use it too)."""
    return ColiFS(Namespace(tree, files, stats, stats.replicas, reader.route), reader)


@contextlib.contextmanager
def _signals_recorded() -> Iterator[list[int]]:
    """From here on a signal must unmount, never kill: it is recorded until trio takes over."""
    early: list[int] = []
    previous = {s: signal.signal(s, lambda sig, _: early.append(sig)) for s in STOP_SIGNALS}
    try:
        yield early
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


async def _unmount_when_unused(mnt: str, own: MountEntry | None, unmounted: Callable[[], None]) -> None:
    """A stop signal unmounts as soon as the kernel allows: while a process still has a file of the
    mount open or mapped, keep serving it (and say who, now and then), never pull it away."""
    warned = -math.inf
    while True:
        now = mount_at(mnt)
        if own is None or now is None or now.mount_id != own.mount_id:
            log.info("%s is already detached: serving what is still open until the last user closes it", mnt)
            return
        try:
            await trio.to_thread.run_sync(unmount, mnt)
        except Busy as e:
            if time.monotonic() - warned >= BUSY_WARN_INTERVAL:
                warned = time.monotonic()
                log.warning("%s; still serving it, unmounting once nothing uses it (colifs umount --lazy "
                            "detaches it now)", e)  # fmt: skip
            await trio.sleep(BUSY_RETRY)
            continue
        except UnmountFailed as e:
            log.warning("cannot unmount %s (%s); ending the session", mnt, e)
        unmounted()
        return


async def _main(
    mnt: str,
    knobs: Knobs,
    stats: Stats,
    on_ready: Callable[[], None],
    early: list[int],
    loop: Callable[[], Awaitable[None]],
    terminate: Callable[[], None],
    tasks: list[Callable[[], Awaitable[None]]],
) -> None:
    """Serve (`loop` returns once unmounted) until a stop signal (`terminate` ends the loop)."""
    own = mount_at(mnt)  # just mounted: ours (a later mount on the same path is not)
    async with trio.open_nursery() as nursery:

        async def fuse_loop() -> None:
            await loop()
            log.info("%s was unmounted; stopping", mnt)  # colifs umount, umount(8)
            nursery.cancel_scope.cancel()

        def unmounted() -> None:
            terminate()
            # The start-up calls below go through the mount: once the loop stops they would wait
            # forever, so they are abandoned.
            nursery.cancel_scope.cancel()

        async def signals(task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
            # Open for the whole life of the mount: a later signal is taken here, never fatal.
            with trio.open_signal_receiver(*STOP_SIGNALS) as sigs:
                task_status.started()
                sig = early[0] if early else await sigs.__anext__()
                log.info("signal %s: unmounting %s once no process uses it", signal.Signals(sig).name, mnt)
                await _unmount_when_unused(mnt, own, unmounted)
                async for _ in sigs:
                    pass  # already stopping

        nursery.start_soon(fuse_loop)
        for task in tasks:
            nursery.start_soon(task)
        await nursery.start(signals)
        # Ready means serving: a real request through the kernel proves it.
        path = os.path.join(mnt, ".colifs", "stats")
        try:
            await trio.to_thread.run_sync(os.stat, path, abandon_on_cancel=True)
        except OSError:
            if mount_at(mnt) == own:
                raise
            return  # unmounted before it ever served (a stop signal at start-up): the loop ends
        log.debug("serving %s (stats inode %d answered)", mnt, STATS_INO)
        stats.kernel = await trio.to_thread.run_sync(tune, mnt, knobs, abandon_on_cancel=True)
        log.info("kernel: %s", ", ".join(f"{k} {v}" for k, v in stats.kernel.items()))
        on_ready()
