"""A mount's configuration: `colifs mount`'s options checked into one `MountConfig`, and the one
place that decides where weights come from (--weights, $COLI_DISK_WEIGHTS, a probe, equal)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from colifs.errors import UsageError
from colifs.kernel import DEFAULT_KB, Knobs
from colifs.routing import parse_weights

WEIGHTS_ENV = "COLI_DISK_WEIGHTS"
ENGINE_ENV = "COLIFS_ENGINE"  # the default of --engine
ENGINES = ("native", "pyfuse3")
# Chosen by the benchmarks in docs/benchmarks.md (buffered and mmap readers, one and many, slow and
# fast drives): the native engine's requests are cheap, so the kernel's readahead reads little past
# an expert's end; a pyfuse3 request costs ~20 µs of Python, so there fewer, bigger ones win.
DEFAULT_READ_AHEAD_KB = {"native": DEFAULT_KB, "pyfuse3": 512}
DEFAULT_MAX_BACKGROUND = 256
# A drive's backlog spills to the drive with room (native/drives.c quickest): the sum of the drives
# when one slows down or the weights are wrong, as fixed stripes with the right weights
# (docs/benchmarks.md run 54). The pyfuse3 engine has no queues to look at.
DEFAULT_ROUTING = {"native": "queue", "pyfuse3": "stripe"}
# What fills may hold (native/fill.c), MiB: reads ahead of page-cache readers, an expert's missing
# pages from every drive at once, 16 MiB a fill at most.
DEFAULT_FILL_MIB = 64
MAX_MIRROR_TIMEOUT = 86400.0  # s: longer is "for ever" (0), and a timespec must hold it
MAX_FILL_MIB = 65536  # past this it is a typo, not a budget


@dataclass
class MountConfig:
    primary: str
    mirrors: list[str]
    mountpoint: str
    weights: list[float] | None = None  # None: probed (or equal when probe_seconds is 0)
    weights_source: str = "probed"
    probe_seconds: float = 2.0
    adaptive_weights: bool = False  # colifs.balance moves the weights while serving (else they stay)
    threads_per_drive: int = 8
    backing_io: str = "direct"  # or "buffered"
    routing: str = "queue"  # or "stripe", "expert" (docs/benchmarks.md: runs 9, 54)
    fill_mib: int = DEFAULT_FILL_MIB  # native engine: reads ahead of page-cache readers (0: off)
    # native engine: page-cache opens read by the kernel from the primary: "always", "never", or
    # "auto": those of files no mirror holds while the drives need no reads ahead (colifs.depth)
    passthrough: str = "auto"
    # native engine: read calls of page-cache opens reach the daemon as they are (FUSE direct I/O;
    # mappings still use the page cache) and are cached by the drives' own page caches
    direct_reads: bool = False
    store_roots: list[str] = field(default_factory=list)  # symlinks into these are served as files
    revision: str = "main"  # the snapshot a Hugging Face cache repository directory serves
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


def given_weights(flag: str | None, count: int) -> tuple[list[float] | None, str]:
    """The weights given by --weights, else by $COLI_DISK_WEIGHTS, and which; (None, "") if neither."""
    text, source = flag, "given (--weights)"
    if text is None and os.environ.get(WEIGHTS_ENV):
        text, source = os.environ[WEIGHTS_ENV], f"given (${WEIGHTS_ENV})"
    if text is None:
        return None, ""
    try:
        return parse_weights(text, count), source
    except ValueError as e:
        raise UsageError(str(e)) from None


def mount_config(args: argparse.Namespace) -> MountConfig:
    """`colifs mount`'s arguments as a MountConfig; UsageError names the first bad one."""
    if len(args.dirs) < 2:
        raise UsageError("mount needs PRIMARY [MIRROR ...] MOUNTPOINT")
    *roots, mountpoint = args.dirs
    weights, source = given_weights(args.weights, len(roots))
    if weights is None:
        source = "default (equal)" if args.no_probe or len(roots) == 1 else "probed"
    _check_numbers(args)
    routing = args.routing or ("stripe" if args.fixed_weights else DEFAULT_ROUTING[args.engine])
    return MountConfig(
        roots[0],
        roots[1:],
        mountpoint,
        weights,
        source,
        probe_seconds=0.0 if args.no_probe else args.probe_seconds,
        # The split follows the drives unless --fixed-weights: the weights move (colifs.balance), and
        # under queue routing a drive's backlog spills too (docs/benchmarks.md runs 54, 61, 65).
        adaptive_weights=not args.fixed_weights,
        threads_per_drive=args.threads_per_drive,
        backing_io=args.backing_io,
        routing=routing,
        fill_mib=args.fill_mib,
        passthrough=args.passthrough,
        direct_reads=args.direct_reads,
        store_roots=args.store_root,
        revision=args.revision,
        engine=args.engine,
        fuse_threads=args.fuse_threads,
        knobs=Knobs(
            DEFAULT_READ_AHEAD_KB[args.engine] if args.readahead_kb is None else args.readahead_kb,
            DEFAULT_MAX_BACKGROUND if args.max_background is None else args.max_background,
            by_speed=args.readahead_kb is None and args.engine == "native",
            why="the default" if args.readahead_kb is None else "given",
        ),
        allow_other=args.allow_other,
        mirror_timeout=args.mirror_timeout or None,
        usage=not args.no_usage,
        usage_file=args.usage_file,
        usage_interval=args.usage_interval,
    )


def _check_numbers(args: argparse.Namespace) -> None:
    if args.engine not in ENGINES:  # from the environment: argparse checks only given values
        raise UsageError(f"${ENGINE_ENV}={args.engine!r}: not one of {', '.join(ENGINES)}")
    if args.threads_per_drive < 1 or args.fuse_threads < 1:
        raise UsageError("--threads-per-drive and --fuse-threads must be at least 1")
    if not args.usage_interval > 0:
        raise UsageError("--usage-interval must be a positive number of seconds")
    if not 0 <= args.mirror_timeout <= MAX_MIRROR_TIMEOUT:  # also NaN; inf would overflow a timespec
        raise UsageError(f"--mirror-timeout must be 0 (wait for ever) to {MAX_MIRROR_TIMEOUT:g} seconds")
    for value in (args.readahead_kb, args.max_background):
        if value is not None and value < 0:
            raise UsageError("--readahead-kb and --max-background must be 0 or more")
    if not 0 <= args.fill_mib <= MAX_FILL_MIB:
        raise UsageError(f"--fill-mib must be 0 to {MAX_FILL_MIB} (MiB)")
    _check_choices(args)


def _check_choices(args: argparse.Namespace) -> None:
    """Flags that do not go together."""
    if args.fixed_weights and args.adaptive_weights:
        raise UsageError("--fixed-weights keeps the weights as mounted: not with --adaptive-weights")
    if args.routing == "queue" and args.engine != "native":
        raise UsageError("--routing queue needs the native engine (--engine native)")
    if args.passthrough == "always" and args.engine != "native":
        raise UsageError("--passthrough needs the native engine (--engine native)")
    if args.direct_reads and args.engine != "native":
        raise UsageError("--direct-reads needs the native engine (--engine native)")


def mount_options(allow_other: bool, extra: Sequence[str]) -> list[str]:
    """The FUSE mount options of either engine (default_permissions: the kernel checks modes)."""
    options = {"default_permissions", "ro", "fsname=colifs", "subtype=colifs", "noatime"}
    if allow_other:
        options.add("allow_other")
    options.update(extra)
    return sorted(options)
