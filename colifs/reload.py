"""Reload: every mirror checked again while the mount serves, as at mount (size, header, receipt).

A copy staged or repaired since the mount starts serving; one that changed or went away stops;
the partial-mirror weights follow the new set of copies. `recheck` reads the headers (never tensor
data) and returns what changed, without touching the mount; `Reloader` puts it in force: the
engine's per-file copies first (a read in flight finishes on the copy it started with, or is read
from the primary), then the catalogue, the receipts and the weights. `Reloads` keeps what
stats.json shows of it. The primary cannot change while mounted: a primary file found changed is
refused to new opens (EIO) by the engines, the reload says which, and drops its mirror copies that
changed too (the others still hold the bytes mounted, which the files open before read on).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import trio

from colifs.catalogue import ServedFile, mirror_problem, vouched_copies
from colifs.devices import one_drive
from colifs.errors import BusyError, UsageError
from colifs.formats import format_for
from colifs.formats.layout import LayoutError
from colifs.formats.moe import Configs
from colifs.health import Health
from colifs.kernel import held_under
from colifs.probe import probe_replica
from colifs.replicas import Identity, Replica, identity
from colifs.tree import Tree

log = logging.getLogger("colifs")

BUSY_RETRY = 0.05  # s between tries of a copy whose file is busy retiring descriptors
BUSY_GIVE_UP = 5.0  # s after which such a copy waits for the next reload
CLOSED_POLL = 0.05  # s between looks at the descriptors a removed mirror still has open
MEASURE_S = 1.0  # s each of the probes that weigh a new mirror against the primary
MAX_REPLICAS = 8  # as the native engine's tables (native/engine.h): the primary and 7 mirrors


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
    tree: Tree, files: Mapping[int, ServedFile], replicas: Sequence[Replica]
) -> tuple[list[Verdict], list[str]]:
    """(the copies whose state changes, the model files whose primary changed since mount).
    Reads each model file's header on the primary and on every mirror."""
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
            problem, ident = mirror_problem(os.path.join(r.root, f.relpath), f.size, header)
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


@dataclass
class Reloads:
    """What stats.json shows: how many reloads started and ran, the last one's time and what it
    changed (or why it failed)."""

    started: int = 0
    count: int = 0
    last: dict = field(default_factory=dict)
    mirror_change: dict = field(default_factory=dict)  # the last `colifs mirror add/remove`
    # Calls still inside the drives of removed mirrors (Reloader.left_behind), looked at each time.
    _behind: Callable[[], list[dict]] = lambda: []

    def begin(self) -> None:
        self.started += 1

    def record(self, last: dict) -> None:
        self.count += 1
        self.last = {"at": round(time.time(), 1), **last}

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
            "calls_left_behind": self._behind(),
        }


class Reloader:
    """Runs reloads for a mount, one at a time: `set_copy(f, drive, identity)` puts a verdict in
    force in the engine (False: busy, ask again); `reweigh()` recomputes the weights once the
    copies changed; `retire(drive)` gives a removed mirror's slot a new generation in the engine
    (threads and counts of its own, so that nothing a mirror put there later does waits for a call
    stuck in the removed drive) and returns what counts the calls left in the old one. A mirror
    that is down (health) or whose directory cannot be read is left as it is: a drive that went
    away for a moment must not lose every copy."""

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
        checked = [r for r in live if self.health[r.index].up and os.path.isdir(r.root)]
        for r in live:
            if r not in checked:
                log.warning(
                    "reload: mirror %s is down or cannot be read; its copies left as they were", r.root
                )
        # On the drives' time, not the loop's: a hung mirror leaves this thread behind, not the mount.
        verdicts, primary_changed = await trio.to_thread.run_sync(
            recheck, self.tree, self.files, [self.replicas[0], *checked], abandon_on_cancel=True
        )
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
        changes = self._summary(applied, busy, checked)
        for c in changes:
            log.info("reload: mirror %s: %d files added, %d dropped, %d model files served%s",
                     c["path"], len(c["added"]), len(c["dropped"]), c["model_files"],
                     f", {len(c['busy'])} busy (left as they were)" if c["busy"] else "")  # fmt: skip
        return {"mirrors": changes, "primary_changed": primary_changed}

    async def _apply(
        self, verdicts: list[Verdict], give_up: float = BUSY_GIVE_UP
    ) -> tuple[list[Verdict], list[Verdict]]:
        """Each verdict in the engine, then in the catalogue; (applied, busy): a copy whose file
        stays busy past `give_up` seconds keeps its old state until the next reload."""
        applied, waiting = [], list(verdicts)
        deadline = time.monotonic() + give_up
        while waiting:  # one pass at least, whatever `give_up`
            later = []
            for v in waiting:
                f = self.files[v.ino]
                if not self._set_copy(f, v.drive, v.identity):
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
        return applied, waiting

    def _summary(self, applied: list[Verdict], busy: list[Verdict], checked: list[Replica]) -> list[dict]:
        models = [f for f in self.files.values() if f.is_model]
        out = []
        for r in self.replicas[1:]:
            mine = [v for v in applied if v.drive == r.index]
            out.append({
                "path": r.root,
                "checked": r in checked,
                "removed": self.health[r.index].removed_at is not None,
                "added": sorted(self.files[v.ino].relpath for v in mine if v.identity is not None),
                "dropped": sorted(self.files[v.ino].relpath for v in mine if v.identity is None),
                "busy": sorted(self.files[v.ino].relpath for v in busy if v.drive == r.index),
                "model_files": sum(1 for f in models if r.index in f.copies),
            })  # fmt: skip
        return out

    # -- mirrors taken away and brought back (colifs mirror remove / add) ----------------------

    def _replica(self, path: str) -> Replica | None:
        real = os.path.realpath(path)
        return next((r for r in self.replicas if os.path.realpath(r.root) == real), None)

    async def remove_mirror(self, path: str, wait: float) -> dict:
        """Take mirror `path` away: no new read goes to it, reads in flight on it finish (or fall
        back to the primary), then the engine closes every descriptor it holds there. Returns once
        none is left (its drive can be unmounted); BusyError after `wait` seconds if some still are
        (reads stuck in a hung drive): it stays out of the routing, and a second remove waits again."""
        async with self._lock:
            r = self._replica(path)
            if r is None:
                raise UsageError(f"{path} is not a mirror of this mount ({self._mirrors()})")
            if r.index == 0:
                raise UsageError(f"{path} is the primary: it serves every byte and cannot be removed")
            h = self.health[r.index]
            if h.removed_at is not None and r.index not in self._unfinished:
                raise UsageError(f"{path} was removed already (colifs mirror add puts it back)")
            # With the copies dropped as changed while serving: the engine may hold their descriptors.
            held = [ino for ino, f in self.files.items() if r.index in f.copies or r.index in f.identities]
            t0 = time.monotonic()
            first = h.removed_at is None
            h.remove()
            log.info("mirror %s: removing (%d files served from it)", r.root, len(held))
            why = "removed (colifs mirror remove)"
            applied, busy = await self._apply([Verdict(ino, r.index, None, why) for ino in held], wait)
            self._reweigh(None)
            if first:  # its copies out: no new call starts in its drive, whatever the slot serves next
                self._behind = [*self._behind, (r.root, self._retire(r.index))]
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

    def _calls_behind(self) -> list[tuple[str, int]]:
        """(root, calls) of the removed mirrors' drives with calls inside them now. Read from any
        thread (stats): the list is replaced, never changed in place."""
        now = [(root, calls()) for root, calls in self._behind]
        return [x for x in now if x[1]]

    def left_behind(self) -> list[dict]:
        """What stats.json shows: each removed mirror whose drive still has calls inside it."""
        return [{"path": root, "calls": n} for root, n in self._calls_behind()]

    async def add_mirror(self, path: str, weight: float | None, wait: float) -> dict:
        """A mirror joins: one removed before (its drive back), or a new directory (in the slot of
        one removed, else in a new one). Validated as at mount (size, header, receipt), its valid
        copies serve at once, with `weight` if given; else a new directory's is measured (a short
        probe against the primary), a removed one's is the one it had."""
        async with self._lock:
            slot, new = self._slot(path)
            root = os.path.abspath(path) if new else slot.root
            if not os.path.isdir(root):
                raise UsageError(f"{root} is not a directory (is its drive mounted?)")
            t0 = time.monotonic()
            index = len(self.replicas) if slot is None else slot.index
            valid = await self._valid_copies(root, index)
            if new:
                index = self._place(root, weight, None if slot is None else slot.index)
                one_drive([r.root for r in self.replicas])
            self.health[index].restore()
            self._unfinished.discard(index)
            applied, busy = await self._apply(valid, wait)
            await self._vouch()
            change = {"command": "add", "path": root, "files": len(applied), "busy": len(busy)}
            change.update(await self._weigh(index, weight, new))
            change["seconds"] = round(time.monotonic() - t0, 3)
            self.record.changed_mirror(change)
            log.info("mirror %s: added, %d files served from it", root, len(applied))
            return change

    async def _valid_copies(self, root: str, index: int) -> list[Verdict]:
        """The copies under `root` that may serve (as at mount); UsageError when there is none."""
        candidate = Replica(index, root, 1.0)
        verdicts, _ = await trio.to_thread.run_sync(
            recheck, self.tree, self.files, [self.replicas[0], candidate], abandon_on_cancel=True
        )
        valid = [v for v in verdicts if v.identity is not None]
        if not valid:
            raise UsageError(
                f"{root} holds no copy of this model's files that matches the primary's "
                "(size and header): not a replica; nothing changed"
            )
        return valid

    async def _vouch(self) -> None:
        """The receipts read again: which copies a `colifs stage` receipt vouches for."""
        vouched = await trio.to_thread.run_sync(
            vouched_copies, self.files, self.tree, self.replicas, abandon_on_cancel=True
        )
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
        ratio = await trio.to_thread.run_sync(self._measure, index, abandon_on_cancel=True)
        self._reweigh(None if ratio is None else Weight(index, ratio, of_primary=True))
        return {"weight": None, "measured_vs_primary": ratio}

    def _slot(self, path: str) -> tuple[Replica | None, bool]:
        """Where mirror `path` joins: its own slot (removed before), or (new: True) the first slot
        of a mirror removed, or (None, True) a new one. UsageError when it may not."""
        r = self._replica(path)
        if r is not None and r.index == 0:
            raise UsageError(f"{path} is the primary of this mount, not a mirror")
        if r is not None and self.health[r.index].removed_at is None:
            raise UsageError(f"{path} is a mirror of this mount already")
        if r is not None:
            return r, False
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
