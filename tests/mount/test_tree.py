"""The tree a mount shows: modes, times, symlinks, stable inodes; every write path is EROFS."""

from __future__ import annotations

import errno
import os

import pytest

from tests.helpers import (
    mounted,
    shards,
)

pytestmark = pytest.mark.mounts  # every test here runs on both engines


def test_tree_modes_times_symlinks_and_stable_inodes(model) -> None:
    primary, mirror, mnt = model
    (primary / "sub" / "deeper").mkdir(parents=True)
    (primary / "sub" / "deeper" / "tokenizer.json").write_text("{}")
    os.chmod(primary / "config.json", 0o664)
    first = shards(primary)[0]
    (primary / "latest.safetensors").symlink_to(first.name)
    inodes = []
    for _ in range(2):
        with mounted(primary, [mirror], mnt):
            # colifs' own usage file (written at the first unmount) is not shown
            listed = [n for n in os.listdir(primary) if n != ".colifs-usage.json"]
            assert sorted(os.listdir(mnt)) == sorted([*listed, ".colifs"])
            for p in [p for p in primary.rglob("*") if p.name != ".colifs-usage.json"]:
                via = mnt / p.relative_to(primary)
                a, b = p.lstat(), via.lstat()
                assert b.st_mode == a.st_mode & ~0o222
                assert (b.st_size, b.st_mtime_ns) == (a.st_size, a.st_mtime_ns)
                assert b.st_ino != a.st_ino
            link = mnt / "latest.safetensors"
            assert link.is_symlink() and os.readlink(link) == first.name
            assert link.read_bytes() == first.read_bytes()
            seen = [p for p in primary.rglob("*") if p.name != ".colifs-usage.json"]
            inodes.append({p.name: (mnt / p.relative_to(primary)).lstat().st_ino for p in seen})
    assert inodes[0] == inodes[1]


def test_every_write_path_is_erofs(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt):
        f = mnt / shards(primary)[0].name
        attempts = [
            lambda: os.open(f, os.O_RDWR),
            lambda: os.open(f, os.O_WRONLY | os.O_TRUNC),
            lambda: os.open(mnt / "new", os.O_WRONLY | os.O_CREAT),
            lambda: os.mkdir(mnt / "d"),
            lambda: os.unlink(f),
            lambda: os.rmdir(mnt / ".colifs"),
            lambda: os.rename(f, mnt / "x"),
            lambda: os.chmod(f, 0o777),
            lambda: os.truncate(f, 0),
            lambda: os.utime(f),
            lambda: os.setxattr(f, "user.x", b"1"),
            lambda: os.symlink("a", mnt / "l"),
            lambda: os.link(f, mnt / "h"),
            lambda: os.open(mnt / ".colifs" / "stats", os.O_WRONLY),
        ]
        for attempt in attempts:
            with pytest.raises(OSError) as e:
                attempt()
            assert e.value.errno == errno.EROFS, attempt


def test_times_before_1970_are_shown_as_they_are(model) -> None:
    """A file's mtime of 1.5 s before the epoch: a timespec's nanoseconds are never negative."""
    primary, mirror, mnt = model
    config = primary / "config.json"
    for ns in (-1_500_000_000, -86_400_000_000_001):
        os.utime(config, ns=(ns, ns))
        with mounted(primary, [mirror], mnt):
            assert (mnt / "config.json").stat().st_mtime_ns == ns
