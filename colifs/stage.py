"""Copy planned shards onto a mirror, and check mirror copies against the primary.

Safety rules, each tested with kill -9 at many moments:
- a copy goes to a temporary name in the target directory, is fsynced, read back from the drive
  (its page cache dropped) and compared by SHA-256 with the primary's bytes, and only then linked
  to its final name; a crash leaves no partial file under a final name, and the next run removes
  the half-copied temporaries;
- the primary is only read; an existing mirror file is never deleted or replaced;
- the free-space reserve is checked before each shard; short of space the run stops cleanly;
- the receipt (`MIRROR/.colifs-receipt.json`) is written atomically, and only once the whole
  selected set is in place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from colifs.errors import QuietError
from colifs.plan import Choice, Shard
from colifs.progress import Progress
from colifs.receipt import TMP_PREFIX, TMP_SUFFIX, fsync_dir, load_receipt, receipt_vouches, write_receipt

log = logging.getLogger("colifs")

READ_BLOCK = 8 << 20
EXIT_DIFFERS = 4  # verify: a mirror copy the mount would use differs from the primary
EXIT_SHORT = 5  # stage: stopped before the whole selection was in place (space)


class StageError(QuietError):
    """Staging stopped; the message says why. Nothing partial is left under a final name."""


def remove_temporaries(mirror: str) -> list[str]:
    """Half-copied temporaries left by an interrupted stage (only names colifs itself uses)."""
    removed = []
    for dirpath, _, names in os.walk(mirror):
        for name in names:
            if name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX):
                path = os.path.join(dirpath, name)
                os.unlink(path)
                removed.append(path)
    return removed


def sha256_file(path: str, progress: Progress | None = None, from_drive: bool = False) -> str:
    """SHA-256 of a file; `from_drive` first drops its (clean) cached pages so the drive is read."""
    h = hashlib.sha256()
    buf = bytearray(READ_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        if from_drive:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        while n := f.readinto(buf):
            h.update(view[:n])
            if progress is not None:
                progress.add(n)
    return h.hexdigest()


def _place(tmp: str, final: str) -> None:
    """Give `tmp` its final name without ever replacing a file there (link, then unlink)."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        os.unlink(tmp)
        raise StageError(f"{final} appeared while it was being copied; not replaced") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        if os.path.lexists(final):  # no hard links here (vfat...): check, then rename
            os.unlink(tmp)
            raise StageError(f"{final} appeared while it was being copied; not replaced") from None
        os.rename(tmp, final)
        return
    os.unlink(tmp)


def copy_shard(primary: str, mirror: str, relpath: str, progress: Progress) -> str:
    """Copy one shard safely (see the module notes); its SHA-256."""
    src, final = os.path.join(primary, relpath), os.path.join(mirror, relpath)
    directory = os.path.dirname(final)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.path.basename(relpath)}.{os.getpid()}{TMP_SUFFIX}")
    h = hashlib.sha256()
    buf = bytearray(READ_BLOCK)
    view = memoryview(buf)
    with open(src, "rb", buffering=0) as fin:
        before = os.fstat(fin.fileno())
        out = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, before.st_mode & 0o777 | 0o200
        )
        try:
            while n := fin.readinto(buf):
                h.update(view[:n])
                written = 0
                while written < n:
                    written += os.write(out, view[written:n])
                progress.add(n)
            os.fsync(out)
        except BaseException:
            os.close(out)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(out)
        after = os.fstat(fin.fileno())
    digest = h.hexdigest()
    problem = None
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
        problem = f"{src} changed while it was copied"
    elif sha256_file(tmp, from_drive=True) != digest:
        problem = f"the copy of {relpath} read back from {mirror} differs from the primary (drive problem?)"
    if problem:
        os.unlink(tmp)
        raise StageError(f"{problem}; nothing placed")
    os.chmod(tmp, before.st_mode & 0o777)
    _place(tmp, final)
    fsync_dir(directory)
    return digest


def both_digests(primary: str, mirror: str, relpath: str, progress: Progress | None) -> tuple[str, str]:
    """SHA-256 of the primary's and the mirror's copy, the two drives read in parallel."""
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(sha256_file, os.path.join(primary, relpath), progress)
        b = pool.submit(sha256_file, os.path.join(mirror, relpath), progress, True)
        return a.result(), b.result()


def _entry(primary: str, mirror: str, relpath: str, size: int, digest: str) -> dict:
    p, m = os.stat(os.path.join(primary, relpath)), os.stat(os.path.join(mirror, relpath))
    return {
        "path": relpath,
        "size": size,
        "sha256": digest,
        "primary_mtime_ns": p.st_mtime_ns,
        "mirror_mtime_ns": m.st_mtime_ns,
    }


def _known(entry: dict | None, primary: str, mirror: str, s: Shard) -> str | None:
    """The SHA-256 an earlier receipt gives for a present shard, if both copies are unchanged."""
    p, m = os.stat(os.path.join(primary, s.relpath)), os.stat(os.path.join(mirror, s.relpath))
    if m.st_size != s.size or not receipt_vouches(entry, s.size, p.st_mtime_ns, m.st_mtime_ns):
        return None
    return entry["sha256"] if entry else None


@dataclass
class StageResult:
    copied: list[str]
    kept: list[str]


def _copy_all(
    primary: str, mirror: str, to_copy: Sequence[Shard], reserve: int, quiet: bool
) -> tuple[list[str], list[dict]]:
    """Copy each shard (while the reserve allows); the copied names and their receipt entries."""
    entries: list[dict] = []
    copied: list[str] = []
    progress = Progress(sum(s.size for s in to_copy), "copying", quiet)
    for s in to_copy:
        st = os.statvfs(mirror)
        free = st.f_bavail * st.f_frsize
        if free - s.size < reserve:
            progress.finish()
            raise StageError(
                f"stopped: {s.relpath} needs {s.size} bytes, {mirror} has {free} free and the reserve is "
                f"{reserve}; {len(copied)} of {len(to_copy)} shards copied, no receipt written"
            ).with_code(EXIT_SHORT)
        progress.working_on(s.relpath)
        digest = copy_shard(primary, mirror, s.relpath, progress)
        copied.append(s.relpath)
        entries.append(_entry(primary, mirror, s.relpath, s.size, digest))
    progress.finish()
    return copied, entries


def _check_kept(primary: str, mirror: str, kept: Sequence[Shard], old: dict, quiet: bool) -> list[dict]:
    """Receipt entries for the shards already on the mirror: the old receipt's digest when it still
    holds, else both copies hashed (and a copy with other data refused)."""
    entries = []
    unknown = [s for s in kept if _known(old.get(s.relpath), primary, mirror, s) is None]
    check = Progress(2 * sum(s.size for s in unknown), "checking shards already on the mirror", quiet)
    for s in kept:
        digest = _known(old.get(s.relpath), primary, mirror, s)
        if digest is None:
            digest, theirs = both_digests(primary, mirror, s.relpath, check)
            if theirs != digest:
                raise StageError(
                    f"{os.path.join(mirror, s.relpath)} has the primary's header but other data; not "
                    "touched and no receipt written (see colifs verify --deep)"
                ).with_code(EXIT_DIFFERS)
        entries.append(_entry(primary, mirror, s.relpath, s.size, digest))
    if unknown:
        check.finish()
    return entries


def stage(
    primary: str,
    mirror: str,
    choices: Sequence[Choice],
    reserve: int,
    quiet: bool,
    say: Callable[[str], None],
) -> StageResult:
    """Put every selected shard on the mirror; the receipt once all of them are there."""
    removed = remove_temporaries(mirror)
    if removed:
        say(f"removed {len(removed)} half-copied temporary file(s) of an earlier run")
    selected = [c.shard for c in choices if c.selected]
    old = load_receipt(mirror)
    copied, entries = _copy_all(primary, mirror, [s for s in selected if not s.present], reserve, quiet)
    kept = [s for s in selected if s.present]
    entries += _check_kept(primary, mirror, kept, old, quiet)
    write_receipt(mirror, primary, entries)
    return StageResult(copied, [s.relpath for s in kept])
