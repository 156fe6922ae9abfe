"""The command line: every subcommand's parser and its thin handler. User errors are one line and a
specific exit code."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from collections.abc import Sequence

from colifs import __version__
from colifs.errors import BusyError, MountError, NotMountedError, QuietError, UsageError

READY = b"\0colifs-ready\n"
WEIGHTS_ENV = "COLI_DISK_WEIGHTS"
ENGINE_ENV = "COLIFS_ENGINE"  # the default of --engine
ENGINES = ("native", "pyfuse3")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colifs",
        description="Read-only FUSE mount that serves each tensor of a model from one of its copies.",
    )
    p.add_argument("--version", action="version", version=f"colifs {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser(
        "mount",
        help="mount PRIMARY (+ mirrors) on MOUNTPOINT",
        description="Mount PRIMARY with its MIRROR copies on MOUNTPOINT, read-only. "
        "Returns once the mount is serving; the daemon keeps running in the background.",
    )
    m.add_argument("dirs", nargs="+", metavar="DIR", help="PRIMARY [MIRROR ...] MOUNTPOINT")
    m.add_argument(
        "--weights",
        metavar="W0,W1,...",
        help=f"relative read bandwidth of each replica, primary first (default: ${WEIGHTS_ENV}, "
        "else measured by a probe at mount)",
    )
    m.add_argument(
        "--probe-seconds",
        type=float,
        default=2.0,
        metavar="S",
        help="without weights, measure each drive for about S seconds at mount (default: 2)",
    )
    m.add_argument("--no-probe", action="store_true", help="without weights, use equal weights, no probe")
    m.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    m.add_argument(
        "--allow-other",
        action="store_true",
        help="let other users read the mount (needs user_allow_other in /etc/fuse.conf)",
    )
    m.add_argument(
        "--threads-per-drive", type=int, default=8, metavar="N", help="reads in flight per drive (default: 8)"
    )
    m.add_argument(
        "--readahead-kb",
        type=int,
        default=None,
        metavar="KB",
        help="readahead of the mount (root only; default: 128 with the native engine, 512 with pyfuse3, "
        "0 = the kernel's default); "
        "larger sends bigger requests to the daemon, but over-reads on random small mmap touches",
    )
    m.add_argument(
        "--max-background",
        type=int,
        default=None,
        metavar="N",
        help="FUSE background requests in flight (readahead, O_DIRECT; root only; default: 256, "
        "0 = the kernel's 12)",
    )
    m.add_argument(
        "--routing",
        choices=["expert", "stripe"],
        default="stripe",
        help="stripe (default): keys of 2 MiB or more cut in 1 MiB chunks spread over the drives in the "
        "weights' ratio, so even one reader uses every drive; expert: each expert from one drive",
    )
    m.add_argument(
        "--prefetch",
        choices=["expert", "off"],
        default="off",
        help="expert: a page-cache reader's (mmap, buffered) first touch of a routed expert reads the "
        "rest of it too, from all drives at once, into the page cache (native engine; at most "
        "64 MiB per expert, never past its end); off (default): the kernel's readahead only",
    )
    m.add_argument(
        "--engine",
        choices=ENGINES,
        default=os.environ.get(ENGINE_ENV, ENGINES[0]),
        help="native (default): a C data path on libfuse's multi-threaded loop, no Python per read; "
        f"pyfuse3: the portable reference engine (one Python thread); default from ${ENGINE_ENV}",
    )
    m.add_argument(
        "--fuse-threads",
        type=int,
        default=16,
        metavar="N",
        help="native engine: threads taking requests from the kernel (primary reads run on them; "
        "default: 16)",
    )
    m.add_argument(
        "--backing-io",
        choices=["direct", "buffered"],
        default="direct",
        help="read the drives with O_DIRECT (default; the mount's page cache is then the only cache) "
        "or buffered",
    )
    m.add_argument(
        "--mirror-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="a mirror read not answered within S seconds is re-read from the primary; "
        "repeated failures take the mirror out of use until a check read passes (default: 5, 0 = never)",
    )
    m.add_argument(
        "--usage-file",
        metavar="PATH",
        help="where to keep what the mount served per expert and file, merged over runs, for "
        "`colifs plan` and partial-mirror routing (default: PRIMARY/.colifs-usage.json; never on a mirror)",
    )
    m.add_argument("--no-usage", action="store_true", help="do not count or save usage")
    m.add_argument(
        "--usage-interval",
        type=float,
        default=60.0,
        metavar="S",
        help="save the usage every S seconds (default: 60) and at unmount",
    )
    m.add_argument("--log-file", metavar="PATH", help="also log to PATH (the daemon's only log once ready)")
    m.add_argument("-d", "--debug", action="store_true", help="debug logging")

    u = sub.add_parser(
        "umount",
        help="unmount and wait for the daemon to exit",
        description="Unmount a colifs mount and wait for its daemon to exit (it saves its usage "
        "first). Refused, exit code 6, while any process has a file of the mount open or mapped, "
        "naming them: a loaded model is never pulled from under its process. Also clears a stale "
        "mount whose daemon is gone.",
    )
    u.add_argument("mountpoint", help="a colifs mount point")
    u.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the daemon (default: 60)")
    u.add_argument(
        "--lazy",
        action="store_true",
        help="detach even while processes use the mount: they keep their open and mapped files, the "
        "daemon serves them until the last one closes, then exits (without --lazy a busy mount is "
        "refused with exit code 6)",
    )

    p_ = sub.add_parser(
        "probe",
        help="measure each drive's read bandwidth, suggest --weights",
        description="Measure each replica's read bandwidth the way an MoE engine reads (parallel ~19 MB "
        "O_DIRECT reads at spread offsets of its largest model files) and suggest --weights.",
    )
    p_.add_argument("dirs", nargs="+", metavar="DIR", help="PRIMARY [MIRROR ...]")
    p_.add_argument("--seconds", type=float, default=2.0, help="seconds per drive (default: 2)")

    b = sub.add_parser(
        "bench",
        help="read a model directory the way an MoE engine decodes",
        description="N readers fetch whole routed experts (all tensors of one layer's expert, found "
        "through the headers) at random, from a colifs mount or plain directories. Several DIRs (full "
        "copies) are read in parallel with colifs' routing and --weights: the physical limit.",
    )
    b.add_argument("dirs", nargs="+", metavar="DIR", help="a colifs mount, or directories (primary first)")
    b.add_argument("--weights", metavar="W0,W1,...", help="split between several DIRs (default: equal)")
    b.add_argument("--threads", type=int, default=4, help="reader threads (default: 4)")
    b.add_argument("--seconds", type=float, default=10.0, help="duration (default: 10)")
    b.add_argument(
        "--zipf", type=float, default=0.0, metavar="A", help="skew of expert choice (default: 0, uniform)"
    )
    how = b.add_mutually_exclusive_group()
    how.add_argument(
        "--odirect", dest="mode", action="store_const", const="odirect", help="O_DIRECT preads (default)"
    )
    how.add_argument(
        "--buffered", dest="mode", action="store_const", const="buffered", help="buffered preads"
    )
    how.add_argument(
        "--mmap", dest="mode", action="store_const", const="mmap", help="copy out of an mmap (page faults)"
    )
    b.add_argument("--warm", action="store_true", help="do not drop caches first")
    b.add_argument(
        "--inflight", metavar="DEV,...", default="", help="sample reads in flight of these block devices"
    )
    b.add_argument("--json", action="store_true", help="print the figures as JSON")
    b.set_defaults(mode="odirect")

    ro = sub.add_parser(
        "route",
        help="which tensor, key and drive serve a byte of a file on a mount",
        description="Print the tensor holding byte OFFSET of FILE (a model file on a colifs mount), "
        "its routing key, and the drive that serves it now. The mount answers through the extended "
        "attribute user.colifs.route.OFFSET; user.colifs.replicas lists the valid copies.",
    )
    ro.add_argument("file", metavar="FILE", help="a model file on a colifs mount")
    ro.add_argument("offset", metavar="OFFSET", help="byte offset (decimal, or 0x... hex)")
    ro.add_argument("--json", action="store_true", help="print the answer as JSON")

    def planning(q: argparse.ArgumentParser) -> None:
        q.add_argument("primary", metavar="PRIMARY", help="the model directory (the source of truth)")
        q.add_argument("mirror", metavar="MIRROR", help="the directory on the second drive")
        q.add_argument(
            "--budget", required=True, metavar="SIZE", help="space to use on MIRROR (200G, 1.5T, bytes)"
        )
        q.add_argument(
            "--reserve",
            default="0",
            metavar="SIZE",
            help="free space to leave on MIRROR at all times (default: 0)",
        )
        q.add_argument(
            "--usage",
            metavar="FILE",
            help="usage history: a colifs usage file or Colibrì's .coli_usage (default: PRIMARY/"
            ".colifs-usage.json, else PRIMARY/.coli_usage; without one every byte counts the same)",
        )

    pl = sub.add_parser(
        "plan",
        help="choose the shards worth putting on a smaller mirror",
        description="Choose the shards of PRIMARY to put on MIRROR so that the traffic they cover (from "
        "the usage history) per byte of space is highest, within --budget and MIRROR's free space minus "
        "--reserve. Shards already valid on MIRROR cost nothing. Prints the table and the predicted "
        "speed-up. Sizes: K, M, G, T are powers of 1024 (KB, MB, GB, TB of 1000).",
    )
    planning(pl)
    pl.add_argument(
        "--weights", metavar="W0,W1", help="drive speeds for the prediction (default: probed, or equal)"
    )
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")

    st = sub.add_parser(
        "stage",
        help="copy the planned shards onto the mirror, safely",
        description="Copy the shards `colifs plan` selects onto MIRROR: each to a temporary name, "
        "fsynced, read back and compared (SHA-256) with the primary, then given its final name. "
        "Never touches PRIMARY, never replaces a file on MIRROR, keeps --reserve free, writes "
        "MIRROR/.colifs-receipt.json once all are in place. A re-run resumes.",
    )
    planning(st)
    st.add_argument("-q", "--quiet", action="store_true", help="no progress, only the summary")

    ve = sub.add_parser(
        "verify",
        help="check the mirror's copies against the primary",
        description="Check every mirror copy of PRIMARY's model files: size and header (what the mount "
        "checks), and with --deep the SHA-256 of all data, both drives read in parallel. Exit 4 when a "
        "copy the mount would use has other data.",
    )
    ve.add_argument("primary", metavar="PRIMARY", help="the model directory (the source of truth)")
    ve.add_argument("mirror", metavar="MIRROR", help="the directory on the second drive")
    ve.add_argument("--deep", action="store_true", help="compare the data too (reads both copies in full)")
    ve.add_argument("-q", "--quiet", action="store_true", help="no progress")
    ve.add_argument("--json", action="store_true", help="print the rows as JSON")

    tp = sub.add_parser(
        "top",
        help="live per-drive view of a mount",
        description="A live view of a mount, redrawn every second: per drive MB/s now and on average, "
        "share of bytes vs weights, reads in flight, errors, mirror health, fallbacks, hottest layers. "
        "q or Ctrl-C exits.",
    )
    tp.add_argument("mountpoint", help="a colifs mount point")
    tp.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between frames (default: 1)"
    )
    tp.add_argument("--count", type=int, metavar="N", help="draw N frames and exit (for scripts)")

    co = sub.add_parser(
        "completion",
        help="print the bash completion script",
        description="Print a bash completion script for colifs, built from its own options. "
        "Install: colifs completion > /etc/bash_completion.d/colifs (or source it from ~/.bashrc).",
    )
    co.add_argument("shell", choices=["bash"], help="the shell (bash)")

    s = sub.add_parser(
        "stats",
        help="show what each drive served",
        description="Show the bytes and reads each drive served through a mount.",
    )
    s.add_argument("mountpoint", help="a colifs mount point")
    how_ = s.add_mutually_exclusive_group()
    how_.add_argument("--json", action="store_true", help="print stats.json as it is")
    how_.add_argument(
        "--prometheus", action="store_true", help="print the counters in the Prometheus text format"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        commands = {
            "mount": cmd_mount,
            "umount": cmd_umount,
            "probe": cmd_probe,
            "bench": cmd_bench,
            "stats": cmd_stats,
            "plan": cmd_plan,
            "stage": cmd_stage,
            "verify": cmd_verify,
            "route": cmd_route,
            "top": cmd_top,
            "completion": cmd_completion,
        }
        return commands[args.command](args)
    except QuietError as e:
        print(f"colifs: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("colifs: interrupted", file=sys.stderr)
        return 130


# -- mount ---------------------------------------------------------------------------------------


def _config(args: argparse.Namespace):  # -> MountConfig (import kept lazy: pyfuse3 is heavy)
    from colifs.kernel import Knobs
    from colifs.mount import DEFAULT_MAX_BACKGROUND, DEFAULT_READ_AHEAD_KB, MountConfig
    from colifs.routing import parse_weights

    if len(args.dirs) < 2:
        raise UsageError("mount needs PRIMARY [MIRROR ...] MOUNTPOINT")
    *roots, mountpoint = args.dirs
    text, source = args.weights, "given (--weights)"
    if text is None and os.environ.get(WEIGHTS_ENV):
        text, source = os.environ[WEIGHTS_ENV], f"given (${WEIGHTS_ENV})"
    weights = None
    if text is not None:
        try:
            weights = parse_weights(text, len(roots))
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif args.no_probe or len(roots) == 1:
        source = "default (equal)"
    else:
        source = "probed"
    if args.engine not in ENGINES:  # from the environment: argparse checks only given values
        raise UsageError(f"${ENGINE_ENV}={args.engine!r}: not one of {', '.join(ENGINES)}")
    if args.threads_per_drive < 1 or args.fuse_threads < 1:
        raise UsageError("--threads-per-drive and --fuse-threads must be at least 1")
    if not args.usage_interval > 0:
        raise UsageError("--usage-interval must be a positive number of seconds")
    if not args.mirror_timeout >= 0:
        raise UsageError("--mirror-timeout must be 0 or more seconds")
    knobs = Knobs(
        DEFAULT_READ_AHEAD_KB[args.engine] if args.readahead_kb is None else args.readahead_kb,
        DEFAULT_MAX_BACKGROUND if args.max_background is None else args.max_background,
    )
    if knobs.read_ahead_kb < 0 or knobs.max_background < 0:
        raise UsageError("--readahead-kb and --max-background must be 0 or more")
    return MountConfig(
        roots[0],
        roots[1:],
        mountpoint,
        weights,
        source,
        probe_seconds=0.0 if args.no_probe else args.probe_seconds,
        threads_per_drive=args.threads_per_drive,
        backing_io=args.backing_io,
        routing=args.routing,
        prefetch=args.prefetch,
        engine=args.engine,
        fuse_threads=args.fuse_threads,
        knobs=knobs,
        allow_other=args.allow_other,
        mirror_timeout=args.mirror_timeout or None,
        usage=not args.no_usage,
        usage_file=args.usage_file,
        usage_interval=args.usage_interval,
    )


def cmd_mount(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if args.foreground:
        return _serve(args, cfg, on_ready=lambda: None)
    return _daemonize(args, cfg)


def _serve(args: argparse.Namespace, cfg, on_ready) -> int:
    from colifs import logs
    from colifs.mount import serve

    logs.setup(args.debug, args.log_file)
    serve(cfg, on_ready)
    return 0


def _daemonize(args: argparse.Namespace, cfg) -> int:
    """Fork; the child builds and mounts, sending its messages through a pipe until it is serving.

    The parent copies them to stderr and exits 0 on the ready marker, or with the child's code.
    Forking happens before any thread exists (the workers start in the child).
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)

        def ready() -> None:
            from colifs import logs

            sys.stderr.flush()
            os.write(2, READY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            logs.to_syslog()  # stderr is gone: from here on the log is syslog (and --log-file)

        try:
            code = _serve(args, cfg, ready)
        except QuietError as e:
            print(f"colifs: error: {e}", file=sys.stderr)
            code = e.exit_code
        except BaseException as e:  # the parent must get a line, never a silent failure
            print(f"colifs: error: daemon failed: {e!r}", file=sys.stderr)
            code = 1
        sys.stderr.flush()
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        for line in pipe:
            if line == READY:
                return 0
            sys.stderr.buffer.write(line)
            sys.stderr.flush()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:  # it exited without ever serving
        code = MountError.exit_code
    return code


# -- umount --------------------------------------------------------------------------------------


def _read_stats(mountpoint: str) -> dict:
    path = os.path.join(mountpoint, ".colifs", "stats.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise NotMountedError(f"{mountpoint} is not a colifs mount") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise NotMountedError(f"{mountpoint}: stale mount, its daemon is gone") from None
        raise NotMountedError(f"{mountpoint}: {e.strerror}") from None


def _mounted(mountpoint: str) -> bool:
    from colifs.kernel import mount_type

    return mount_type(mountpoint) == "fuse.colifs"


def cmd_umount(args: argparse.Namespace) -> int:
    from colifs.unmount import Busy, UnmountFailed, describe, unmount

    mnt = os.path.realpath(args.mountpoint)
    if not _mounted(mnt):
        raise NotMountedError(f"{mnt} is not a colifs mount")
    try:
        pid = int(_read_stats(mnt)["pid"])
    except NotMountedError:  # stale: the daemon died; only the kernel's mount is left
        _unmount_or_fail(mnt, lazy=True)
        print(f"colifs: cleared stale mount {mnt}", file=sys.stderr)
        return 0
    try:
        unmount(mnt)  # the kernel refuses while any process uses the mount: nothing is pulled
    except Busy as e:
        if not args.lazy:
            raise BusyError(f"{e} (it keeps serving; --lazy detaches it now)") from None
        _unmount_or_fail(mnt, lazy=True)
        print(
            f"colifs: detached {mnt}; daemon {pid} serves what is still open or mapped and exits once "
            f"the last process lets go ({describe(e.users)})",
            file=sys.stderr,
        )
        return 0
    except UnmountFailed as e:
        raise QuietError(f"cannot unmount {mnt}: {e}") from None
    deadline = time.monotonic() + args.timeout  # the daemon saves its usage file, then exits
    while _alive(pid):
        if time.monotonic() > deadline:
            raise QuietError(f"daemon {pid} of {mnt} did not exit within {args.timeout:g} s")
        time.sleep(0.02)
    return 0


def _unmount_or_fail(mnt: str, lazy: bool) -> None:
    from colifs.unmount import UnmountFailed, unmount

    try:
        unmount(mnt, lazy)
    except UnmountFailed as e:
        raise QuietError(f"cannot unmount {mnt}: {e}") from None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


# -- probe ---------------------------------------------------------------------------------------


def cmd_probe(args: argparse.Namespace) -> int:
    from colifs import logs
    from colifs.mount import build_files, check_roots
    from colifs.probe import probe, table
    from colifs.tree import Tree

    logs.setup()
    if args.seconds <= 0:
        raise UsageError("--seconds must be positive")
    replicas = check_roots(args.dirs, error=UsageError)
    files = build_files(Tree(replicas[0].root), replicas)
    print(table(probe(replicas, list(files.values()), args.seconds)))
    return 0


# -- bench ---------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    from colifs import bench
    from colifs.routing import parse_weights

    for d in args.dirs:
        if not os.path.isdir(d):
            raise UsageError(f"{d} is not a directory")
    if args.threads < 1 or args.seconds <= 0 or args.zipf < 0:
        raise UsageError("--threads must be at least 1, --seconds positive, --zipf 0 or more")
    try:
        weights = parse_weights(args.weights, len(args.dirs)) if args.weights else None
        result = bench.run(
            args.dirs,
            weights,
            threads=args.threads,
            seconds=args.seconds,
            zipf=args.zipf,
            mode=args.mode,
            cold=not args.warm,
            devices=[d for d in args.inflight.split(",") if d],
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(json.dumps(result) if args.json else bench.report(result))
    return 0


# -- plan, stage, verify --------------------------------------------------------------------------


def _plan(args: argparse.Namespace) -> tuple[list, list, str, str, int]:
    """(replicas, choices, where the usage came from, mirror root, reserve) for plan and stage."""
    from colifs.mount import check_roots
    from colifs.plan import choose, estimate, find_usage, parse_size, survey

    replicas = check_roots([args.primary, args.mirror], error=UsageError)
    primary, mirror = replicas[0].root, replicas[1].root
    budget, reserve = parse_size(args.budget), parse_size(args.reserve)
    shards = survey(primary, mirror)
    if not shards:
        raise UsageError(f"{args.primary} holds no model file (*.safetensors, *.gguf)")
    usage, source = find_usage(primary, args.usage, shards)
    estimate(shards, usage)
    st = os.statvfs(mirror)
    free = st.f_bavail * st.f_frsize
    return replicas, choose(shards, budget, max(0, free - reserve)), source, mirror, reserve


def _prediction_weights(args: argparse.Namespace, replicas: list, choices: list) -> tuple[list[float], str]:
    from colifs.probe import probe, weights_from
    from colifs.replicas import ServedFile
    from colifs.routing import parse_weights

    text = args.weights or os.environ.get(WEIGHTS_ENV)
    if text:
        try:
            return parse_weights(text, 2), "given"
        except ValueError as e:
            raise UsageError(str(e)) from None
    files = [
        ServedFile(c.shard.relpath, c.shard.size, c.shard.layout, (0, 1) if c.shard.present else (0,))
        for c in choices
        if c.shard.layout is not None
    ]
    if any(f.replicas == (0, 1) for f in files):
        results = probe(replicas, files, 2.0)
        if all(r.mb_per_s for r in results):
            return weights_from(results), "probed"
    return [1.0, 1.0], "assumed equal: nothing on the mirror to probe yet; pass --weights"


def cmd_plan(args: argparse.Namespace) -> int:
    from colifs.plan import coverage, human, speedup

    replicas, choices, source, mirror, _ = _plan(args)
    weights, wsource = _prediction_weights(args, replicas, choices)
    total = sum(c.shard.traffic for c in choices) or 1.0
    cov = coverage(choices)
    rows, space, cum = [], 0, 0.0
    for c in choices:
        if c.selected:
            space += c.shard.size
            cum += c.shard.traffic
        rows.append(
            {
                "shard": c.shard.relpath,
                "size": c.shard.size,
                "traffic_share": c.shard.traffic / total,
                "action": c.reason,
                "selected": c.selected,
                "cumulative_space": space if c.selected else None,
                "cumulative_coverage": cum / total if c.selected else None,
            }
        )
    to_copy = sum(c.shard.size for c in choices if c.selected and not c.shard.present)
    summary = {
        "usage": source,
        "weights": weights,
        "weights_source": wsource,
        "coverage": cov,
        "bytes_to_copy": to_copy,
        "bytes_on_mirror": sum(c.shard.size for c in choices if c.selected and c.shard.present),
        "predicted_speedup": speedup(cov, weights),
        "shards": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{source}")
    width = max(len(r["shard"]) for r in rows)
    print(f"{'shard':<{width}} {'size':>11} {'traffic':>8} {'cum. space':>11} {'coverage':>8}  action")
    for r in rows:
        cs = human(r["cumulative_space"]) if r["selected"] else ""
        cc = f"{r['cumulative_coverage']:.1%}" if r["selected"] else ""
        share = f"{r['traffic_share']:.1%}"
        print(f"{r['shard']:<{width}} {human(r['size']):>11} {share:>8} {cs:>11} {cc:>8}  {r['action']}")
    print(
        f"selected {sum(r['selected'] for r in rows)} of {len(rows)} shards: {human(to_copy)} to copy, "
        f"{human(summary['bytes_on_mirror'])} already on {mirror}; they cover {cov:.1%} of the traffic"
    )
    print(
        f"predicted read speed {summary['predicted_speedup']:.2f}x the primary alone "
        f"(weights {':'.join(f'{w:g}' for w in weights)}, {wsource})"
    )
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from colifs.plan import coverage, human
    from colifs.stage import stage

    def say(line: str) -> None:
        print(f"colifs: {line}", file=sys.stderr)

    replicas, choices, source, mirror, reserve = _plan(args)
    say(source)
    result = stage(replicas[0].root, mirror, choices, reserve, args.quiet, say)
    copied = sum(c.shard.size for c in choices if c.shard.relpath in set(result.copied))
    print(
        f"staged {len(result.copied)} shard(s) ({human(copied)}), {len(result.kept)} already on {mirror}; "
        f"they cover {coverage(choices):.1%} of the traffic; receipt written"
    )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from colifs.mount import check_roots
    from colifs.plan import human
    from colifs.stage import EXIT_DIFFERS
    from colifs.verify import verify

    replicas = check_roots([args.primary, args.mirror], error=UsageError)
    rows = verify(replicas[0].root, replicas[1].root, args.deep, args.quiet)
    bad = [r for r in rows if r.status == "data differs"]
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1))
    else:
        width = max([len(r.relpath) for r in rows] + [5])
        print(f"{'shard':<{width}} {'size':>11}  status")
        for r in rows:
            print(f"{r.relpath:<{width}} {human(r.size):>11}  {r.status}")
        counts: dict[str, int] = {}
        for r in rows:
            counts[r.status] = counts.get(r.status, 0) + 1
        checked = "size, header and data" if args.deep else "size and header (--deep compares the data)"
        print(f"{', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}; checked {checked}")
    if bad:
        print(
            f"colifs: error: {len(bad)} mirror copy(ies) the mount would use differ from the primary",
            file=sys.stderr,
        )
        return EXIT_DIFFERS
    return 0


# -- route ---------------------------------------------------------------------------------------


def cmd_route(args: argparse.Namespace) -> int:
    try:
        offset = int(args.offset, 0)
    except ValueError:
        raise UsageError(f"offset {args.offset!r} is not a number") from None
    if not os.path.isfile(args.file):
        raise UsageError(f"{args.file} is not a file")
    try:
        raw = os.getxattr(args.file, f"user.colifs.route.{offset}")
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise UsageError(
                f"offset {offset} is outside {args.file} ({os.path.getsize(args.file)} bytes)"
            ) from None
        raise NotMountedError(f"{args.file} is not a file on a colifs mount") from None
    answer = json.loads(raw)
    if args.json:
        print(json.dumps(answer, indent=1))
        return 0
    key = answer["key"]
    if isinstance(key, dict):
        key = f"expert {key['expert']} of {key['stack']} layer {key['layer']}"
    print(f"{answer['file']} byte {offset}")
    if key is None:
        print("  not a model file: served from the primary as plain bytes")
        return 0
    print(f"  tensor  {answer['tensor'] or '(header)'}")
    print(f"  key     {key}")
    print(f"  drive   {answer['drive']} ({answer['path']})")
    print(f"  copies  {', '.join(answer['valid_copies'])}")
    keyed = ", ".join(f"{n} {why}" for why, n in answer.get("tensors_keyed", {}).items())
    print(f"  file    tensors keyed: {keyed or 'none'}")
    return 0


# -- completion ----------------------------------------------------------------------------------


def cmd_completion(args: argparse.Namespace) -> int:
    from colifs.completion import bash

    sys.stdout.write(bash(_parser()))
    return 0


# -- top -----------------------------------------------------------------------------------------


def cmd_top(args: argparse.Namespace) -> int:
    from colifs.top import run

    if not args.interval > 0 or (args.count is not None and args.count < 1):
        raise UsageError("--interval must be positive and --count at least 1")
    _read_stats(args.mountpoint)  # one clear line now if it is not a mount
    try:
        run(lambda: _read_stats(args.mountpoint), args.interval, args.count)
    except KeyboardInterrupt:  # Ctrl-C is how a live view ends, like q
        print()
    return 0


# -- stats ---------------------------------------------------------------------------------------


def cmd_stats(args: argparse.Namespace) -> int:
    data = _read_stats(args.mountpoint)
    if args.prometheus:
        from colifs.metrics import prometheus

        sys.stdout.write(prometheus(data))
        return 0
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    print(f"colifs {args.mountpoint}: up {data['uptime_s']:.0f} s, weights {data['weights_source']}")
    print(
        f"{'replica':<9} {'path':<32} {'weight':>7} {'GB':>9} {'share':>6} {'reads':>9} {'errors':>6}  state"
    )
    for r in data["replicas"]:
        health = r.get("health")
        state = "primary" if health is None else health["state"]
        if health is not None and health["state"] == "down":
            state += f" (next check in {health['next_check_in_s']:g} s; {health['last_error']})"
        print(
            f"{r['name']:<9} {r['path']:<32} {r['weight_share']:>6.0%} {r['bytes_served'] / 1e9:>9.2f}"
            f" {r['byte_share']:>6.0%} {r['reads']:>9} {r['read_errors']:>6}  {state}"
        )
    print(f"fallbacks {data['fallbacks']}")
    partial = data.get("partial_mirror")
    if partial:
        split = " / ".join(f"{x:.1%}" for x in partial["predicted_byte_share"])
        plain = " / ".join(f"{x:.1%}" for x in partial["plain_byte_share"])
        actual = " / ".join(f"{r['byte_share']:.1%}" for r in data["replicas"])
        print(f"partial mirror(s), from the usage history: byte split expected {split} (plain weights "
              f"would give {plain}), actual {actual}")  # fmt: skip
    usage = data.get("usage") or {}
    if usage.get("file"):
        state = "kept" if usage.get("saving") else "not kept this run"
        print(f"usage: {usage['file']} ({state}; last saved {usage.get('last_saved') or 'not yet'})")
    notes = {name: f["note"] for name, f in data["files"].items() if f["note"]}
    for name, note in sorted(notes.items()):
        print(f"note: {name}: {note}")
    return 0
