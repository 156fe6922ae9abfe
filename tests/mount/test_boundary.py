"""No request ends the daemon: every handler answers through one error boundary (an OSError is its
errno; a bug is EIO and a rate-limited log line), and the control files read whole, every time."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from colifs.boundary import BURST
from tests.failing_colifs import FAULTS_ENV
from tests.helpers import ROOT, mounted

INJECTED = [sys.executable, "-m", "tests.failing_colifs"]


def shard(primary: Path) -> str:
    return sorted(p.name for p in primary.glob("*.safetensors"))[0]


def absent(path: Path) -> bool:
    """True when `path` does not exist; any other error raises (os.path.exists hides them)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return True
    return False


def operations(mnt: Path, name: str) -> dict[str, Callable[[int], object]]:
    """Namespace method → a request that reaches it (i: a fresh name, past the kernel's caches)."""
    return {
        "lookup": lambda i: absent(mnt / f"never-looked-up-{i}"),
        "attr": lambda i: os.stat(mnt / ".colifs" / "stats"),
        "children": lambda i: os.listdir(mnt),
        "statfs": lambda i: os.statvfs(mnt),
        "snapshot": lambda i: (mnt / ".colifs" / "stats.json").read_bytes(),
        "xattr": lambda i: os.getxattr(mnt / name, "user.colifs.replicas"),
        "xattr_names": lambda i: os.listxattr(mnt / name),
    }


# The native engine answers lookup, getattr, readdir and statfs in C from its tables; only these
# reach Python there.
THROUGH_PYTHON = {"native": {"snapshot", "xattr", "xattr_names"}, "pyfuse3": set(operations(Path(), ""))}


@pytest.mark.daemon_warns(r"internal error in \w+: RuntimeError\(.injected fault")
@pytest.mark.mounts
def test_a_failing_handler_answers_eio_and_the_mount_keeps_serving(
    model, tmp_path: Path, engine: str
) -> None:
    primary, mirror, mnt = model
    faults, log = tmp_path / "faults", tmp_path / "daemon.log"
    name = shard(primary)
    want = (primary / name).read_bytes()
    env = {FAULTS_ENV: str(faults), "PYTHONPATH": str(ROOT)}
    with mounted(primary, [mirror], mnt, "--log-file", str(log), env=env, colifs=INJECTED) as m:
        ops = operations(m.path, name)
        for i, handler in enumerate(sorted(THROUGH_PYTHON[engine])):
            faults.write_text(handler)
            with pytest.raises(OSError, match="Input/output error") as e:
                ops[handler](2 * i)
            assert e.value.errno == errno.EIO, handler
            faults.write_text("")
            ops[handler](2 * i + 1)  # the same request right after: answered
            assert (m.path / name).read_bytes() == want
        faults.write_text("snapshot")
        for _ in range(3 * BURST):
            with pytest.raises(OSError):
                ops["snapshot"](0)
        faults.write_text("")
        assert m.stats()["pid"]
    text = log.read_text()
    first = sorted(THROUGH_PYTHON[engine])[0]
    assert f"RuntimeError('injected fault in Namespace.{first}'); answered EIO" in text
    assert text.count("ERROR internal error in") == BURST  # rate-limited: not one per request
    assert text.count("Traceback") == BURST  # in the log file, with each line


@pytest.mark.mounts
def test_statfs_fails_cleanly_while_the_primary_directory_is_gone(model) -> None:
    primary, mirror, mnt = model
    name = shard(primary)
    with mounted(primary, [mirror], mnt) as m:
        assert os.statvfs(m.path).f_blocks == os.statvfs(primary).f_blocks
        aside = primary.with_name("fast-aside")
        primary.rename(aside)
        try:
            with pytest.raises(OSError) as e:
                os.statvfs(m.path)
            assert e.value.errno == errno.ENOENT
        finally:
            aside.rename(primary)
        assert os.statvfs(m.path).f_blocks == os.statvfs(primary).f_blocks
        assert (m.path / name).read_bytes() == (primary / name).read_bytes()


@pytest.mark.mounts
def test_control_files_read_whole_with_every_tool_while_the_mount_is_busy(model, tmp_path: Path) -> None:
    primary, mirror, mnt = model
    stop = threading.Event()

    def load(path: Path) -> None:  # the numbers in stats.json change all the time
        while not stop.is_set():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.pread(fd, 1 << 20, 0)
            finally:
                os.close(fd)

    with mounted(primary, [mirror], mnt) as m:
        js, line = m.path / ".colifs" / "stats.json", m.path / ".colifs" / "stats"
        readers = [
            threading.Thread(target=load, args=(m.path / p.name,)) for p in primary.glob("*.safetensors")
        ]
        for t in readers:
            t.start()
        try:
            for i in range(30):
                copy = tmp_path / f"copy-{i}.json"
                shutil.copy(js, copy)
                subprocess.run(["cp", str(js), str(copy.with_suffix(".cp"))], check=True)
                for got in (
                    copy.read_bytes(),
                    copy.with_suffix(".cp").read_bytes(),
                    subprocess.run(["cat", str(js)], capture_output=True, check=True).stdout,
                    subprocess.run(["tail", "-n", "100000", str(js)], capture_output=True, check=True).stdout,
                    js.read_bytes(),
                ):
                    assert b"\0" not in got
                    json.loads(got)
                with open(js, "rb") as f:
                    size, got = os.fstat(f.fileno()).st_size, f.read()
                    assert size == len(got) and json.loads(got)["pid"]  # the snapshot's own size
                text = line.read_text()
                assert text.startswith("MIRROR:") and text.endswith("\n") and text.count("\n") == 1
        finally:
            stop.set()
            for t in readers:
                t.join()
