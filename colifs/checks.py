"""What is checked before anything is built: the replica directories, the mount point, where usage
is saved. Each problem is one line (a QuietError); nothing here needs FUSE, so plan, stage, verify
and probe use it too.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence

from colifs.errors import MountError, QuietError, UsageError
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
    roots = [served_root(path, "mirror" if i else "primary", revision, error) for i, path in enumerate(paths)]
    seen: dict[tuple[int, int], str] = {}
    for root in roots:
        ident = directory_id(root)
        if ident in seen:
            raise error(f"{root} and {seen[ident]} are the same directory")
        seen[ident] = root
    weights = list(weights or [1.0] * len(roots))
    if len(weights) != len(roots):
        raise error(f"{len(weights)} weights for {len(roots)} replicas")
    return [Replica(i, root, w) for i, (root, w) in enumerate(zip(roots, weights, strict=True))]


def served_root(path: str, role: str, revision: str, error: type[QuietError]) -> str:
    """The directory a replica argument serves, resolved (an HF cache repository: its snapshot of
    `revision`), or `error` with one line when there is none."""
    try:
        real = served_dir(path, revision)
    except ValueError as e:
        raise error(str(e)) from None
    if not os.path.isdir(real):
        what = "does not exist" if not os.path.exists(real) else "is not a directory"
        raise error(f"{role} {path} {what}")
    return real


def directory_id(root: str) -> tuple[int, int]:
    """What makes two paths the same directory (a bind mount, another path to it)."""
    st = os.stat(root)
    return st.st_dev, st.st_ino


def mountpoint_clash(mnt: str, root: str) -> str | None:
    """Why a replica directory `root` and the mount point `mnt` (both resolved, or both as given)
    cannot go together, or None: the mount point inside the replica would hide part of it under
    the mount; a replica at or under the mount point would be read through the mount itself."""
    if same_or_inside(root, mnt):
        where = "the mount point" if root == mnt else f"inside mountpoint {mnt}"
        return f"{root} is {where}: the mount would read its own files"
    if same_or_inside(mnt, root):
        return f"mountpoint {mnt} is inside {root}"
    return None


def judge_mirror(
    path: str, mnt: str | None, mount_dev: int | None, known: Sequence[tuple[str, str]], revision: str
) -> tuple[str, int | None]:
    """A directory to add to the mount on `mnt` as a mirror (`colifs mirror add`), judged as
    `colifs mount` judges its mirrors, by the client before it asks and by the daemon again:
    (its resolved served directory, the index in `known` of the replica it is, if any).
    `known`: each replica's (root, state), state "primary", "up", "down" or "removed".
    UsageError with one line when it may not join. Blocks (it stats the directories and, when
    it is a path into the mount, the mount): call it off a daemon's loop, with a bound."""
    real = _clear_of_the_mount(path, mnt, mount_dev, revision)
    index = _which(real, known)
    if index is not None and known[index][1] == "primary":
        raise UsageError(f"{path} is the primary of this mount, not a mirror")
    if index is not None and known[index][1] != "removed":
        raise UsageError(f"{path} is a mirror of this mount already")
    return real, index


def _clear_of_the_mount(path: str, mnt: str | None, mount_dev: int | None, revision: str) -> str:
    """The served directory of `path`, resolved: neither the mount point nor under it (as given,
    before anything is resolved through the mount, and resolved), nor on the mount's device."""
    given = os.path.abspath(path)
    if mnt is not None and (clash := mountpoint_clash(mnt, given)):
        raise UsageError(f"mirror {path}: {clash}")
    real = served_root(given, "mirror", revision, UsageError)
    if mnt is not None and (clash := mountpoint_clash(mnt, real)):
        raise UsageError(f"mirror {path}: {clash}")
    if mount_dev is not None and directory_id(real)[0] == mount_dev:
        raise UsageError(
            f"mirror {path}: it is on the mount {mnt} itself: the mount would read its own files"
        )
    return real


def _which(real: str, known: Sequence[tuple[str, str]]) -> int | None:
    """The index of the replica in `known` that is the directory `real`: by path, else (a bind
    mount, another path to it) by device and inode among those that answer (up, or the primary;
    a down mirror's directory is not asked)."""
    index = next((i for i, (root, _) in enumerate(known) if root == real), None)
    if index is not None:
        return index
    ident = directory_id(real)
    return next(
        (
            i
            for i, (root, state) in enumerate(known)
            if state in ("primary", "up") and _same_directory(root, ident)
        ),
        None,
    )


def _same_directory(root: str, ident: tuple[int, int]) -> bool:
    try:
        return directory_id(root) == ident
    except OSError:
        return False


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
        clash = mountpoint_clash(mnt, root)
        if clash is not None:
            raise MountError(clash.replace(f"mountpoint {mnt}", f"mountpoint {mountpoint}", 1))
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
