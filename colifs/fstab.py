"""`mount.fuse.colifs`: mount(8)'s helper, so that colifs mounts from /etc/fstab or `mount -t`.

    /fast/m:/second/m  /mnt/model  fuse.colifs  ro,weights=9:3,allow_other,nofail  0 0

mount(8) runs `/sbin/mount.fuse.colifs SOURCE MOUNTPOINT [-sfnv] [-o OPTIONS]`: the source is the
primary and the mirrors joined by ':', the options are colifs' mount flags with `_` for `-`
(values after `=`, weights with `:` or `,`), plus the generic fstab options, which are ignored.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from colifs.errors import UsageError


def _flags() -> dict[str, bool]:
    """`colifs mount`'s options an fstab line may set, read from its parser (so the two never
    drift apart): option name -> takes a value. Not --foreground: mount(8) waits for the helper,
    which returns once the mount serves."""
    from colifs.cli import parser
    from colifs.completion import _subparsers

    out = {}
    for action in _subparsers(parser())["mount"]._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and longs[0] not in ("--help", "--foreground"):
            out[longs[0][2:].replace("-", "_")] = action.nargs != 0
    return out


FLAGS = _flags()
# fstab / mount(8) options that concern mount(8), systemd or the kernel's defaults, not colifs
GENERIC = {
    "ro", "rw", "defaults", "auto", "noauto", "user", "users", "nouser", "owner", "group", "nofail",
    "_netdev", "noatime", "relatime", "strictatime", "nodiratime", "nosuid", "suid", "nodev", "dev",
    "exec", "noexec", "async", "sync", "silent", "loud",
}  # fmt: skip


def mount_args(source: str, mountpoint: str, options: str) -> list[str]:
    """The `colifs mount` arguments for an fstab entry; UsageError names a bad option."""
    roots = [p for p in source.split(":") if p]
    if not roots:
        raise UsageError(f"source {source!r}: expected PRIMARY[:MIRROR...]")
    flags: list[str] = []
    for opt in filter(None, options.split(",")):
        name, eq, value = opt.partition("=")
        if name in GENERIC or name.startswith(("x-", "comment=")) or opt.startswith("comment="):
            continue
        if name not in FLAGS:
            raise UsageError(f"unknown option {opt!r} (colifs options: {', '.join(sorted(FLAGS))})")
        if FLAGS[name] != bool(eq):
            raise UsageError(f"option {name} {'needs' if FLAGS[name] else 'takes no'} a value")
        flags.append("--" + name.replace("_", "-"))
        if eq:
            flags.append(value.replace(":", ",") if name == "weights" else value)
    return [*roots, mountpoint, *flags]


def parse_argv(argv: Sequence[str]) -> tuple[str, str, str, bool]:
    """(source, mountpoint, options, fake) from mount(8)'s helper command line."""
    args = list(argv)
    positional: list[str] = []
    options: list[str] = []
    fake = False
    while args:
        a = args.pop(0)
        if a == "-o":
            if not args:
                raise UsageError("-o needs options")
            options.append(args.pop(0))
        elif a.startswith("-o"):
            options.append(a[2:])
        elif a in ("-t", "-N"):
            args[:1] = []  # the type (fuse.colifs) and a namespace: nothing for colifs
        elif a.startswith("-") and len(a) > 1:
            fake = fake or "f" in a[1:]  # -f: mount(8)'s "fake" (do everything but mount)
        else:
            positional.append(a)
    if len(positional) != 2:
        raise UsageError("usage: mount.fuse.colifs PRIMARY[:MIRROR...] MOUNTPOINT [-o OPTIONS]")
    return positional[0], positional[1], ",".join(options), fake


def main(argv: Sequence[str] | None = None) -> int:
    from colifs.cli import main as colifs_main

    try:
        source, mountpoint, options, fake = parse_argv(sys.argv[1:] if argv is None else argv)
        args = mount_args(source, mountpoint, options)
    except UsageError as e:
        print(f"mount.fuse.colifs: error: {e}", file=sys.stderr)
        return e.exit_code
    if fake:
        return 0
    return colifs_main(["mount", *args])
