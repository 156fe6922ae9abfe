"""Reload: every mirror checked again while the mount serves, as at mount (size, header, receipt).

A copy staged or repaired since the mount starts serving; one that changed or went away stops;
the partial-mirror weights follow the new set of copies. `recheck` reads the headers (never tensor
data) and returns what changed, without touching the mount; `Reloader` puts it in force: the
engine's per-file copies first (a read in flight finishes on the copy it started with, or is read
from the primary), then the catalogue, the receipts and the weights. `Reloads` keeps what
stats.json shows of it. The primary cannot change while mounted: a reload that finds it changed
says so and leaves that file as it is.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import trio

from colifs.catalogue import ServedFile, mirror_problem, vouched_copies
from colifs.formats import format_for
from colifs.formats.layout import LayoutError
from colifs.formats.moe import Configs
from colifs.health import Health
from colifs.replicas import Identity, Replica
from colifs.tree import Tree

log = logging.getLogger("colifs")

BUSY_RETRY = 0.05  # s between tries of a copy whose file is busy retiring descriptors
BUSY_GIVE_UP = 5.0  # s after which such a copy waits for the next reload


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
            continue
        for r in replicas[1:]:
            problem, ident = mirror_problem(os.path.join(r.root, f.relpath), f.size, header)
            held = r.index in f.copies
            if ident is not None and not (held and f.identities.get(r.index) == ident):
                verdicts.append(Verdict(ino, r.index, ident, "changed" if held else "added"))
            elif ident is None and held:
                verdicts.append(Verdict(ino, r.index, None, problem or "not usable"))
    return verdicts, primary_changed


def _primary_header(tree: Tree, ino: int, f: ServedFile, configs: Configs) -> bytes | None:
    """The header the mirrors must match; None when the primary's file is not the one mounted."""
    path = os.path.join(tree.root, f.relpath)
    mounted = tree.nodes[ino].st
    fmt = format_for(path)
    try:
        st = os.stat(path)
        now, then = (st.st_ino, st.st_size, st.st_mtime_ns), (mounted.st_ino, f.size, mounted.st_mtime_ns)
        if fmt is None or now != then:
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

    def begin(self) -> None:
        self.started += 1

    def record(self, last: dict) -> None:
        self.count += 1
        self.last = {"at": round(time.time(), 1), **last}

    def as_dict(self) -> dict:
        return {"started": self.started, "count": self.count, "last": self.last}


class Reloader:
    """Runs reloads for a mount, one at a time: `set_copy(f, drive, identity)` puts a verdict in
    force in the engine (False: busy, ask again); `reweigh()` recomputes the weights once the
    copies changed. A mirror that is down (health) or whose directory cannot be read is left as it
    is: a drive that went away for a moment must not lose every copy."""

    def __init__(
        self,
        tree: Tree,
        files: Mapping[int, ServedFile],
        replicas: Sequence[Replica],
        health: Sequence[Health],
        set_copy: Callable[[ServedFile, int, Identity | None], bool],
        reweigh: Callable[[], None],
        record: Reloads,
    ) -> None:
        self.tree = tree
        self.files = files
        self.replicas = list(replicas)
        self.health = health
        self._set_copy = set_copy
        self._reweigh = reweigh
        self.record = record
        self._lock = trio.Lock()

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
        checked = [r for r in self.replicas[1:] if self.health[r.index].up and os.path.isdir(r.root)]
        for r in self.replicas[1:]:
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
                "reload: %s: the primary changed since mount (not supported while mounted); "
                "served as before, unmount and mount again to serve the new file",
                relpath,
            )
        applied, busy = await self._apply(verdicts)
        vouched = await trio.to_thread.run_sync(
            vouched_copies, self.files, self.tree, self.replicas, abandon_on_cancel=True
        )
        for ino, f in self.files.items():
            f.vouch(vouched.get(ino, ()))
        if applied:
            self._reweigh()
        changes = self._summary(applied, busy, checked)
        for c in changes:
            log.info("reload: mirror %s: %d files added, %d dropped, %d model files served%s",
                     c["path"], len(c["added"]), len(c["dropped"]), c["model_files"],
                     f", {len(c['busy'])} busy (left as they were)" if c["busy"] else "")  # fmt: skip
        return {"mirrors": changes, "primary_changed": primary_changed}

    async def _apply(self, verdicts: list[Verdict]) -> tuple[list[Verdict], list[Verdict]]:
        """Each verdict in the engine, then in the catalogue; (applied, busy): a copy whose file
        stays busy past BUSY_GIVE_UP keeps its old state until the next reload."""
        applied, waiting = [], list(verdicts)
        deadline = time.monotonic() + BUSY_GIVE_UP
        while waiting and time.monotonic() <= deadline:
            later = []
            for v in waiting:
                f = self.files[v.ino]
                if not self._set_copy(f, v.drive, v.identity):
                    later.append(v)
                    continue
                f.recheck(v.drive, v.identity, self.replicas[v.drive].root, v.why)
                applied.append(v)
            waiting = later
            if waiting:
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
                "added": sorted(self.files[v.ino].relpath for v in mine if v.identity is not None),
                "dropped": sorted(self.files[v.ino].relpath for v in mine if v.identity is None),
                "busy": sorted(self.files[v.ino].relpath for v in busy if v.drive == r.index),
                "model_files": sum(1 for f in models if r.index in f.copies),
            })  # fmt: skip
        return out
