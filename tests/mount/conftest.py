"""Real mounts: every test here needs /dev/fuse (and fusermount3), and is skipped with the reason
where they are missing (a container without FUSE, a sandbox)."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture(autouse=True)
def needs_fuse() -> None:
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing: no real mounts here")
    if not shutil.which("fusermount3"):
        pytest.skip("fusermount3 is missing (apt-get install fuse3)")
