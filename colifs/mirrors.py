"""The mirror policy both engines obey: what a failed mirror read, a changed copy and a check read
do to a mirror (colifs.health keeps the counts). The engines do the reading; this decides, logs
once, and tells the engine when a mirror leaves or rejoins the routing (`set_up`).
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Awaitable, Callable, Sequence

import trio

from colifs.backing import Changed, TimedOut, align_down
from colifs.catalogue import ServedFile
from colifs.health import Health
from colifs.logs import WarnOnce
from colifs.replicas import Identity, Replica
from colifs.routing import CHUNK

log = logging.getLogger("colifs")

# A check read: (drive, a file it holds or None for its directory, an offset); raises OSError,
# Changed or TimedOut when the mirror is not well yet.
CheckRead = Callable[[int, ServedFile | None, int], Awaitable[None]]


class MirrorPolicy:
    """Takes a mirror out of the routing after repeated failures and back once a check read passes;
    stops using a copy that changed after mount."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        health: Sequence[Health],
        files: Sequence[ServedFile],
        set_up: Callable[[int, bool], None],
    ) -> None:
        self.replicas = replicas  # shared: a mirror added in a removed one's slot changes its root
        self.health = health
        self.files = list(files)  # what check reads read from
        self._set_up = set_up
        self._warn = WarnOnce()
        self.checking: set[int] = set()  # mirrors whose check read is running

    def read_failed(self, f: ServedFile, drive: int, problem: str, timed_out: bool) -> None:
        """A mirror read failed (error, short read, timeout): counted; the file's reads go to the
        primary (one warning per file); FAILURES_TO_DOWN in a row take the mirror out."""
        h = self.health[drive]
        root = self.replicas[drive].root
        if h.failed(problem, timed_out):
            self._set_up(drive, False)
            log.warning(
                "mirror %s: %d failures in a row (last: %s); its reads go to the primary until a "
                "check read passes",
                root, h.in_a_row, problem,
            )  # fmt: skip
        self._warn(
            (f.relpath, drive),
            "%s: mirror %s: %s; reading from the primary instead",
            f.relpath,
            root,
            problem,
        )

    def out_of_descriptors(self, f: ServedFile, drive: int) -> None:
        """A mirror copy could not be opened for want of descriptors: the daemon's lack, not the
        mirror's, so nothing is counted against it; that read goes to the primary. Said once."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._warn(
            ("out of descriptors",),
            "out of open-file descriptors (limit %d): %s and other files are read from the primary "
            "instead of mirror %s while they last; raise the limit (systemd: LimitNOFILE=)",
            soft,
            f.relpath,
            self.replicas[drive].root,
        )

    def changed(self, f: ServedFile, drive: int, what: str, expected: Identity | None) -> bool:
        """A mirror copy changed after mount: not used again for this file (until a reload finds
        it valid). `expected`: the copy the failing read was checked against. False when that is
        no longer the file's copy (a reload dropped or replaced it since): nothing to do."""
        if f.identities.get(drive) != expected:
            return False
        if drive in f.copies:
            root = self.replicas[drive].root
            f.drop(drive, f"mirror {root}: changed since mount ({what})")
            log.warning(
                "%s: mirror %s: changed since mount (%s); no longer used for this file", f.relpath, root, what
            )
        return True

    def primary_changed(self, f: ServedFile, what: str) -> None:
        """The primary's file is not the one mounted (replaced by a rename, rewritten, touched): its
        headers and run table are the old file's, so no open may read the new one. The engines
        refuse the open (EIO); this says so once per file."""
        if f.refuse(what):
            log.warning(
                "%s: the primary changed since mount (%s); opens of it fail (EIO) until it is "
                "mounted again (files open before read the file mounted)",
                f.relpath, what,
            )  # fmt: skip

    def due(self) -> list[int]:
        """The down mirrors whose back-off is over."""
        return [d for d in range(1, len(self.replicas)) if self.health[d].due()]

    def start_checks(self, nursery: trio.Nursery, read: CheckRead) -> None:
        """A check for each down mirror whose back-off is over and whose last check has ended:
        checks run side by side, so a mirror whose checks hang holds up no other's."""
        for d in self.due():
            if d not in self.checking:
                self.checking.add(d)
                nursery.start_soon(self._check_then_done, d, read)

    async def _check_then_done(self, drive: int, read: CheckRead) -> None:
        try:
            await self.check(drive, read)
        finally:
            self.checking.discard(drive)

    async def check(self, drive: int, read: CheckRead) -> None:
        """One small read from a down mirror (a different file and offset each time): back in the
        routing if it passes, a longer back-off if not."""
        h = self.health[drive]
        n = h.next_check()
        held = [f for f in self.files if drive in f.copies and f.size > 0]
        f = held[n % len(held)] if held else None
        root = self.replicas[drive].root
        try:
            await read(drive, f, align_down(n * CHUNK % f.size) if f is not None else 0)
        except (OSError, TimedOut, Changed) as e:
            if isinstance(e, Changed) and f is not None:
                self.changed(f, drive, str(e), e.expected)
            timed_out = isinstance(e, TimedOut)
            h.check_failed(f"check read: {'timeout' if timed_out else describe(e)}", timed_out)
            log.debug("mirror %s: check read failed (%s); next in %.0f s", root, e, h.wait())
            return
        down_for = h.check_passed()
        self._set_up(drive, True)
        log.warning("mirror %s: check read passed; back in use (down for %.1f s)", root, down_for)


def describe(error: BaseException) -> str:
    """An error as a log line shows it: the OS's words for an OSError."""
    return (error.strerror if isinstance(error, OSError) else None) or repr(error)
