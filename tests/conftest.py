"""Shared fixtures: synthetic checkpoints on a primary and a mirror, and real FUSE mounts.

Mounts run `python -m colifs mount` (the daemon, in its own process) and are always unmounted,
even when a test fails. Every mirror is snapshotted (content hash + mtime of each file) and
checked unchanged at teardown: colifs never writes to a mirror.

Every daemon a test mounts (tests.helpers.mounted) logs to a file; a warning or error in it fails
the test unless the test declares it with `@pytest.mark.daemon_warns(pattern, ...)` (as s3ql and
pyfuse3 fail tests on unexpected log messages): a new warning is a behaviour change to look at.

Tests marked `mounts` run once per engine (native, pyfuse3): the engine reaches every daemon they
start through COLIFS_ENGINE. Every test in tests/mount is skipped, with the reason, where /dev/fuse
is missing (tests/mount/conftest.py).

The layers: tests/unit (pure logic, property tests), tests/ops (a mount's object graph from
`colifs.assemble`, driven with `await ops.read(...)` over a fault-injecting I/O layer, no mount),
tests/cli (commands that need no mount, run as a user runs them), tests/mount (real mounts).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from colifs.config import ENGINE_ENV, ENGINES
from colifs.synth import write_checkpoint
from tests.helpers import daemon_logs, force_unmount


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mounts: mounts for real; runs once per engine")
    config.addinivalue_line(
        "markers", "daemon_warns(*patterns): warnings the test's daemons may log (regular expressions)"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine" in metafunc.fixturenames and metafunc.definition.get_closest_marker("mounts"):
        metafunc.parametrize("engine", ENGINES, indirect=True)


@pytest.fixture(autouse=True)
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The engine of a `mounts` test (None elsewhere): the default of every `colifs mount` it runs."""
    name = getattr(request, "param", None)
    if name is not None:
        monkeypatch.setenv(ENGINE_ENV, name)
    return name


@pytest.fixture
def model(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(primary, mirror, mountpoint) with a DeepSeek-style checkpoint copied to the mirror."""
    primary, mirror, mnt = tmp_path / "fast", tmp_path / "second", tmp_path / "mnt"
    write_checkpoint(str(primary), "deepseek", layers=3, experts=16, hidden=128, inter=64, shards=3)
    shutil.copytree(primary, mirror)
    mnt.mkdir()
    yield primary, mirror, mnt
    force_unmount(mnt)


ONE_DRIVE = r"are on one drive: reading them all adds no bandwidth"


@pytest.fixture(autouse=True)
def no_unexpected_daemon_warnings(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test when a daemon it mounted logged a warning or error it did not declare."""
    logs = daemon_logs()
    logs.clear()
    yield
    marker = request.node.get_closest_marker("daemon_warns")
    # The suite's copies are directories on one disk: a mount that probes says so (tested apart).
    allowed = [re.compile(p) for p in (*(marker.args if marker else ()), ONE_DRIVE)]
    unexpected = []
    for path in filter(os.path.exists, logs):  # none when the mount failed (the test says so)
        with open(path, errors="replace") as f:
            for line in f:
                if (" WARNING " in line or " ERROR " in line) and not any(p.search(line) for p in allowed):
                    unexpected.append(line.rstrip())
    logs.clear()
    assert not unexpected, "unexpected daemon warnings:\n" + "\n".join(unexpected[:20])
