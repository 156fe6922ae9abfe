"""What is checked before anything is built: the replica directories, the mount point, where usage
is saved. Each problem is one line (a QuietError); nothing here needs FUSE, so plan, stage, verify
and probe use it too.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence

from colifs.errors import MountError, QuietError
from colifs.kernel import mount_type
from colifs.replicas import Replica
from colifs.stores import same_or_inside, served_dir


def check_roots(
    paths: Sequence[str],
    weights: Sequence[float] | None = None,
    error: type[QuietError] = MountError,
    revision: str = "main",
) -> list[Replica]:
    """Resolve the replica directories (primary first; a Hugging Face cache repository directory
    is its snapshot of `revision`); `error` with one clear line if one is bad."""
    roots = []
    for i, path in enumerate(paths):
        try:
            real = served_dir(path, revision)
        except ValueError as e:
            raise error(str(e)) from None
        if not os.path.isdir(real):
            what = "does not exist" if not os.path.exists(real) else "is not a directory"
            raise error(f"{'mirror' if i else 'primary'} {path} {what}")
        roots.append(real)
    seen: dict[tuple[int, int], str] = {}
    for root in roots:
        st = os.stat(root)
        ident = (st.st_dev, st.st_ino)
        if ident in seen:
            raise error(f"{root} and {seen[ident]} are the same directory")
        seen[ident] = root
    weights = list(weights or [1.0] * len(roots))
    if len(weights) != len(roots):
        raise error(f"{len(weights)} weights for {len(roots)} replicas")
    return [Replica(i, root, w) for i, (root, w) in enumerate(zip(roots, weights, strict=True))]


def check_mountpoint(mountpoint: str, roots: Sequence[str]) -> str:
    """The resolved mount point: an empty directory, not inside a replica, not mounted already."""
    try:
        mnt_st = os.stat(mountpoint)
    except FileNotFoundError:
        raise MountError(f"mountpoint {mountpoint} does not exist") from None
    except OSError as e:
        raise MountError(f"mountpoint {mountpoint}: {e.strerror}") from None
    if not stat.S_ISDIR(mnt_st.st_mode):
        raise MountError(f"mountpoint {mountpoint} is not a directory")
    mnt = os.path.realpath(mountpoint)
    for root in roots:
        if same_or_inside(mnt, root):
            raise MountError(f"mountpoint {mountpoint} is inside {root}")
    if mount_type(mnt) is not None:
        _refuse_mounted(mountpoint, mnt)
    if os.listdir(mnt):
        raise MountError(f"mountpoint {mountpoint} is not empty")
    return mnt


def _refuse_mounted(mountpoint: str, mnt: str) -> None:
    try:
        os.listdir(mnt)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            stale = f"mountpoint {mountpoint} is a stale mount (its daemon is gone)"
            raise MountError(f"{stale}; run: colifs umount {mountpoint}") from None
    raise MountError(f"mountpoint {mountpoint} is already a mount point")


def check_usage_path(path: str, replicas: Sequence[Replica]) -> str:
    """Where usage is saved, resolved: never on a mirror, in a directory that exists."""
    path = os.path.abspath(path)
    real = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    for r in replicas[1:]:
        if same_or_inside(real, r.root):
            raise MountError(f"usage file {path} is inside mirror {r.root}: colifs never writes to a mirror")
    if not os.path.isdir(os.path.dirname(real)):
        raise MountError(f"usage file {path}: directory {os.path.dirname(path)} does not exist")
    return real
