"""Usage while mounted: what is served is counted (the pyfuse3 engine's `Tally`, or the native
engine's counters) and a `UsageRecorder` adds it to the usage file now and then and at unmount.

A save that fails keeps what it was given for the next one, so nothing counted is lost; a file that
cannot be read or a directory that cannot be written is said once, at mount.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from colifs.checks import check_usage_path
from colifs.formats.layout import Key
from colifs.replicas import Replica
from colifs.stores import same_or_inside
from colifs.usage import USAGE_NAME, BadUsageFile, Usage, load, save

log = logging.getLogger("colifs")


class UsageSource(Protocol):
    """Where the served usage accumulates: a `Tally`, or the native engine's counters."""

    def take_usage(self) -> Usage: ...

    def restore_usage(self, usage: Usage) -> None: ...


class Tally:
    """The pyfuse3 engine's count of what it served, per key and file (on the loop's thread)."""

    def __init__(self) -> None:
        self._pending = Usage(runs=1)  # this run counts once, with its first save

    def count(self, key: Key, nbytes: int) -> None:
        self._pending.count(key, nbytes)

    def count_file(self, relpath: str, nbytes: int) -> None:
        self._pending.count_file(relpath, nbytes)

    def take_usage(self) -> Usage:
        """What was counted since the last take."""
        out, self._pending = self._pending, Usage()
        return out

    def restore_usage(self, usage: Usage) -> None:
        """Taken but not saved: counted again with the next take."""
        self._pending.add(usage)


def usage_file(enabled: bool, given: str | None, replicas: Sequence[Replica]) -> str | None:
    """Where usage is saved (PRIMARY/.colifs-usage.json by default, never on a mirror); None: off."""
    if not enabled:
        return None
    return check_usage_path(given or os.path.join(replicas[0].root, USAGE_NAME), replicas)


def hidden(path: str | None, root: str) -> Callable[[str], bool]:
    """The usage file changes while mounted: kept out of the (snapshot) tree, with its temporaries."""
    if path is None or not same_or_inside(path, root):
        return lambda _: False
    rel = os.path.relpath(path, root)
    return lambda relpath: relpath == rel or relpath.startswith(rel + ".tmp.")


def load_history(path: str | None) -> tuple[Usage, bool]:
    """(the usage history, whether this run can add to it); each problem said once."""
    if path is None:
        return Usage(), False
    try:
        history = load(path)
    except BadUsageFile as e:
        log.warning("%s; not updated this run (fix or move it)", e)
        return Usage(), False
    if not os.access(os.path.dirname(path), os.W_OK | os.X_OK):
        # A read-only model drive is common: say so once, not every minute.
        log.warning(
            "usage file %s cannot be written there (read-only?); usage is not kept this run "
            "(--usage-file elsewhere, or --no-usage)",
            path,
        )
        return history, False
    return history, True


class UsageRecorder:
    """Saves what `source` counted to the usage file; its status is shown in stats.json."""

    def __init__(self, path: str | None, saving: bool, history_runs: int, source: UsageSource | None) -> None:
        self._path = path
        self._source = source if saving else None
        self._status: dict = {"file": None}
        if path is not None:
            self._status = {"file": path, "saving": saving, "history_runs": history_runs, "last_saved": None}

    @property
    def saving(self) -> bool:
        return self._source is not None

    def status(self) -> dict:
        return dict(self._status)

    async def keep(self, interval: float) -> None:
        """Runs for the life of the mount: a save every `interval` seconds."""
        assert self._source is not None
        while True:
            await trio.sleep(interval)
            pending = self._source.take_usage()  # on the loop's thread; written on another
            # Nothing served yet still carries this run's count: kept for a later save, like a failed one.
            if not pending or not await trio.to_thread.run_sync(self._save, pending):
                self._source.restore_usage(pending)

    def flush(self) -> None:
        """The last save, at unmount (`colifs umount` waits for it)."""
        if self._source is not None and (pending := self._source.take_usage()):
            self._save(pending)

    def _save(self, pending: Usage) -> bool:
        """Add `pending` to the usage file; False (warned once) when it cannot be written."""
        assert self._path is not None
        try:
            save(self._path, pending)
        except (OSError, BadUsageFile) as e:
            if self._status.get("last_error") is None:
                log.warning(
                    "usage file %s: cannot save (%s); kept in memory, tried again later", self._path, e
                )
            self._status["last_error"] = str(e)
            return False
        self._status["last_saved"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        self._status["last_error"] = None
        return True
