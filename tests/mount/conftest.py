"""Real mounts: every test here needs /dev/fuse (and fusermount3), and is skipped with the reason
where they are missing (a container without FUSE, a sandbox)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import force_unmount


@pytest.fixture(autouse=True)
def needs_fuse() -> None:
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing: no real mounts here")
    if not shutil.which("fusermount3"):
        pytest.skip("fusermount3 is missing (apt-get install fuse3)")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other users can reach (pytest's tmp_path is under a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="colifs-open-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        force_unmount(d / "mnt")
        shutil.rmtree(d, ignore_errors=True)
