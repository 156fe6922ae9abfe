"""Mount lifecycle: check paths → build (tree, headers, mirror validation, routing) → init → serve →
clean unmount on SIGTERM/SIGINT or an external `fusermount3 -u`.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import stat
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pyfuse3
import trio

from colifs.backing import BackingIO, OsIO
from colifs.errors import MountError, QuietError
from colifs.formats import format_of
from colifs.fs import STATS_INO, ColiFS
from colifs.kernel import Knobs, tune
from colifs.layout import Key
from colifs.probe import ProbeResult, probe, table, weights_from
from colifs.reader import Reader
from colifs.replicas import Replica, ServedFile, validate
from colifs.routing import CHUNK, positions, stripe_rotation
from colifs.stats import KeepWarnings, Stats
from colifs.tree import Tree
from colifs.workers import DriveWorkers

log = logging.getLogger("colifs")

# Chosen by the benchmark in docs/benchmarks.md (buffered and mmap readers, one and many).
DEFAULT_READ_AHEAD_KB = 512
DEFAULT_MAX_BACKGROUND = 256
# Requests the daemon takes off /dev/fuse at once. A request waiting for its drive holds one (a
# coroutine, cheap); with too few, one slow drive's backlog would hold them all and starve the
# other drives (head-of-line blocking). The per-drive thread count bounds the real I/O.
MAX_TASKS = 1024
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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
    knobs: Knobs = field(default_factory=lambda: Knobs(DEFAULT_READ_AHEAD_KB, DEFAULT_MAX_BACKGROUND))
    allow_other: bool = False
    mirror_timeout: float | None = 5.0  # a mirror read unanswered after this is re-read from the primary
    fuse_options: list[str] = field(default_factory=list)


def _is_mounted(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f if len(line.split()) > 1)


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
    if _is_mounted(mnt):
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
    for node in tree.files():
        fmt = format_of(node.relpath)
        if fmt is not None:
            files[node.ino] = validate(os.path.join(tree.root, node.relpath), node.relpath, replicas, fmt)
        else:
            files[node.ino] = ServedFile(node.relpath, node.st.st_size)
    where = positions(k for f in files.values() if f.layout for k in f.layout.keys)
    key_bytes: dict[Key, int] = defaultdict(int)
    for f in files.values():
        if f.layout is not None:
            for s, e, k in f.layout.extents():
                key_bytes[k] += e - s
    for f in files.values():
        if f.layout is not None:
            f.positions = tuple(where[k] for k in f.layout.keys)
            # Keys smaller than two chunks stay whole on one drive, in both routing modes.
            f.stripes = tuple(stripe_rotation(k) if key_bytes[k] >= 2 * CHUNK else -1 for k in f.layout.keys)
    return files


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
    t0 = time.monotonic()
    tree = Tree(replicas[0].root)
    files = build_files(tree, replicas)
    probed: list[ProbeResult] = []
    if cfg.weights is None and cfg.probe_seconds > 0 and len(replicas) > 1:
        probed = probe(replicas, list(files.values()), cfg.probe_seconds)
        for line in table(probed).splitlines():
            log.info("probe: %s", line)
        replicas = [replace(r, weight=w) for r, w in zip(replicas, weights_from(probed), strict=True)]
    stats = Stats(replicas, cfg.weights_source, mnt)
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
    log.addHandler(KeepWarnings(stats))
    log.info("%s", describe(replicas, cfg.weights_source, files))
    log.debug("built in %.3f s: %d nodes, %d files", time.monotonic() - t0, len(tree.nodes), len(files))
    workers = [
        DriveWorkers(f"{r.role}{r.index}", cfg.threads_per_drive, cfg.mirror_timeout if r.index else None)
        for r in replicas
    ]
    backing = io or OsIO(direct=cfg.backing_io == "direct")
    reader = Reader(replicas, workers, backing, stats, routing=cfg.routing, files=list(files.values()))
    stats.routing = cfg.routing
    stats.in_flight = lambda: [w.busy for w in workers]
    ops = ColiFS(tree, {ino: f for ino, f in files.items()}, reader, stats)
    options = set(pyfuse3.default_options) | {"ro", "fsname=colifs", "subtype=colifs", "noatime"}
    if cfg.allow_other:
        options.add("allow_other")
    options.update(cfg.fuse_options)
    # From here on a signal must unmount, never kill: it is recorded until trio takes over.
    early: list[int] = []
    previous = {s: signal.signal(s, lambda sig, _: early.append(sig)) for s in STOP_SIGNALS}
    try:
        try:
            pyfuse3.init(ops, mnt, options)
        except RuntimeError as e:
            raise MountError(f"cannot mount on {mnt}: {e}") from None
        try:
            trio.run(_main, mnt, cfg.knobs, reader, on_ready, early)
        finally:
            pyfuse3.close(unmount=True)
    finally:
        for w in workers:
            w.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.debug("unmounted %s", mnt)


async def _main(
    mnt: str, knobs: Knobs, reader: Reader, on_ready: Callable[[], None], early: list[int]
) -> None:
    stats = reader.stats
    async with trio.open_nursery() as nursery:

        async def fuse_loop() -> None:
            await pyfuse3.main(max_tasks=MAX_TASKS)
            nursery.cancel_scope.cancel()  # unmounted from outside (fusermount3 -u)

        def stop(sig: int) -> None:
            log.info("signal %s: unmounting %s", signal.Signals(sig).name, mnt)
            pyfuse3.terminate()
            # The start-up calls below go through the mount: once the loop stops they would wait
            # forever, so they are abandoned (pyfuse3.close then unmounts and they return).
            nursery.cancel_scope.cancel()

        async def signals(task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
            with trio.open_signal_receiver(*STOP_SIGNALS) as sigs:
                task_status.started()
                if early:
                    stop(early[0])
                    return
                async for sig in sigs:
                    stop(sig)
                    return

        nursery.start_soon(fuse_loop)
        nursery.start_soon(reader.watch)
        await nursery.start(signals)
        # Ready means serving: a real request through the kernel proves it.
        path = os.path.join(mnt, ".colifs", "stats")
        await trio.to_thread.run_sync(os.stat, path, abandon_on_cancel=True)
        log.debug("serving %s (stats inode %d answered)", mnt, STATS_INO)
        stats.kernel = await trio.to_thread.run_sync(tune, mnt, knobs, abandon_on_cancel=True)
        log.info("kernel: %s", ", ".join(f"{k} {v}" for k, v in stats.kernel.items()))
        on_ready()
