"""Mount lifecycle: assemble (colifs.assemble) → mount → serve → until unmounted (`colifs umount`,
umount(8)) or signalled (SIGTERM/SIGINT: unmount once no process uses the mount). SIGHUP reloads:
the mirrors are checked again while serving (colifs.reload; `colifs reload` sends it). The control
socket (colifs.control) takes `colifs mirror remove/add` and answers `status`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import resource
import signal
import time
from collections.abc import Awaitable, Callable, Iterator

import trio

from colifs.assemble import Assembly, assemble
from colifs.backing import BackingIO
from colifs.config import MountConfig
from colifs.control import Control
from colifs.errors import MountError, UsageError
from colifs.kernel import MountEntry, Tuning, mount_at
from colifs.logs import RecentWarnings
from colifs.namespace import STATS_INO
from colifs.unmount import Busy, UnmountFailed, unmount

log = logging.getLogger("colifs")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RELOAD_SIGNAL = signal.SIGHUP
BUSY_RETRY = 0.5  # s between unmount attempts after a stop signal while the mount is in use
BUSY_WARN_INTERVAL = 60.0  # s between the warnings naming who still uses it


def serve(
    cfg: MountConfig,
    on_ready: Callable[[], None] = lambda: None,
    io: BackingIO | None = None,
) -> None:
    """Build, mount and serve until unmounted or signalled; always leaves nothing mounted."""
    raise_descriptor_limit()
    warnings = RecentWarnings()
    log.addHandler(warnings)
    try:
        asm = assemble(cfg, io, warnings)
        with _signals_recorded() as early:
            try:
                _run(asm, cfg.usage_interval, on_ready, early)
            finally:
                asm.engine.close()
                asm.recorder.flush()  # what was served since the last save: `colifs umount` waits for it
    finally:
        log.removeHandler(warnings)
    log.debug("unmounted %s", cfg.mountpoint)


def raise_descriptor_limit() -> None:
    """The soft limit on open files up to the hard one: the daemon holds a descriptor per open
    file per drive, and a service manager's default soft limit (systemd: 1024) is below what 600
    shards on three drives need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # an unlimited hard limit: the kernel's cap
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.debug("open files: soft limit %s -> %s", soft, hard)


def _run(asm: Assembly, usage_interval: float, on_ready: Callable[[], None], early: list[int]) -> None:
    engine = asm.engine
    try:
        engine.mount()
    except RuntimeError as e:
        raise MountError(f"cannot mount on {asm.mountpoint}: {e}") from None
    tasks: list[Callable[[], Awaitable[None]]] = [engine.watch, asm.adaptive.run, asm.loop.run]
    if asm.recorder.saving:
        tasks.append(functools.partial(asm.recorder.keep, usage_interval))
    tasks.append(functools.partial(_reload_on_signal, asm, early))
    tasks.append(_control(asm).serve)
    trio.run(_main, asm.mountpoint, asm.tuning, on_ready, early, engine.run, engine.stop, tasks)


async def _reload_on_signal(asm: Assembly, early: list[int]) -> None:
    """Each SIGHUP reloads (one at a time; those that arrive meanwhile make one more). One that
    came before this receiver opened was recorded in `early`."""
    with trio.open_signal_receiver(RELOAD_SIGNAL) as sigs:
        if RELOAD_SIGNAL in early:
            await asm.reloader.reload()
        async for _ in sigs:
            log.info("signal SIGHUP: reloading (the mirrors checked again)")
            await asm.reloader.reload()


def _control(asm: Assembly) -> Control:
    """The commands with arguments: a mirror taken away or brought back while serving; and what the
    mount serves (`status`: for commands about other mounts, which must not touch them)."""

    async def remove(request: dict) -> dict:
        return await asm.reloader.remove_mirror(str(request["path"]), _positive(request, "wait"))

    async def add(request: dict) -> dict:
        weight = None if request.get("weight") is None else _positive(request, "weight")
        # The daemon proves every copy it adds (colifs.proof); a request may only ask for more.
        deep = request.get("deep") is True
        return await asm.reloader.add_mirror(str(request["path"]), weight, _positive(request, "wait"), deep)

    async def status(request: dict) -> dict:
        return status_of(asm)

    return Control(
        {"mirror-remove": remove, "mirror-add": add, "status": status}, listening=asm.stats.listening
    )


def status_of(asm: Assembly) -> dict:
    """What the mount serves, as resolved at mount (paths compared as strings by the asker, never
    resolved again: a mirror's drive may hang). Read from memory: it touches no drive."""
    health = asm.reloader.health
    return {
        "pid": os.getpid(),
        "uid": os.geteuid(),
        "mountpoint": asm.mountpoint,
        "replicas": [
            {"path": r.root, "role": r.role, "removed": health[r.index].removed_at is not None}
            for r in asm.reloader.replicas
        ],
    }


def _positive(request: dict, key: str) -> float:
    """A number the client sent: finite and above 0, or the request is refused (a NaN wait would
    hold the reload lock for ever, a negative weight would reach the routes)."""
    try:
        x = float(request[key])
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"bad request: {key} must be a number") from None
    if not 0 < x < math.inf:
        raise UsageError(f"bad request: {key} must be a positive number, not {x:g}")
    return x


@contextlib.contextmanager
def _signals_recorded() -> Iterator[list[int]]:
    """From here on a signal must unmount or reload, never kill: it is recorded until trio takes
    over."""
    early: list[int] = []
    previous = {s: signal.signal(s, lambda sig, _: early.append(sig)) for s in (*STOP_SIGNALS, RELOAD_SIGNAL)}
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
    tuning: Tuning,
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
                stops = [s for s in early if s in STOP_SIGNALS]  # a SIGHUP there is the reloader's
                sig = stops[0] if stops else await sigs.__anext__()
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
        applied = await trio.to_thread.run_sync(tuning.apply, mnt, abandon_on_cancel=True)
        log.info("kernel: %s", ", ".join(f"{k} {v}" for k, v in applied.items()))
        on_ready()
