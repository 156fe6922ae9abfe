"""The native engine's Python half: the tables it is fed, its counters, and the policy it obeys.

`colifs._native` (native/*.c) serves every request on libfuse's multi-threaded loop without the
GIL. Python computes what it serves from (inodes, attributes, listings, one run table per file
from colifs.readplan), owns the counter memory it writes (per drive, per key, per file: stats and
usage read it), takes its events (mirror failures → the health policy, changed copies → dropped,
primary errors → the log) and answers the rare requests it passes up (control files, xattrs).
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import threading
from collections.abc import Callable, Mapping, Sequence

import trio

from colifs import _native
from colifs.backing import OsIO, TimedOut, check_read
from colifs.balance import Activity
from colifs.boundary import request_errno
from colifs.catalogue import ServedFile
from colifs.depth import in_flight, needs_depth
from colifs.errors import MountError
from colifs.formats.layout import ExpertKey, Key
from colifs.health import Health
from colifs.logs import WarnOnce
from colifs.mirrors import MirrorPolicy
from colifs.namespace import CONTROL_FILES, CONTROL_INO, Namespace
from colifs.readplan import Router, route_columns, run_table
from colifs.replicas import Identity, Replica
from colifs.usage import Usage

log = logging.getLogger("colifs")

MAX_REPLICAS = _native.MAX_REPLICAS
WATCH_TICK = 0.2  # s between looks at the down mirrors (their back-off is 1 s or more)
MEMORY_LOW, MEMORY_OK = 0.10, 0.15  # shares of the RAM available: memory short below, fine above
CHECK_TIMEOUT = 30.0  # s a check read may take with --mirror-timeout 0 (ours: never waited on for ever)


def memory_short(short: bool, share: float) -> bool:
    """Whether memory is short (fills paused), `share` of the RAM
    being available and `short` what was decided last (hysteresis)."""
    return share < MEMORY_OK if short else share < MEMORY_LOW


def in_flight_text(replicas: Sequence[Replica], held: Sequence[float | None]) -> str:
    """What each drive holds in flight at full speed, for the log."""
    each = ("?" if h is None else f"{h / 1024:.0f} KiB" for h in held)
    return "bytes in flight at full speed: " + ", ".join(
        f"{r.role} {x}" for r, x in zip(replicas, each, strict=False)
    )


def memory_available() -> float | None:
    """The share of the RAM available (MemAvailable / MemTotal), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) / int(info["MemTotal"].split()[0])
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None


# native/engine.h counters_t.fill, in order.
FILLS = (
    "fills_started",
    "bytes_read",
    "requests_answered",
    "requests_that_waited",
    "bytes_answered",
    "bytes_held",
    "fills_not_started_budget_spent",
    "bytes_stored",
    "bytes_left_as_cached",
    "views_open",
    "view_error",
    "bytes_not_stored",
    "store_error",
    "requests_given_up",
    "bytes_failed",
    "requests_run_on",
    "leads_followed",
    "fills_from_first_page",
    "read_call_bytes",
    "bytes_dropped_unasked",
    "fills_in_a_stream",
)

# native/engine.h PT_NEVER, PT_AUTO, PT_ALWAYS (colifs.config.MountConfig.passthrough).
PASSTHROUGH_MODES = ("never", "auto", "always")
# native/engine.h counters_t.passthrough, in order.
PASSTHROUGH = (
    "asked_at_init",
    "page_cache_opens_passed_through",
    "page_cache_opens_served",
    "file_opens_now",
    "direct_reads_at_init",
)


KINDS = _native.NODE_KINDS  # a node's kind, as native/engine.h numbers them


class NativeCounters:
    """The counters the native engine writes, in memory Python owns (an anonymous mmap), laid out
    as the engine says (`_native.counter_layout`, u64 words): per drive bytes, reads, errors, busy
    (reads in flight), mirror successes, busy time (ns with a read running), bytes spilled (routed
    to the drive, read by another: --routing queue); fallbacks and late reads skipped; the extent
    buffer (FILLS' fields); passthrough (PASSTHROUGH's fields); per key and drive routed
    bytes; per key reads; per file bytes, reads.
    """

    def __init__(self, nrep: int, keys: Sequence[Key], files: Sequence[ServedFile]) -> None:
        self.nrep = nrep
        self.keys = list(keys)
        self.files = list(files)
        layout = _native.counter_layout(len(self.keys), len(self.files))  # per drive: MAX_REPLICAS
        self.buffer = mmap.mmap(-1, 8 * sum(n for _, n in layout))  # never empty: there is a primary
        words = memoryview(self.buffer).cast("Q")
        field, at = {}, 0
        for name, n in layout:
            field[name] = words[at : at + n]
            at += n
        self._bytes, self._reads = field["drive_bytes"], field["drive_reads"]
        self._errors, self._busy = field["drive_errors"], field["drive_busy"]
        self.mirror_ok, self._busy_ns = field["drive_ok"], field["drive_busy_ns"]
        self._alone_ns = field["drive_alone_ns"]
        self._spilled, self._fallbacks = field["drive_spilled"], field["fallbacks"]
        self._fill, self._passthrough = field["fill"], field["passthrough"]
        self._key_bytes, self._key_reads = field["key_bytes"], field["key_reads"]
        self._file_bytes, self._file_reads = field["file_bytes"], field["file_reads"]
        self._layer = [f"{k.stack}.{k.layer}" if isinstance(k, ExpertKey) else None for k in self.keys]
        self._taken_keys = [0] * (2 * len(self.keys))
        self._taken_files = [0] * (2 * len(self.files))
        self._pending = Usage(runs=1)  # this run counts once, with its first save

    @property
    def memory(self) -> memoryview:
        """The bytes the engine writes to (module.c checks their size against the same layout)."""
        return memoryview(self.buffer)

    @property
    def bytes_served(self) -> list[int]:
        return self._bytes[: self.nrep].tolist()

    @property
    def reads(self) -> list[int]:
        return self._reads[: self.nrep].tolist()

    @property
    def read_errors(self) -> list[int]:
        return self._errors[: self.nrep].tolist()

    @property
    def spilled(self) -> list[int]:
        return self._spilled[: self.nrep].tolist()

    def grow(self) -> None:
        """One more drive: its counters were there, at 0, from the start."""
        self.nrep += 1

    @property
    def fallbacks(self) -> int:
        return self._fallbacks[0]

    @property
    def late_reads_skipped(self) -> int:
        """Mirror reads queued for a request that had given up on them (timed out) before they
        started: never read."""
        return self._fallbacks[1]

    @property
    def fills(self) -> dict[str, int]:
        return dict(zip(FILLS, self._fill.tolist(), strict=True))

    @property
    def passthrough(self) -> dict[str, int]:
        """Opens the kernel reads from the primary itself: what they read is in no other counter."""
        return dict(zip(PASSTHROUGH, self._passthrough.tolist(), strict=True))

    @property
    def layers(self) -> dict[str, list[int]]:
        """Bytes per (stack.layer) per drive as routing decided them, from the per-key counters."""
        out: dict[str, list[int]] = {}
        kb = self._key_bytes.tolist()
        n, slots = self.nrep, MAX_REPLICAS
        for k, layer in enumerate(self._layer):
            if layer is None:
                continue
            row = kb[k * slots : k * slots + n]
            if any(row):
                acc = out.setdefault(layer, [0] * n)
                for d in range(n):
                    acc[d] += row[d]
        return out

    def in_flight(self) -> list[int]:
        return self._busy[: self.nrep].tolist()

    def activity(self) -> Activity:
        """What the balancer looks at (colifs.balance.Activity), since mount."""
        busy, alone = ([ns / 1e9 for ns in c[: self.nrep].tolist()] for c in (self._busy_ns, self._alone_ns))
        return Activity(self.bytes_served, busy, alone, self.spilled)

    def failed(self, drive: int) -> None:
        """The engine counts its errors itself."""

    def take_usage(self) -> Usage:
        """What was served since the last take (and what a failed save gave back)."""
        out, self._pending = self._pending, Usage()
        slots = MAX_REPLICAS
        kb, kr = self._key_bytes.tolist(), self._key_reads.tolist()
        for k, key in enumerate(self.keys):
            nbytes, reads = sum(kb[k * slots : (k + 1) * slots]), kr[k]
            db, dr = nbytes - self._taken_keys[2 * k], reads - self._taken_keys[2 * k + 1]
            if db or dr:
                self._taken_keys[2 * k], self._taken_keys[2 * k + 1] = nbytes, reads
                out.count(key, db, dr)
        fb, fr = self._file_bytes.tolist(), self._file_reads.tolist()
        for i, f in enumerate(self.files):
            db, dr = fb[i] - self._taken_files[2 * i], fr[i] - self._taken_files[2 * i + 1]
            if db or dr:
                self._taken_files[2 * i], self._taken_files[2 * i + 1] = fb[i], fr[i]
                out.count_file(f.relpath, db, dr)
        return out

    def restore_usage(self, usage: Usage) -> None:
        """Taken but not saved: counted again with the next take."""
        self._pending.add(usage)


def key_table(files: Sequence[ServedFile]) -> list[Key]:
    """Every routing key of the served files, once, in file order: the engine counts per index."""
    seen: dict[Key, None] = {}
    for f in files:
        if f.layout is not None:
            seen.update(dict.fromkeys(f.layout.keys))
    return list(seen)


class NativeEngine:
    """Runs `colifs._native.Engine` on a thread of its own; obeys and informs the health policy."""

    def __init__(
        self,
        ns: Namespace,
        counters: NativeCounters,
        health: Sequence[Health],
        router: Router,
        mountpoint: str,
        options: Sequence[str],
        direct: bool,
        fuse_threads: int,
        drive_threads: int,
        mirror_timeout: float | None,
        fill_mib: int = 0,
        waits: Sequence[float | None] = (),
        rates: Sequence[float | None] = (),
        passthrough: str = "never",
        queue_routing: bool = False,
        direct_reads: bool = False,
    ) -> None:
        self.replicas: list[Replica] = ns.replicas
        if len(self.replicas) > MAX_REPLICAS:
            raise MountError(f"the native engine serves at most {MAX_REPLICAS} replicas (--engine pyfuse3)")
        self.ns = ns
        self.stats = ns.stats
        self.files = list(counters.files)
        self.counters = counters
        self.health = health
        self.router = router
        self.striping = router.striping
        self.mirror_timeout = mirror_timeout
        self._io = OsIO(direct=direct)
        self.minds_memory = fill_mib > 0
        self._memory_short = False
        # colifs.depth: fills run unless no drive needs reads in flight (None: not decided yet)
        self._waits = list(waits) or [None] * len(self.replicas)
        self._rates = list(rates) or [None] * len(self.replicas)
        self._depth: bool | None = None
        self._warn = WarnOnce()
        self.mirrors = MirrorPolicy(self.replicas, health, counters.files, self._set_up)
        self._seen_ok = [0] * len(self.replicas)
        self._check_threads: dict[int, trio.CapacityLimiter] = {}
        self._thread: threading.Thread | None = None
        index = self._index = {id(f): i for i, f in enumerate(self.files)}
        key_ids = {k: i for i, k in enumerate(counters.keys)}
        nodes, children = self._namespace_tables(self.ns, index)
        rows = [self._file_row(f, key_ids) for f in self.files]
        self.engine = _native.Engine(
            mountpoint=os.fsencode(mountpoint),
            options=",".join(options).encode(),
            roots=[os.fsencode(r.root) for r in self.replicas],
            direct=direct,
            fuse_threads=fuse_threads,
            drive_threads=drive_threads,
            mirror_timeout=mirror_timeout or 0.0,
            nodes=nodes,
            children=children,
            files=rows,
            nkeys=len(counters.keys),
            counters=counters.memory,
            control=self._control,
            xattr=self._xattr,
            listxattr=self._listxattr,
            event=self._event,
            routes=route_columns(router.weights),
            expert_keys=bytes(isinstance(k, ExpertKey) for k in counters.keys),
            fill_mib=fill_mib,
            passthrough=PASSTHROUGH_MODES.index(passthrough),
            queue_routing=queue_routing,
            direct_reads=direct_reads,
        )
        self.passthrough = passthrough
        self._decide_depth(first=True)

    # -- tables ------------------------------------------------------------------------------

    @staticmethod
    def _namespace_tables(ns: Namespace, index: Mapping[int, int]) -> tuple[list[tuple], list[tuple]]:
        nodes, children = [], []
        for ino in sorted(ns.inodes()):
            a = ns.attr(ino)
            node = ns.tree.nodes.get(ino)
            if ino == CONTROL_INO:
                kind = "control_dir"
            elif ino in CONTROL_FILES.values():
                kind = "control_file"
            elif node is not None and node.is_dir:
                kind = "dir"
            else:
                kind = "reg" if node is not None and node.is_file else "lnk"
            first = len(children)
            if kind in ("dir", "control_dir"):
                children.extend(ns.children(ino))
            f = ns.files.get(ino)
            nodes.append((
                ino, KINDS[kind], index[id(f)] if f is not None else -1, a.mode, a.nlink, a.uid, a.gid,
                a.size, a.blocks, a.atime_ns, a.mtime_ns, a.ctime_ns, a.timeout,
                node.target if node is not None else b"", first, len(children) - first,
            ))  # fmt: skip
        return nodes, children

    def _file_row(self, f: ServedFile, key_ids: Mapping[Key, int]) -> tuple:
        mask = sum(1 << d for d in f.copies)
        idents = [f.identities.get(d, (0, 0, 0, 0, 0)) for d in range(len(self.replicas))]
        idents[0] = f.primary_identity or (0, 0, 0, 0, 0)  # what a reopen of the primary must find
        return (os.fsencode(f.relpath), f.size, mask, idents, *run_table(f, self.striping, key_ids))

    # -- calls from the engine (FUSE threads, with the GIL): never raise -----------------------

    def _control(self, ino: int, uid: int) -> bytes | int:
        return self._guard("open", self.ns.snapshot, ino, uid)

    def _xattr(self, ino: int, name: bytes) -> bytes | int:
        return self._guard("getxattr", self.ns.xattr, ino, name)

    def _listxattr(self, ino: int) -> bytes | int:
        return self._guard("listxattr", lambda i: b"".join(n + b"\0" for n in self.ns.xattr_names(i)), ino)

    @staticmethod
    def _guard(handler: str, fn: Callable[..., bytes], *args: object) -> bytes | int:
        """The same boundary as the pyfuse3 engine's (colifs.boundary): an errno, never a raise."""
        try:
            return fn(*args)
        except Exception as e:
            return request_errno(e, handler)

    def _event(
        self, kind: int, drive: int, file: int, text: bytes, timed_out: int, successes: int, gen: int
    ) -> None:
        try:
            f = self.files[file] if file >= 0 else None
            if f is not None and kind == _native.EV_MIRROR_CHANGED and gen != f.generation(drive):
                return  # about a copy a reload replaced or dropped since (the engine counts alike)
            self._on_event(kind, drive, f, text.decode(errors="replace"), bool(timed_out), successes)
        except Exception:
            log.exception("internal error handling an engine event")

    def _on_event(
        self, kind: int, drive: int, f: ServedFile | None, text: str, timed_out: bool, successes: int
    ) -> None:
        if kind == _native.EV_NO_DIRECT:
            log.warning("%s: its filesystem refuses O_DIRECT; reading it buffered", text)
            return
        if kind == _native.EV_NO_DIRECT_READS:
            log.warning("--direct-reads: %s; read calls go through the page cache", text)
            return
        if kind == _native.EV_NO_PASSTHROUGH:
            if self.passthrough == "always":
                log.warning("--passthrough: %s; page-cache opens are served by the daemon", text)
            else:  # the default asked in case a file no mirror holds is best read by the kernel
                log.info("passthrough: %s; page-cache opens are served by the daemon", text)
            return
        assert f is not None
        if kind == _native.EV_NO_FDS:
            self.mirrors.out_of_descriptors(f, drive)
            return
        if kind == _native.EV_PRIMARY_CHANGED:
            self.mirrors.primary_changed(f, text)
            return
        if kind == _native.EV_PRIMARY_FAILED:
            self.stats.failed(0, text)
            self._warn((f.relpath, 0), "%s: primary read error: %s", f.relpath, text)
            return
        if kind == _native.EV_MIRROR_CHANGED:
            self.stats.failed(drive, f"changed since mount: {text}")
            self.mirrors.changed(f, drive, text, f.identities.get(drive))
            return
        if successes != self._seen_ok[drive]:  # a success since the last failure: not "in a row"
            self._seen_ok[drive] = successes
            self.health[drive].succeeded()
        self.stats.failed(drive, text)
        self.mirrors.read_failed(f, drive, text, timed_out)

    def _set_up(self, drive: int, up: bool) -> None:
        self.engine.set_up(drive, up)

    def set_weights(self, weights: list[float]) -> None:
        """New weights in force (colifs.balance): the next requests route by them; no table changes."""
        self.router.weights[:] = weights
        self.engine.set_routes(route_columns(weights))

    def set_copy(self, f: ServedFile, drive: int, identity: Identity | None) -> bool:
        """A reload's verdict on a mirror copy (colifs.reload); False: the file is busy, ask again."""
        return self.engine.set_copy(self._index[id(f)], drive, identity)

    def add_drive(self, root: str, weights: list[float]) -> None:
        """One more mirror while serving (no file has a copy on it yet), the routes for `weights`."""
        self.engine.add_drive(os.fsencode(root), route_columns(weights))
        self.router.weights[:] = weights
        self._seen_ok.append(0)  # its counters: Stats.grow

    def set_root(self, drive: int, root: str) -> None:
        """A removed mirror's slot serves another directory (colifs mirror add): a new generation
        of the slot reads it, sharing nothing with the calls still stuck in an older one."""
        self.engine.renew_drive(drive, os.fsencode(root))

    def retire_drive(self, drive: int) -> Callable[[], int]:
        """The mirror slot's generation in force retires (colifs mirror remove, its copies out): a
        new one, with threads, queue and counts of its own, serves what the slot serves next, and
        never waits for a call stuck in the old one. What counts the threads still inside a call
        (open, read, fstat, close) on the old one."""
        number = self.engine.renew_drive(drive, None)
        return functools.partial(self.engine.calls, drive, number)

    def set_speeds(self, rates: list[float | None]) -> None:
        """Each drive's measured bytes/s (None: not measured yet), for --routing queue and for
        whether the drives need fills (colifs.depth)."""
        old = self._rates + [None] * len(rates)
        self._rates = [new or was for new, was in zip(rates, old, strict=False)]
        self.engine.set_speeds([round(r) if r else 0 for r in rates])

    # -- lifecycle ---------------------------------------------------------------------------

    def mount(self) -> None:
        self.engine.mount()

    async def run(self) -> None:
        """Serve until unmounted (from outside, or after `stop`)."""
        self._thread = threading.Thread(target=self.engine.loop, name="colifs-fuse", daemon=True)
        self._thread.start()
        await trio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)

    def stop(self) -> None:
        self.engine.stop()

    def close(self) -> None:
        """After the loop: unmount what is left and free the session."""
        self.engine.stop()
        if self._thread is not None:
            self._thread.join(10)
            if self._thread.is_alive():
                log.warning("the FUSE loop did not stop within 10 s; leaving it to the exit")
                return
        self.engine.close()

    # -- health: check reads on down mirrors -------------------------------------------------

    async def watch(self) -> None:
        """Runs for the life of the mount: checks each down mirror once its back-off is over, and
        pauses fills while memory is short."""
        async with trio.open_nursery() as checks:
            while True:
                self.mirrors.start_checks(checks, self._check_read)
                if self.minds_memory:
                    self._mind_fills()
                await trio.sleep(WATCH_TICK)

    def _mind_fills(self) -> None:
        """Fills hold what nobody asked for yet and store it into the page cache: no new fills while
        less than MEMORY_LOW of the RAM is available (back above MEMORY_OK), nor while no drive
        needs reads in flight (colifs.depth)."""
        share = memory_available()
        short = self._memory_short if share is None else memory_short(self._memory_short, share)
        if short != self._memory_short:
            log.warning(
                "fills %s: %.0f%% of the memory is available", "paused" if short else "resumed", 100 * share
            )
            self._memory_short = short
            self.engine.set_memory_short(short or self._depth is False)
        self._decide_depth()

    def _decide_depth(self, first: bool = False) -> None:
        """Fills run unless the drives need no reads in flight (colifs.depth); where they do not, a
        file no mirror holds is read best by the kernel from the primary itself (passthrough auto):
        decided at construction when the probe timed the drives, else once they served."""
        held = self._held()
        depth = needs_depth(held, self._depth) if self.minds_memory else False
        if depth == self._depth and not first:
            return
        if depth is not None and self.minds_memory:
            log.info("fills %s: %s", "on" if depth else "off", in_flight_text(self.replicas, held))
        self._depth = depth
        self.engine.set_memory_short(self._memory_short or depth is False)
        self.engine.set_passthrough_allowed(depth is False)

    def _held(self) -> list[float | None]:
        """What each drive holds in flight at full speed (colifs.depth); a mirror added since the
        mount has no wait measured: not known."""
        n = len(self.replicas)
        waits = (self._waits + [None] * n)[:n]
        rates = (self._rates + [None] * n)[:n]
        return [in_flight(w, r) for w, r in zip(waits, rates, strict=True)]

    def _check_thread(self, drive: int) -> trio.CapacityLimiter:
        """One thread per mirror for its check reads, apart from the daemon's other threads. A check
        stuck in a hung mirror keeps it until its call returns: the next check times out waiting
        for it and starts no thread, and trio's default limiter, which unmounting and saving the
        usage need, loses no token to a hung mirror."""
        if drive not in self._check_threads:
            self._check_threads[drive] = trio.CapacityLimiter(1)
        return self._check_threads[drive]

    async def _check_read(self, drive: int, f: ServedFile | None, offset: int) -> None:
        root = self.replicas[drive].root
        timeout = self.mirror_timeout or CHECK_TIMEOUT
        thread = self._check_thread(drive)
        try:
            with trio.fail_after(timeout):
                if f is None:  # no file left on it to read: its directory must still be there
                    await trio.to_thread.run_sync(os.stat, root, abandon_on_cancel=True, limiter=thread)
                else:
                    path = os.path.join(root, f.relpath)
                    ident = f.identities[drive]
                    await trio.to_thread.run_sync(
                        check_read, self._io, path, ident, offset, abandon_on_cancel=True, limiter=thread
                    )
        except trio.TooSlowError:
            raise TimedOut(f"no answer within {timeout:g} s") from None
