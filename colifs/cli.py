"""The command line: every subcommand's parser, and a thin handler each that calls the module doing
the work (config, daemon, client, plan, tables, ...). User errors are one line and a specific exit
code; heavy imports (pyfuse3, trio, numpy) happen only in the commands that need them."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence

from colifs import __version__
from colifs.config import DEFAULT_FILL_MIB, ENGINE_ENV, ENGINES, WEIGHTS_ENV
from colifs.errors import EXIT_NOT_RELOADED, QuietError, UsageError


def parser() -> argparse.ArgumentParser:
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
        help="without weights, measure each drive for about S seconds at mount to choose them "
        "(default: 2); with weights, the native engine times each drive for at most 0.3 s to choose "
        "the readahead and whether fills run; 0: no probe",
    )
    m.add_argument("--no-probe", action="store_true", help="without weights, use equal weights, no probe")
    m.add_argument(
        "--adaptive-weights",
        action="store_true",
        help="move the weights to what each drive delivers now (the default; kept for old command lines)",
    )
    m.add_argument(
        "--fixed-weights",
        action="store_true",
        help="keep the weights given or probed at mount, whatever the drives do while serving "
        "(--routing stripe unless given: no spill of a drive's backlog either)",
    )
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
        help="readahead of the mount (root only; default: 128 with the native engine, or 32 / 64 when the "
        "drives read below 600 / 1000 MB/s together, probed at mount or measured while serving (then for "
        "files opened later); 512 with pyfuse3; 0 = the kernel's default); "
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
        choices=["queue", "stripe", "expert"],
        help="stripe: keys of 2 MiB or more cut in 1 MiB chunks spread over the drives in the weights' "
        "ratio, so even one reader uses every drive; queue (the native engine's default): as stripe, "
        "but a piece whose drive has a backlog goes to a drive that reads it at least twice as soon; "
        "expert: each expert from one drive (default: queue, stripe with --engine pyfuse3)",
    )
    m.add_argument(
        "--fill-mib",
        type=int,
        default=DEFAULT_FILL_MIB,
        metavar="MIB",
        help="native engine: a page-cache reader's (mmap, buffered) first request into a routed expert "
        "reads 1 MiB of its tensor ahead, and once the reader goes on, the rest of the expert's pages "
        "the page cache lacks (up to 16 MiB) from every drive at once, each "
        "piece answering the kernel's request that waits for it or stored into the page cache (so "
        "does a reader streaming through any other tensor); fills run while some drive makes each "
        "read wait (an NVMe: not a bandwidth cap) and hold at most this much memory (default: "
        f"{DEFAULT_FILL_MIB}; 0: off)",
    )
    m.add_argument(
        "--store-root",
        action="append",
        default=[],
        metavar="DIR",
        help="symlinks that lead into DIR are served as the files they lead to (repeatable); the "
        "model's directory and, for a Hugging Face snapshot, its repository directory always are",
    )
    m.add_argument(
        "--revision",
        default="main",
        metavar="REV",
        help="a Hugging Face cache repository directory (models--ORG--NAME) given as a replica serves "
        "the snapshot of this ref or commit (default: main)",
    )
    pt = m.add_mutually_exclusive_group()
    pt.add_argument(
        "--passthrough",
        dest="passthrough",
        action="store_const",
        const="always",
        default="auto",
        help="native engine, Linux 6.9+, root: every page-cache open (mmap, buffered; not O_DIRECT) is "
        "read by the kernel from the primary itself (FUSE passthrough): the fast drive's own speed at "
        "no daemon CPU, without the mirrors' bandwidth; for drives faster than the daemon can copy "
        "(see docs/benchmarks.md); what they read is not in the per-drive counts. By default only "
        "the files no mirror holds pass through, while the drives need no reads ahead (no fills)",
    )
    pt.add_argument(
        "--no-passthrough",
        dest="passthrough",
        action="store_const",
        const="never",
        help="the daemon serves every open, also of files no mirror holds",
    )
    m.add_argument(
        "--direct-reads",
        action="store_true",
        help="native engine, Linux 6.6+: read() calls of page-cache opens reach the daemon as they are "
        "(FUSE direct I/O), not as the mount's page cache asks for pages; the drives' own page caches "
        "keep what they read. For engines that read whole experts or tensors into their own buffers "
        "(Colibrì's buffered reads): fewer copies and less CPU per GB; not for tools that read in "
        "small buffers (each call is a round trip). What engines map (llama.cpp, safe_open) "
        "still goes through the page cache, which the kernel empties of that file at each new mapping",
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
        help="a mirror read not answered within S seconds is re-read from the primary; repeated "
        "failures take the mirror out of use until a check read passes (default: 5, 0 = never, "
        "at most 86400)",
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
        "share of bytes vs weights, reads in flight, errors, mirror health, fallbacks, the daemon's CPU, "
        "hottest layers. q or Ctrl-C exits.",
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

    rl = sub.add_parser(
        "reload",
        help="check a mount's mirrors again while it serves",
        description="Check every mirror of a mount again, as at mount (size, header, receipt), while it "
        "serves: copies staged or repaired since start serving, copies that changed or went away stop, "
        "the routing follows. Returns once the new state is in force and prints what changed, one line "
        "per mirror. Also: SIGHUP to the daemon (systemd: systemctl reload).",
    )
    rl.add_argument("mountpoint", help="a colifs mount point")
    rl.add_argument(
        "--timeout", type=float, default=120.0, metavar="S", help="give up after S seconds (default: 120)"
    )

    mi = sub.add_parser(
        "mirror",
        help="take a mirror away from a mount, or bring it back, while it serves",
        description="Take a mirror away from a mount while it serves (no new read goes to it, reads in "
        "flight on it finish, then every descriptor the daemon holds there is closed and no thread is "
        "left in a call there: its drive can be unmounted), or add one: a removed one back, or a new "
        "directory (in a removed one's place, else one more; it never waits for a call stuck in the "
        "removed drive), judged and validated as at mount (never the mount point or under it, nor the "
        "primary or a mirror already in use), then its copies' bytes compared with the primary's by the "
        "daemon. What a reboot mounts is what fstab or the unit names.",
    )
    msub = mi.add_subparsers(dest="mirror_command", required=True, metavar="ACTION", help="remove or add")
    for action, help_ in (
        ("remove", "take MIRROR away; returns once no descriptor nor call is left in its drive"),
        (
            "add",
            "add MIRROR (a removed one back, or a new one); its copies serve once the daemon has "
            "compared them with the primary",
        ),
    ):
        a = msub.add_parser(action, help=help_, description=help_[0].upper() + help_[1:] + ".")
        a.add_argument("mountpoint", help="a colifs mount point")
        a.add_argument("dir", metavar="MIRROR", help="the mirror's directory")
        if action == "add":
            a.add_argument(
                "--weight", type=float, metavar="W",
                help="its weight, as in --weights (default: the one it had; a new directory's is measured)",
            )  # fmt: skip
            a.add_argument(
                "--deep", action="store_true",
                help="before its copies serve, the daemon compares every byte of them with the primary "
                "(default: random 1 MiB ranges of each; give a --timeout long enough to read it all)",
            )  # fmt: skip
        a.add_argument(
            "--timeout", type=float, default=60.0, metavar="S", help="give up after S seconds (default: 60)"
        )

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
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except QuietError as e:
        print(f"colifs: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("colifs: interrupted", file=sys.stderr)
        return 130


def _print(lines: Sequence[str]) -> None:
    print("\n".join(lines))


def cmd_mount(args: argparse.Namespace) -> int:
    from colifs.config import mount_config
    from colifs.daemon import daemonize, foreground

    cfg = mount_config(args)
    if args.foreground:
        return foreground(cfg, args.debug, args.log_file, on_ready=lambda: None)
    return daemonize(cfg, args.debug, args.log_file)


def cmd_umount(args: argparse.Namespace) -> int:
    from colifs.client import umount

    said = umount(args.mountpoint, args.lazy, args.timeout)
    if said:
        print(f"colifs: {said}", file=sys.stderr)
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from colifs import logs
    from colifs.catalogue import build_files
    from colifs.checks import check_roots
    from colifs.devices import one_drive
    from colifs.probe import probe, table
    from colifs.tree import Tree

    logs.setup()
    if args.seconds <= 0:
        raise UsageError("--seconds must be positive")
    replicas = check_roots(args.dirs, error=UsageError)
    files = build_files(Tree(replicas[0].root), replicas)
    groups = one_drive([r.root for r in replicas])
    print(table(probe(replicas, list(files.values()), args.seconds, groups)))
    return 0


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


def cmd_plan(args: argparse.Namespace) -> int:
    from colifs.client import mounts_using
    from colifs.plan import make_plan, prediction_weights, summary
    from colifs.tables import plan_table

    plan = make_plan(args.primary, args.mirror, args.budget, args.reserve, args.usage)
    result = summary(plan, *prediction_weights(args.weights, plan))
    result["mounts_using_mirror"] = mounts_using(plan.mirror)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    _print(plan_table(result, plan.mirror))
    if result["mounts_using_mirror"]:
        print(f"served by: {', '.join(result['mounts_using_mirror'])} (colifs stage reloads them)")
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from colifs.plan import coverage, make_plan
    from colifs.stage import stage
    from colifs.units import human

    def say(line: str) -> None:
        print(f"colifs: {line}", file=sys.stderr)

    plan = make_plan(args.primary, args.mirror, args.budget, args.reserve, args.usage)
    say(plan.usage_source)
    result = stage(plan.replicas[0].root, plan.mirror, plan.choices, plan.reserve, args.quiet, say)
    copied = sum(c.shard.size for c in plan.choices if c.shard.relpath in set(result.copied))
    print(
        f"staged {len(result.copied)} shard(s) ({human(copied)}), {len(result.kept)} already on "
        f"{plan.mirror}; they cover {coverage(plan.choices):.1%} of the traffic; receipt written"
    )
    return _reload_users(plan.mirror, say)


def _reload_users(mirror: str, say: Callable[[str], None]) -> int:
    """Every live mount serving `mirror` reloads, so it serves what was just staged."""
    from colifs.client import mounts_using, reload

    failed = 0
    want = os.path.realpath(mirror)  # ours; the mounts' paths are compared as their daemons resolved them
    for mnt in mounts_using(mirror):
        try:
            last = reload(mnt, 120.0)
        except QuietError as e:
            say(f"{mnt} not reloaded: {e}; run colifs reload {mnt}")
            failed = EXIT_NOT_RELOADED
            continue
        for m in last["mirrors"]:
            if m["path"] == want:
                print(f"{mnt} reloaded, mirror {mirror}: " + reload_line(m))
    return failed


def cmd_verify(args: argparse.Namespace) -> int:
    from colifs.checks import check_roots
    from colifs.stage import EXIT_DIFFERS
    from colifs.tables import verify_table
    from colifs.verify import verify

    replicas = check_roots([args.primary, args.mirror], error=UsageError)
    rows = verify(replicas[0].root, replicas[1].root, args.deep, args.quiet)
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1))
    else:
        _print(verify_table(rows, args.deep))
    bad = [r for r in rows if r.status == "data differs"]
    if bad:
        print(
            f"colifs: error: {len(bad)} mirror copy(ies) the mount would use differ from the primary",
            file=sys.stderr,
        )
        return EXIT_DIFFERS
    return 0


def cmd_route(args: argparse.Namespace) -> int:
    from colifs.client import route
    from colifs.tables import route_text

    try:
        offset = int(args.offset, 0)
    except ValueError:
        raise UsageError(f"offset {args.offset!r} is not a number") from None
    answer = route(args.file, offset)
    if args.json:
        print(json.dumps(answer, indent=1))
    else:
        _print(route_text(answer, offset))
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    from colifs.completion import bash

    sys.stdout.write(bash(parser()))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from colifs.client import read_stats
    from colifs.top import run

    if not args.interval > 0 or (args.count is not None and args.count < 1):
        raise UsageError("--interval must be positive and --count at least 1")
    read_stats(args.mountpoint)  # one clear line now if it is not a mount
    # Ctrl-C ends a live view even when it was started with SIGINT ignored (a shell's background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run(lambda: read_stats(args.mountpoint), args.interval, args.count)
    except KeyboardInterrupt:  # Ctrl-C is how a live view ends, like q
        print()
    return 0


def reload_line(m: dict) -> str:
    """What a reload did with one mirror, as `colifs reload` and `colifs stage` say it."""
    if m.get("removed"):
        return "removed (colifs mirror add brings it back)"
    if not m["checked"]:
        return f"down or unreadable, left as it was ({m['model_files']} model files served)"
    busy = f", {len(m['busy'])} busy (left as they were)" if m["busy"] else ""
    refused = f", {len(m['refused'])} refused (not the primary's bytes)" if m.get("refused") else ""
    served = f"{m['model_files']} model files served"
    return f"{len(m['added'])} files added, {len(m['dropped'])} dropped{busy}{refused}, {served}"


def cmd_reload(args: argparse.Namespace) -> int:
    from colifs.client import reload

    last = reload(args.mountpoint, args.timeout)
    for m in last["mirrors"]:
        print(f"mirror {m['path']}: " + reload_line(m))
    for relpath in last["primary_changed"]:
        print(f"primary {relpath}: changed since mount; opens of it fail (EIO) until it is mounted again")
    return 0


def cmd_mirror(args: argparse.Namespace) -> int:
    from colifs.client import mirror

    weight = getattr(args, "weight", None)
    if weight is not None and not (0 < weight < float("inf")):
        raise UsageError(f"--weight must be a positive number, not {weight:g}")
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    done = mirror(
        args.mountpoint, args.mirror_command, args.dir, args.timeout, weight, getattr(args, "deep", False)
    )
    if done["command"] == "remove":
        print(f"mirror {done['path']} removed: {done['files']} files no longer read from it, no descriptor "
              f"nor call left in its drive ({done['seconds']:g} s)")  # fmt: skip
        return 0
    proof = done.get("proof", {})
    how = {
        "deep": ", every byte compared with the primary",
        "sampled": ", sampled ranges compared with the primary",
    }
    proven = how.get(proof.get("mode"), "")
    print(
        f"mirror {done['path']} added: {done['files']} files served from it{proven} ({done['seconds']:g} s)"
    )
    for relpath, why in sorted(proof.get("refused", {}).items()):
        print(f"  not used: {relpath}: {why}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from colifs.client import read_stats

    data = read_stats(args.mountpoint)
    if args.prometheus:
        from colifs.metrics import prometheus

        sys.stdout.write(prometheus(data))
    elif args.json:
        print(json.dumps(data, indent=1))
    else:
        from colifs.tables import stats_table

        _print(stats_table(args.mountpoint, data))
    return 0


COMMANDS = {
    "mount": cmd_mount,
    "umount": cmd_umount,
    "probe": cmd_probe,
    "bench": cmd_bench,
    "stats": cmd_stats,
    "reload": cmd_reload,
    "mirror": cmd_mirror,
    "plan": cmd_plan,
    "stage": cmd_stage,
    "verify": cmd_verify,
    "route": cmd_route,
    "top": cmd_top,
    "completion": cmd_completion,
}
