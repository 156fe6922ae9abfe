"""Shared fixtures: synthetic checkpoints on a primary and a mirror, and real FUSE mounts.

Mounts run `python -m colifs mount` (the daemon, in its own process) and are always unmounted,
even when a test fails. Every mirror is snapshotted (content hash + mtime of each file) and
checked unchanged at teardown: colifs never writes to a mirror.

Tests marked `mounts` run once per engine (native, pyfuse3): the engine reaches every daemon they
start through COLIFS_ENGINE. They are skipped, with the reason, where /dev/fuse is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from colifs.cli import ENGINE_ENV
from colifs.kernel import mount_type
from colifs.synth import write_checkpoint

COLIFS = [sys.executable, "-m", "colifs"]
ENGINES = ("native", "pyfuse3")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mounts: mounts for real; runs once per engine")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine" in metafunc.fixturenames and metafunc.definition.get_closest_marker("mounts"):
        metafunc.parametrize("engine", ENGINES, indirect=True)


@pytest.fixture(autouse=True)
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The engine of a `mounts` test (None elsewhere): the default of every `colifs mount` it runs."""
    name = getattr(request, "param", None)
    if name is not None:
        if not os.path.exists("/dev/fuse"):
            pytest.skip("/dev/fuse is missing: no real mounts here")
        monkeypatch.setenv(ENGINE_ENV, name)
    return name


def run_colifs(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60, colifs: list[str] = COLIFS
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*colifs, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def is_mounted(path: Path) -> bool:
    return mount_type(str(path)) is not None


def force_unmount(path: Path) -> None:
    if is_mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Content hash and mtime of every file under root."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


@dataclass
class Mount:
    path: Path
    primary: Path
    mirrors: list[Path]
    stderr: str

    def stats(self) -> dict:
        return json.loads((self.path / ".colifs" / "stats.json").read_text())


@contextmanager
def mounted(
    primary: Path, mirrors: list[Path], mnt: Path, *extra: str, env=None, colifs: list[str] = COLIFS
) -> Iterator[Mount]:
    """Mount with the real CLI (or `colifs`, a command that runs it); unmount (and check every
    mirror unchanged) whatever happens."""
    before = {m: snapshot(m) for m in mirrors}
    mnt.mkdir(exist_ok=True)
    done = run_colifs("mount", str(primary), *map(str, mirrors), str(mnt), *extra, env=env, colifs=colifs)
    try:
        assert done.returncode == 0, done.stderr
        assert is_mounted(mnt)
        yield Mount(mnt, primary, mirrors, done.stderr)
    finally:
        if is_mounted(mnt):
            out = run_colifs("umount", str(mnt))
            force_unmount(mnt)
            assert out.returncode == 0, out.stderr
        for m in mirrors:
            assert snapshot(m) == before[m], f"mirror {m} changed"


@pytest.fixture
def model(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(primary, mirror, mountpoint) with a DeepSeek-style checkpoint copied to the mirror."""
    primary, mirror, mnt = tmp_path / "fast", tmp_path / "second", tmp_path / "mnt"
    write_checkpoint(str(primary), "deepseek", layers=3, experts=16, hidden=128, inter=64, shards=3)
    shutil.copytree(primary, mirror)
    mnt.mkdir()
    yield primary, mirror, mnt
    force_unmount(mnt)


def drop_file_cache(path: Path) -> None:
    """Evict a file from the page cache (so the next read through a mount reaches the daemon)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
