"""Reload: every mirror checked again while the mount serves, as at mount (size, header, receipt).

A copy staged or repaired since the mount starts serving; one that changed or went away stops;
the partial-mirror weights follow the new set of copies. `recheck` reads the headers (never tensor
data) and returns what changed, without touching the mount; `Reloader` puts it in force: the
engine's per-file copies first (a read in flight finishes on the copy it started with, or is read
from the primary), then the catalogue, the receipts and the weights. `Reloads` keeps what
stats.json shows of it. The primary cannot change while mounted: a primary file found changed is
refused to new opens (EIO) by the engines, the reload says which, and drops its mirror copies that
changed too (the others still hold the bytes mounted, which the files open before read on).

A copy that starts serving while the mount serves (a reload, `colifs mirror add`) first proves
its bytes (colifs.proof). Nothing here blocks the daemon's trio loop: every stat, header read,
proof and engine change that can wait on a drive runs off it, with a bound (colifs.offload).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import trio

from colifs.backing import BackingIO, OsIO, TimedOut
from colifs.catalogue import ServedFile, mirror_problem, vouched_copies
from colifs.checks import judge_mirror
from colifs.devices import one_drive
from colifs.errors import BusyError, NotReloadedError, UsageError
from colifs.formats import format_for
from colifs.formats.layout import LayoutError
from colifs.formats.moe import Configs
from colifs.health import Health
from colifs.kernel import held_under, mount_at
from colifs.offload import Crowded, Offload
from colifs.probe import probe_replica
from colifs.proof import Claim, Proving, prove
from colifs.replicas import Identity, Replica, identity
from colifs.tree import Tree
from colifs.units import human

log = logging.getLogger("colifs")

T = TypeVar("T")
BUSY_RETRY = 0.05  # s between tries of a copy whose file is busy retiring descriptors
BUSY_GIVE_UP = 5.0  # s after which such a copy waits for the next reload
CLOSED_POLL = 0.05  # s between looks at the descriptors a removed mirror still has open
MEASURE_S = 1.0  # s each of the probes that weigh a new mirror against the primary
RESOLVE_WITHIN = 5.0  # s to resolve a mirror path a command gave otherwise than as mounted
MAX_REPLICAS = 8  # as the native engine's tables (native/engine.h): the primary and 7 mirrors
SET_COPY_WITHIN = 1.0  # s a change of copy may wait for its file's lock (a primary open holds it)
JUDGE_WITHIN = 10.0  # s to judge a directory given to colifs mirror add/remove (it stats it)
HEADERS_WITHIN = 120.0  # s a reload's header reads of every mirror may take
PROOF_WITHIN = 120.0  # s a reload's proof of the copies it found may take
MEASURE_WITHIN = 30.0  # s the probe of a new mirror may take


@dataclass(frozen=True)
class Weight:
    """A weight given while serving: `value`, or `value` times the primary's weight in force."""

    drive: int
    value: float
    of_primary: bool = False


@dataclass(frozen=True)
class Verdict:
    """A mirror copy whose state changes: usable as `identity`, or not (None), and why."""

    ino: int
    drive: int
    identity: Identity | None
    why: str


def recheck(
    tree: Tree, files: Mapping[int, ServedFile], replicas: Sequence[Replica], not_on: int | None = None
) -> tuple[list[Verdict], list[str]]:
    """(the copies whose state changes, the model files whose primary changed since mount).
    Reads each model file's header on the primary and on every mirror. `not_on`: the mount's own
    device (catalogue.mirror_problem)."""
    configs = Configs(tree.root)
    verdicts: list[Verdict] = []
    primary_changed: list[str] = []
    for ino, f in files.items():
        if not f.is_model or f.layout is None:
            continue
        header = _primary_header(tree, ino, f, configs)
        if header is None:
            primary_changed.append(f.relpath)
            verdicts.extend(_changed_with_it(ino, f, replicas))
            continue
        for r in replicas[1:]:
            problem, ident = mirror_problem(os.path.join(r.root, f.relpath), f.size, header, not_on)
            held = r.index in f.copies
            if ident is not None and not (held and f.identities.get(r.index) == ident):
                verdicts.append(Verdict(ino, r.index, ident, "changed" if held else "added"))
            elif ident is None and held:
                verdicts.append(Verdict(ino, r.index, None, problem or "not usable"))
    return verdicts, primary_changed


def _changed_with_it(ino: int, f: ServedFile, replicas: Sequence[Replica]) -> list[Verdict]:
    """A changed primary's mirror copies that are no longer the ones validated either (an rsync
    of the new file, say): dropped. The others are kept: they hold the bytes mounted, which the
    files open since before the change read on."""
    out = []
    for r in replicas[1:]:
        if r.index in f.copies and _identity_of(os.path.join(r.root, f.relpath)) != f.identities.get(r.index):
            out.append(Verdict(ino, r.index, None, "changed, as its primary did"))
    return out


def _identity_of(path: str) -> Identity | None:
    try:
        return identity(os.stat(path))
    except OSError:
        return None


def _primary_header(tree: Tree, ino: int, f: ServedFile, configs: Configs) -> bytes | None:
    """The header the mirrors must match; None when the primary's file is not the one mounted."""
    path = os.path.join(tree.root, f.relpath)
    fmt = format_for(path)
    try:
        if fmt is None or identity(os.stat(path)) != identity(tree.nodes[ino].st):
            return None
        size, header, _ = fmt.read(path, configs.experts_for(f.relpath))
    except (OSError, LayoutError):
        return None
    return header if size == f.size else None


def _recheck_readable(
    tree: Tree,
    files: Mapping[int, ServedFile],
    primary: Replica,
    mirrors: Sequence[Replica],
    not_on: int | None,
) -> tuple[list[Replica], list[Verdict], list[str]]:
    """The mirrors whose directory can be read, and what `recheck` finds on them (blocks)."""
    readable = [r for r in mirrors if os.path.isdir(r.root)]
    return (readable, *recheck(tree, files, [primary, *readable], not_on))


@dataclass
class Reloads:
    """What stats.json shows: how many reloads started and ran, the last one's time and what it
    changed (or why it failed)."""

    started: int = 0
    count: int = 0
    last: dict = field(default_factory=dict)
    mirror_change: dict = field(default_factory=dict)  # the last `colifs mirror add/remove`
    proof: Proving | None = None  # the proof running, or the last one (colifs.proof)
    # Calls still inside the drives of removed mirrors (Reloader.left_behind), looked at each time.
    _behind: Callable[[], list[dict]] = lambda: []

    def begin(self) -> None:
        self.started += 1

    def record(self, last: dict) -> None:
        self.count += 1
        self.last = {"at": round(time.time(), 1), **last}

    def proving(self, proof: Proving) -> None:
        """A proof begins: stats.json shows it as it runs, then until the next one."""
        self.proof = proof

    def changed_mirror(self, change: dict) -> None:
        self.mirror_change = {"at": round(time.time(), 1), **change}

    def watch(self, behind: Callable[[], list[dict]]) -> None:
        """What says which removed mirrors' drives still have calls inside them."""
        self._behind = behind

    def as_dict(self) -> dict:
        return {
            "started": self.started,
            "count": self.count,
            "last": self.last,
            "mirror_change": self.mirror_change,
            "proof": None if self.proof is None else self.proof.as_dict(),
            "calls_left_behind": self._behind(),
        }


class Reloader:
    """Runs reloads for a mount, one at a time: `set_copy(f, drive, identity)` puts a verdict in
    force in the engine (False: busy, ask again); `reweigh()` recomputes the weights once the
    copies changed; `retire(drive)` gives a removed mirror's slot a new generation in the engine
    (threads and counts of its own, so that nothing a mirror put there later does waits for a call
    stuck in the removed drive) and returns what counts the calls left in the old one. A mirror
    that is down (health) or whose directory cannot be read is left as it is: a drive that went
    away for a moment must not lose every copy.

    `mountpoint` (resolved) and `revision`: what a directory to add is judged against, as at mount
    (colifs.checks.judge_mirror); `io`: the reads that prove a new copy's bytes (the engine's);
    `set_copy_blocks`: `set_copy` may wait for a file's lock (the native engine), so it runs on
    a thread; `changed`: told after each reload and mirror change (cached answers forget)."""

    def __init__(
        self,
        tree: Tree,
        files: Mapping[int, ServedFile],
        replicas: Sequence[Replica],
        health: Sequence[Health],
        set_copy: Callable[[ServedFile, int, Identity | None], bool],
        reweigh: Callable[[Weight | None], None],
        place: Callable[[str, float | None, int | None], int],
        record: Reloads,
        retire: Callable[[int], Callable[[], int]] = lambda _: lambda: 0,
        *,
        mountpoint: str | None = None,
        revision: str = "main",
        io: BackingIO | None = None,
        set_copy_blocks: bool = False,
        changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.tree = tree
        self.files = files
        self.replicas = replicas  # shared: a mirror added in a removed one's slot changes its root
        self.health = health
        self._set_copy = set_copy
        self._reweigh = reweigh
        # A new mirror directory in a removed one's slot, or (None) in a new one: (root, weight if
        # given, slot) -> its index; every part that holds replicas learns of it.
        self._place = place
        self.record = record
        self._retire = retire
        self._lock = trio.Lock()
        self._unfinished: set[int] = set()  # mirrors whose removal ended with descriptors or calls left
        # (root, calls) of each removed mirror's retired generation whose calls may not all have returned
        self._behind: list[tuple[str, Callable[[], int]]] = []
        record.watch(self.left_behind)
        self.mountpoint = mountpoint
        self.revision = revision
        self.io = io or OsIO(direct=True)
        self._set_copy_blocks = set_copy_blocks
        self._changed = changed
        self._mount_dev: int | None = None
        # Off the loop, bounded (colifs.offload): what waits on drives.
        self._dirs = Offload("directory checks")
        self._headers = Offload("header checks", most=2)
        self._proofs = Offload("proofs", most=2)
        self._probes = Offload("probes", most=2)
        self._setting = trio.CapacityLimiter(64)  # engine changes of copy waiting on a file's lock
        self._late: set[tuple[int, int]] = set()  # (ino, drive): a change still waiting on its file

    async def reload(self) -> dict:
        """Check every mirror again and put what changed in force; what stats.json shows of it.
        A reload that fails says why there (and in the log), and the mount serves on."""
        async with self._lock:
            self.record.begin()
            t0 = time.monotonic()
            try:
                last = await self._reload()
            except Exception as e:  # the mount serves on as before
                log.exception("reload failed")
                last = {"error": f"{type(e).__name__}: {e}"}
            self.record.record({"seconds": round(time.monotonic() - t0, 3), **last})
            return self.record.as_dict()

    async def _reload(self) -> dict:
        live = [r for r in self.replicas[1:] if self.health[r.index].removed_at is None]
        up = [r for r in live if self.health[r.index].up]
        # On the drives' time, not the loop's: a hung mirror leaves this thread behind, not the mount.
        checked, verdicts, primary_changed = await self._headers.run(
            _recheck_readable, self.tree, self.files, self.replicas[0], up, self._own_dev(),
            within=HEADERS_WITHIN,
        )  # fmt: skip
        for r in live:
            if r not in checked:
                log.warning(
                    "reload: mirror %s is down or cannot be read; its copies left as they were", r.root
                )
        verdicts, refused = await self._proven_on_reload(verdicts)
        for relpath in primary_changed:
            log.warning(
                "reload: %s: the primary changed since mount (not supported while mounted); opens "
                "of it fail (EIO) until it is mounted again (files open before read the file mounted)",
                relpath,
            )
        applied, busy = await self._apply([replace(v, why=f"{v.why} (reload)") for v in verdicts])
        await self._vouch()
        if applied:
            self._reweigh(None)
        self._changed()
        changes = self._summary(applied, busy, checked, refused)
        for c in changes:
            log.info("reload: mirror %s: %d files added, %d dropped, %d model files served%s",
                     c["path"], len(c["added"]), len(c["dropped"]), c["model_files"],
                     f", {len(c['busy'])} busy (left as they were)" if c["busy"] else "")  # fmt: skip
        return {"mirrors": changes, "primary_changed": primary_changed}

    async def _apply(
        self, verdicts: list[Verdict], give_up: float = BUSY_GIVE_UP
    ) -> tuple[list[Verdict], list[Verdict]]:
        """Each verdict in the engine, then in the catalogue; (applied, busy): a copy whose file
        stays busy past `give_up` seconds keeps its old state until the next reload (or, when its
        change waits on the file's lock, takes effect once the lock is free: `_landed`)."""
        applied, waiting, late = [], list(verdicts), []
        deadline = time.monotonic() + give_up
        while waiting:  # one pass at least, whatever `give_up`
            later = []
            for v in waiting:
                f = self.files[v.ino]
                done = await self._put(f, v)
                if done is None:
                    late.append(v)
                    continue
                if not done:
                    later.append(v)
                    continue
                f.recheck(v.drive, v.identity, self.replicas[v.drive].root, v.why)
                applied.append(v)
            waiting = later
            if not waiting or time.monotonic() > deadline:
                break
            await trio.sleep(BUSY_RETRY)
        for v in waiting:
            log.warning("reload: %s: mirror %s: busy, left as it was until the next reload",
                        self.files[v.ino].relpath, self.replicas[v.drive].root)  # fmt: skip
        for v in late:
            log.warning("reload: %s: mirror %s: its file's lock is held (a slow open of the primary?); "
                        "the change takes effect once it is free", self.files[v.ino].relpath,
                        self.replicas[v.drive].root)  # fmt: skip
        return applied, waiting + late

    async def _put(self, f: ServedFile, v: Verdict) -> bool | None:
        """The verdict in the engine: True in force, False busy (ask again), None when it still
        waits for the file's lock after SET_COPY_WITHIN (it lands later: `_landed`). The native
        engine takes the file's lock, which a primary open holds for as long as the open takes:
        that wait happens on a thread, never on the loop."""
        if not self._set_copy_blocks:
            return self._set_copy(f, v.drive, v.identity)
        key = (v.ino, v.drive)
        if key in self._late:  # an earlier change of this copy still waits for the lock
            return None
        hand = _Handover()
        token = trio.lowlevel.current_trio_token()

        def call() -> None:
            if not hand.begin():
                return  # given up on before it began
            ok = self._set_copy(f, v.drive, v.identity)
            if hand.end(ok):  # the loop gave up waiting: it lands on its own
                with contextlib.suppress(trio.RunFinishedError):
                    trio.from_thread.run_sync(self._landed, f, v, ok, trio_token=token)

        with trio.move_on_after(SET_COPY_WITHIN):
            await trio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=self._setting)
        outcome = hand.give_up()
        if outcome is None:
            self._late.add(key)
        return outcome

    def _landed(self, f: ServedFile, v: Verdict, ok: bool) -> None:
        """A change of copy that waited on its file's lock past SET_COPY_WITHIN is in the engine
        now (ok) or was refused as busy: the catalogue follows (on the loop)."""
        self._late.discard((v.ino, v.drive))
        if not ok:
            return
        f.recheck(v.drive, v.identity, self.replicas[v.drive].root, v.why)
        self._reweigh(None)
        self._changed()
        log.info("reload: %s: mirror %s: %s, in force now that the file's lock is free",
                 f.relpath, self.replicas[v.drive].root, v.why)  # fmt: skip

    def _own_dev(self) -> int | None:
        """The mount's own device, once it is mounted (None before, and without a mount point)."""
        if self._mount_dev is None and self.mountpoint is not None:
            entry = mount_at(self.mountpoint)  # /proc/self/mountinfo: never waits on a drive
            self._mount_dev = entry.dev if entry is not None else None
        return self._mount_dev

    async def _proven_on_reload(self, verdicts: list[Verdict]) -> tuple[list[Verdict], dict[int, list[str]]]:
        """The verdicts, those whose copy would serve proven first (colifs.proof, sampled): a copy
        not proven does not serve; one held before, that changed and is not proven, is dropped.
        (what is put in force, the files refused per mirror)."""
        roots = {r.index: r.root for r in self.replicas}
        try:
            refused = await self._prove(verdicts, roots, False, PROOF_WITHIN, "reload")
        except TimedOut as e:
            log.warning(
                "reload: the copies found were not proven (%s); not used until a reload proves them", e
            )
            refused = {(v.ino, v.drive): "" for v in verdicts if v.identity is not None}
        kept, out = [], {}
        for v in verdicts:
            why = refused.get((v.ino, v.drive))
            if why is None:
                kept.append(v)
                continue
            f = self.files[v.ino]
            if why:  # its bytes differ (a timeout was said once, above)
                out.setdefault(v.drive, []).append(f.relpath)
                log.warning("reload: %s: mirror %s: not used: %s", f.relpath, roots[v.drive], why)
            if v.drive in f.copies:  # held before, and not the copy that was proven then
                kept.append(Verdict(v.ino, v.drive, None, f"not proven: {why or 'no time'}"))
        return kept, out

    async def _prove(
        self, verdicts: list[Verdict], roots: Mapping[int, str], deep: bool, within: float, label: str
    ) -> dict[tuple[int, int], str]:
        """Prove the copies that would serve (colifs.proof); why each that is not, by
        (ino, drive). TimedOut when the proof did not end in time (it is stopped)."""
        claims: dict[tuple[int, int], Claim] = {}
        for v in verdicts:
            if v.identity is None:
                continue
            f, st = self.files[v.ino], self.tree.nodes[v.ino].st
            primary = os.path.join(self.replicas[0].root, f.relpath)
            mirror = os.path.join(roots[v.drive], f.relpath)
            claims[(v.ino, v.drive)] = Claim(
                f.relpath, primary, mirror, (st.st_ino, f.size, st.st_mtime_ns), v.identity
            )
        if not claims:
            return {}
        shown = Proving(label, "deep" if deep else "sampled", len(claims), 0)
        self.record.proving(shown)
        stop = threading.Event()
        log.info(
            "%s: comparing %d copies with the primary (%s) before they serve", label, len(claims), shown.mode
        )
        try:
            await self._proofs.run(prove, self.io, list(claims.values()), deep, stop, shown, within=within)
        except BaseException as e:  # a timeout, an unmount, SIGTERM: the proof stops at its next range
            shown.end(f"stopped ({e or type(e).__name__})")
            raise
        finally:
            stop.set()
        shown.end(f"{len(shown.refused)} of {len(claims)} refused" if shown.refused else "proven")
        by_path = {c.mirror: key for key, c in claims.items()}
        return {by_path[path]: why for path, why in shown.refused.items()}

    def _summary(
        self, applied: list[Verdict], busy: list[Verdict], checked: list[Replica],
        refused: Mapping[int, list[str]] | None = None,
    ) -> list[dict]:  # fmt: skip
        models = [f for f in self.files.values() if f.is_model]

        def names(verdicts: list[Verdict], drive: int, serving: bool | None = None) -> list[str]:
            """The files of `verdicts` on `drive` (only those that serve, or not, unless None)."""
            return sorted(
                self.files[v.ino].relpath
                for v in verdicts
                if v.drive == drive and (serving is None or (v.identity is not None) == serving)
            )

        return [
            {
                "path": r.root,
                "checked": r in checked,
                "removed": self.health[r.index].removed_at is not None,
                "added": names(applied, r.index, True),
                "dropped": names(applied, r.index, False),
                "busy": names(busy, r.index),
                "refused": sorted((refused or {}).get(r.index, [])),
                "model_files": sum(1 for f in models if r.index in f.copies),
            }
            for r in self.replicas[1:]
        ]

    # -- mirrors taken away and brought back (colifs mirror remove / add) ----------------------

    async def _replica(self, path: str) -> Replica | None:
        """The replica whose directory `path` names: as given first (the roots were resolved at
        mount and are compared as strings, never resolved again: a mirror is removed because its
        drive hangs), else resolved, off the loop (a path through a hung drive must not stop the
        daemon, nor the commands after it)."""
        given = os.path.abspath(path)
        found = next((r for r in self.replicas if r.root == given), None)
        if found is not None:
            return found
        real = await self._judged(os.path.realpath, given)
        return next((r for r in self.replicas if r.root == real), None)

    async def _judged(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` (it stats directories) off the loop, within JUDGE_WITHIN seconds."""
        try:
            return await self._dirs.run(fn, *args, within=JUDGE_WITHIN)
        except TimedOut as e:
            raise NotReloadedError(f"{args[0]}: not judged ({e}); nothing changed") from None

    async def remove_mirror(self, path: str, wait: float) -> dict:
        """Take mirror `path` away: no new read goes to it, reads in flight on it finish (or fall
        back to the primary), then the engine closes every descriptor it holds there. Returns once
        none is left (its drive can be unmounted); BusyError after `wait` seconds if some still are
        (reads stuck in a hung drive): it stays out of the routing, and a second remove waits again."""
        async with self._lock:
            r = await self._replica(path)
            if r is None:
                raise UsageError(f"{path} is not a mirror of this mount ({self._mirrors()})")
            if r.index == 0:
                raise UsageError(f"{path} is the primary: it serves every byte and cannot be removed")
            h = self.health[r.index]
            if h.removed_at is not None and r.index not in self._unfinished:
                raise UsageError(f"{path} was removed already (colifs mirror add puts it back)")
            held = self._held_on(r.index)
            t0 = time.monotonic()
            h.remove()
            log.info("mirror %s: removing (%d files served from it)", r.root, len(held))
            why = "removed (colifs mirror remove)"
            applied, busy = await self._apply([Verdict(ino, r.index, None, why) for ino in held], wait)
            self._reweigh(None)
            self._changed()
            # Its copies out: the calls of the generation it leaves (this removal's, or a removal's
            # before that left a copy in) are watched until they return.
            self._renew(r.root, r.index)
            left, calls = await self._closed(r.root, t0 + wait)
            change = {
                "command": "remove", "path": r.root, "files": len(applied), "busy": len(busy),
                "descriptors_left": len(left), "calls_left": calls,
                "seconds": round(time.monotonic() - t0, 3),
            }  # fmt: skip
            self.record.changed_mirror(change)
            if busy or left or calls:
                self._unfinished.add(r.index)
                raise BusyError(
                    f"{r.root}: after {wait:g} s, {len(busy)} files are still read from it, "
                    f"{len(left)} descriptors are open there and {calls} calls are still inside its "
                    "drive (a hung open or read?); its other files no longer use it, and a mirror "
                    "added in its place does not wait for them; run colifs mirror remove again"
                )
            self._unfinished.discard(r.index)
            log.info("mirror %s: removed in %.2f s; no descriptor left on it", r.root, change["seconds"])
            return change

    def _renew(self, root: str, drive: int) -> None:
        """A new generation serves the slot (colifs.native retire_drive); the threads still in a
        call on the one it retires are watched (stats.json reload.calls_left_behind)."""
        self._behind = [*self._behind, (root, self._retire(drive))]

    def _held_on(self, drive: int) -> list[int]:
        """The files whose copy on `drive` a removal takes out: those it serves, those dropped as
        changed while serving (the engine may hold their descriptors), and those whose change still
        waits for their file's lock (it may put a copy in force)."""
        late = {ino for ino, d in self._late if d == drive}
        return [i for i, f in self.files.items() if i in late or drive in f.copies or drive in f.identities]

    async def _closed(self, root: str, deadline: float) -> tuple[list[str], int]:
        """Wait until the daemon holds no descriptor under `root` and no thread is inside a call
        into it (or the deadline): the descriptors and the calls left."""
        while True:
            left = await trio.to_thread.run_sync(held_under, root)
            calls = sum(n for r, n in self._calls_behind() if r == root)
            if (not left and not calls) or time.monotonic() >= deadline:
                self._behind = [(r, c) for r, c in self._behind if c()]  # the others are over for good
                return left, calls
            await trio.sleep(CLOSED_POLL)

    def _known(self) -> list[tuple[str, str]]:
        """Each replica's (root, state) for colifs.checks.judge_mirror."""

        def state(r: Replica) -> str:
            h = self.health[r.index]
            return (
                "primary"
                if r.index == 0
                else "removed"
                if h.removed_at is not None
                else "up"
                if h.up
                else "down"
            )

        return [(r.root, state(r)) for r in self.replicas]

    def _calls_behind(self) -> list[tuple[str, int]]:
        """(root, calls) of the removed mirrors' drives with calls inside them now. Read from any
        thread (stats): the list is replaced, never changed in place."""
        now = [(root, calls()) for root, calls in self._behind]
        return [x for x in now if x[1]]

    def left_behind(self) -> list[dict]:
        """What stats.json shows: each removed mirror whose drive still has calls inside it."""
        return [{"path": root, "calls": n} for root, n in self._calls_behind()]

    async def add_mirror(self, path: str, weight: float | None, wait: float, deep: bool = False) -> dict:
        """A mirror joins: one removed before (its drive back), or a new directory (in the slot of
        one removed, else in a new one). Judged as at mount (colifs.checks.judge_mirror: not the
        mount point nor under it, not the primary nor a live mirror, an HF cache repository as
        its snapshot) and validated as at mount (size, header, receipt); then its valid copies
        prove their bytes (colifs.proof: sampled, or every byte if `deep`) within `wait` seconds,
        and those proven serve at once, with `weight` if given; else a new directory's is measured
        (a short probe against the primary), a removed one's is the one it had."""
        async with self._lock:
            t0 = time.monotonic()
            mnt, dev = self.mountpoint, self._own_dev()
            real, known = await self._judged(judge_mirror, path, mnt, dev, self._known(), self.revision)
            slot, new = self._slot(path, known)
            root = real if new else slot.root  # type: ignore[union-attr]
            index = len(self.replicas) if slot is None else slot.index
            valid = await self._valid_copies(root, index, max(t0 + wait - time.monotonic(), 0.0))
            proven, refused = await self._proven_to_add(valid, root, index, deep, t0 + wait)
            if new:
                index = self._place(root, weight, None if slot is None else slot.index)
                one_drive([r.root for r in self.replicas])
                if slot is not None:
                    self.health[index].another_directory()
            else:  # back: on threads of its own, whatever its removal left in the drive
                self._renew(root, index)
            self.health[index].restore()
            self._unfinished.discard(index)
            applied, busy = await self._apply(proven, wait)
            await self._vouch()
            self._changed()
            change = {"command": "add", "path": root, "files": len(applied), "busy": len(busy)}
            change["proof"] = {"mode": "deep" if deep else "sampled", "files": len(valid), "refused": refused}
            change.update(await self._weigh(index, weight, new))
            change["seconds"] = round(time.monotonic() - t0, 3)
            self.record.changed_mirror(change)
            log.info("mirror %s: added, %d files served from it", root, len(applied))
            return change

    async def _valid_copies(self, root: str, index: int, within: float) -> list[Verdict]:
        """The copies under `root` that may serve (as at mount); UsageError when there is none."""
        candidate = Replica(index, root, 1.0)
        try:
            verdicts, _ = await self._headers.run(
                recheck, self.tree, self.files, [self.replicas[0], candidate], self._own_dev(), within=within
            )
        except TimedOut as e:
            raise NotReloadedError(f"{root}: its copies were not checked ({e}); nothing changed") from None
        valid = [v for v in verdicts if v.identity is not None]
        if not valid:
            raise UsageError(
                f"{root} holds no copy of this model's files that matches the primary's "
                "(size and header): not a replica; nothing changed"
            )
        return valid

    async def _proven_to_add(
        self, valid: list[Verdict], root: str, index: int, deep: bool, deadline: float
    ) -> tuple[list[Verdict], dict[str, str]]:
        """Of the valid copies of a mirror to add, those that prove their bytes by `deadline`
        (and, by relative path, why each other one did not). UsageError when none does;
        NotReloadedError when the proof does not end in time: nothing changed then."""
        mode = "every byte" if deep else "sampled ranges"
        within = max(deadline - time.monotonic(), 0.0)
        try:
            refused = await self._prove(valid, {index: root}, deep, within, root)
        except TimedOut as e:
            shown = self.record.proof
            if isinstance(e, Crowded) or shown is None:
                raise NotReloadedError(f"{root}: its copies were not proven ({e}); nothing changed") from None
            raise NotReloadedError(
                f"{root}: its copies were not proven against the primary ({mode}) within {within:.0f} s "
                f"({human(shown.bytes_done)} of {human(shown.bytes)} compared); nothing changed "
                "(a longer --timeout)"
            ) from None
        why = {self.files[ino].relpath: text for (ino, _), text in refused.items()}
        for relpath, text in sorted(why.items()):
            log.warning("mirror %s: %s: not used: %s", root, relpath, text)
        proven = [v for v in valid if (v.ino, v.drive) not in refused]
        if not proven:
            first = min(why)
            raise UsageError(
                f"{root}: none of its {len(valid)} copies holds the primary's bytes ({first}: {why[first]}); "
                "not a replica; nothing changed"
            )
        return proven, why

    async def _vouch(self) -> None:
        """The receipts read again: which copies a `colifs stage` receipt vouches for."""
        try:
            vouched = await self._headers.run(
                vouched_copies, self.files, self.tree, self.replicas, within=HEADERS_WITHIN
            )
        except TimedOut as e:
            log.warning("the receipts were not read again (%s); what they vouch for is as it was", e)
            return
        for ino, f in self.files.items():
            f.vouch(vouched.get(ino, ()))

    async def _weigh(self, index: int, weight: float | None, new: bool) -> dict:
        """The added mirror's weight in force: given, else (a new directory) measured, else the
        one it had; what stats.json says of it."""
        if weight is not None:
            self._reweigh(Weight(index, weight))
            return {"weight": weight}
        if not new:
            self._reweigh(None)
            return {"weight": None}
        try:
            ratio = await self._probes.run(self._measure, index, within=MEASURE_WITHIN)
        except TimedOut as e:
            log.warning(
                "mirror %s: not probed (%s); it serves with the primary's weight",
                self.replicas[index].root,
                e,
            )
            ratio = None
        self._reweigh(None if ratio is None else Weight(index, ratio, of_primary=True))
        return {"weight": None, "measured_vs_primary": ratio}

    def _slot(self, path: str, known: int | None) -> tuple[Replica | None, bool]:
        """Where mirror `path` joins: its own slot (`known`: it was removed before), or (new: True)
        the first slot of a mirror removed, or (None, True) a new one. UsageError when it may not."""
        if known is not None:  # judge_mirror refused the primary and live mirrors
            return self.replicas[known], False
        free = self._free_slots()
        if free:
            return free[0], True
        if len(self.replicas) >= MAX_REPLICAS:
            raise UsageError(f"{path}: a mount serves at most {MAX_REPLICAS} replicas; remove a mirror first")
        return None, True

    def _free_slots(self) -> list[Replica]:
        """The removed mirrors' slots a new directory may take: those whose removal finished; else
        those whose removal left only calls or descriptors in the old drive, no copy: the slot
        gets a generation of its own in the engine, which never waits for them."""
        removed = [x for x in self.replicas[1:] if self.health[x.index].removed_at is not None]
        done = [x for x in removed if x.index not in self._unfinished]
        return done or [x for x in removed if not any(x.index in f.copies for f in self.files.values())]

    def _measure(self, drive: int) -> float | None:
        """The new mirror's read rate over the primary's, each probed alone for a moment (what a
        mount without weights does); None when either holds nothing to read."""
        new, primary = (
            probe_replica(self.replicas[d], list(self.files.values()), MEASURE_S) for d in (drive, 0)
        )
        if not new.mb_per_s or not primary.mb_per_s:
            return None
        log.info(
            "mirror %s: probed %.0f MB/s, primary %.0f MB/s", new.replica.root, new.mb_per_s, primary.mb_per_s
        )
        return new.mb_per_s / primary.mb_per_s

    def _mirrors(self) -> str:
        return "its mirrors: " + (", ".join(r.root for r in self.replicas[1:]) or "none")


class _Handover:
    """Who finishes a change of copy made on a thread: the loop, which waits for it up to
    SET_COPY_WITHIN, or, once the loop gave up waiting, the thread itself (it lands late)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "waiting"  # -> running -> done; or -> dropped (never began) / late
        self._result = False

    def begin(self) -> bool:
        """On the thread: False when the loop gave up before the call began (it must not)."""
        with self._lock:
            if self._state == "dropped":
                return False
            self._state = "running"
            return True

    def end(self, ok: bool) -> bool:
        """On the thread, after the call: True when the loop gave up meanwhile (the thread finishes)."""
        with self._lock:
            late = self._state == "late"
            self._state, self._result = "done", ok
            return late

    def give_up(self) -> bool | None:
        """On the loop, once done waiting: the call's result, False if it never began, None if it
        runs on (it lands on its own)."""
        with self._lock:
            if self._state == "done":
                return self._result
            if self._state == "waiting":
                self._state = "dropped"
                return False
            self._state = "late"
            return None
