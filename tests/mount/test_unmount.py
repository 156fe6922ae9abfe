"""Never pulled from under a running process: a busy mount is not unmounted (colifs umount, a stop
signal, umount(8)) unless --lazy is asked for, and then its users keep their files."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import (
    COLIFS,
    force_unmount,
    is_mounted,
    mounted,
    refuse,
    run_colifs,
)

pytestmark = pytest.mark.mounts

# Maps a file, closes it (only the mapping holds the mount), says "ready", then on each line of
# stdin touches every page of the mapping and prints a checksum of it; exits at end of input.
HOLDER = """
import hashlib, mmap, sys
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("ready", flush=True)
for _ in sys.stdin:
    print(hashlib.sha256(m[:]).hexdigest(), flush=True)
"""


@contextmanager
def holder(path: Path) -> Iterator[subprocess.Popen]:
    """A process that holds `path` mapped (as a loaded model does) until its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        finally:
            proc.kill()


def checksum(proc: subprocess.Popen) -> str:
    """The holder reads its whole mapping now (SIGBUS would kill it: then this fails)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("read\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def shard(primary: Path) -> str:
    return sorted(p.name for p in primary.glob("*.safetensors"))[0]


def wait_gone(pid: int, seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, f"daemon {pid} still running"
        time.sleep(0.05)


def test_umount_is_refused_while_a_process_maps_a_file(model) -> None:
    primary, mirror, mnt = model
    name = shard(primary)
    with mounted(primary, [mirror], mnt) as m, holder(mnt / name) as proc:
        out = run_colifs("umount", str(mnt))
        assert out.returncode == 6, out
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"colifs: error: {mnt} is busy: "), out.stderr
        assert f"pid {proc.pid} (python" in lines[0] and f"maps {name}" in lines[0] and "--lazy" in lines[0]
        assert is_mounted(mnt)
        assert checksum(proc) == sha(primary / name)  # still served, through the mapping
        assert (m.path / "config.json").read_bytes() == (primary / "config.json").read_bytes()
    # the holder has exited: the same command now unmounts (mounted()'s teardown checks it)


def test_lazy_umount_detaches_and_serves_the_mapped_file_until_it_is_let_go(model) -> None:
    primary, mirror, mnt = model
    name = shard(primary)
    with mounted(primary, [mirror], mnt) as m:
        pid = m.stats()["pid"]
        with holder(mnt / name) as proc:
            out = run_colifs("umount", "--lazy", str(mnt))
            assert out.returncode == 0, out
            assert f"detached {mnt}; daemon {pid} serves" in out.stderr and f"pid {proc.pid}" in out.stderr
            assert not is_mounted(mnt) and os.listdir(mnt) == []
            # Every page is read after the detach (none was touched before): the daemon serves it.
            assert checksum(proc) == sha(primary / name)
            assert Path(f"/proc/{pid}").exists()
        wait_gone(pid)  # the last user let go: the kernel ended the session, the daemon exited


@pytest.mark.daemon_warns(r"is busy: pid \d+")
def test_a_stop_signal_while_busy_keeps_serving_and_unmounts_once_unused(model, tmp_path: Path) -> None:
    primary, mirror, mnt = model
    name = shard(primary)
    log = tmp_path / "daemon.log"
    with mounted(primary, [mirror], mnt, "--log-file", str(log)) as m:
        pid = m.stats()["pid"]
        with holder(mnt / name) as proc:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while "is busy" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            os.kill(pid, signal.SIGINT)  # a second signal is no more fatal than the first
            time.sleep(0.6)  # more than one retry
            assert is_mounted(mnt)
            assert checksum(proc) == sha(primary / name)
            warning = [x for x in log.read_text().splitlines() if "is busy" in x]
            assert len(warning) == 1 and f"pid {proc.pid} (python" in warning[0], warning
        wait_gone(pid)
        assert not is_mounted(mnt)


@pytest.mark.skipif(os.geteuid() != 0, reason="umount(8) of a FUSE mount needs root")
def test_umount8_refuses_a_busy_mount_and_unmounts_an_idle_one(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt) as m:
        pid = m.stats()["pid"]
        with holder(mnt / shard(primary)) as proc:
            out = subprocess.run(["umount", str(mnt)], capture_output=True, text=True)
            assert out.returncode != 0 and "busy" in out.stderr, out
            assert checksum(proc) == sha(primary / shard(primary))
        out = subprocess.run(["umount", str(mnt)], capture_output=True, text=True)
        assert out.returncode == 0, out
        wait_gone(pid)  # the daemon saw the kernel end the session and exited
        assert not is_mounted(mnt)


def test_umount_returns_once_the_daemon_is_gone(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt) as m:
        pid = m.stats()["pid"]
        out = run_colifs("umount", str(mnt))
        assert out.returncode == 0, out.stderr
        assert not is_mounted(mnt)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("when", ["mounted, not yet serving", "serving"])
def test_signal_to_a_foreground_mount_unmounts_cleanly(model, sig, when) -> None:
    primary, mirror, mnt = model
    proc = subprocess.Popen(
        [*COLIFS, "mount", "-f", "--no-probe", str(primary), str(mirror), str(mnt)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (is_mounted(mnt) if when.startswith("mounted") else (mnt / ".colifs").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.001)
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0, proc.stderr.read()
        assert not is_mounted(mnt)
    finally:
        proc.kill()
        force_unmount(mnt)


def test_umount_clears_a_stale_mount_whose_daemon_was_killed(model) -> None:
    primary, mirror, mnt = model
    out = run_colifs("mount", str(primary), str(mirror), str(mnt))
    assert out.returncode == 0, out.stderr
    try:
        pid = json.loads((mnt / ".colifs" / "stats.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(OSError) as e:
            os.listdir(mnt)
        assert e.value.errno == errno.ENOTCONN
        refuse(["mount", str(primary), str(mirror), str(mnt)], 32, "stale mount")
        out = run_colifs("umount", str(mnt))
        assert out.returncode == 0, out.stderr
        assert not is_mounted(mnt) and os.listdir(mnt) == []
    finally:
        force_unmount(mnt)
