"""Fitting where users are: fstab / mount -t, syslog once daemonised, `colifs top` on a live mount."""

from __future__ import annotations

import os
import pty
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import COLIFS, force_unmount, is_mounted, mounted, run_colifs

HELPER = Path("/sbin/mount.fuse.colifs")


@pytest.mark.mounts
def test_a_mountpoint_with_a_space_mounts_and_unmounts(model) -> None:
    """/proc/self/mounts writes the space as \\040: both the mount's checks and `colifs umount`
    must still find the mount."""
    primary, mirror, mnt = model
    spaced = mnt.parent / "my model"
    with mounted(primary, [mirror], spaced, "--weights", "1,1") as m:
        assert (m.path / ".colifs" / "stats").read_text().startswith("MIRROR: ")
        again = run_colifs("mount", str(primary), str(spaced))
        assert again.returncode == 32 and "already a mount point" in again.stderr
    assert not is_mounted(spaced)


@contextmanager
def helper_installed() -> Iterator[None]:
    """mount(8) looks for /sbin/mount.fuse.colifs: linked to this checkout's script for the test."""
    script = Path(sys.executable).with_name("mount.fuse.colifs")
    if not script.exists():
        pytest.skip(f"{script} is not installed (pip install -e . creates it)")
    if HELPER.exists() or HELPER.is_symlink():
        if not (HELPER.is_symlink() and Path(os.readlink(HELPER)) == script):
            pytest.skip(f"{HELPER} exists and is not ours")
        yield
        return
    HELPER.symlink_to(script)
    try:
        yield
    finally:
        HELPER.unlink()


@pytest.mark.mounts
def test_mount_t_and_an_fstab_line(model, tmp_path: Path) -> None:
    primary, mirror, mnt = model
    if not shutil.which("mount"):
        pytest.skip("no mount(8)")
    with helper_installed():
        try:
            out = subprocess.run(
                ["mount", "-t", "fuse.colifs", f"{primary}:{mirror}", str(mnt), "-o", "ro,weights=3:1"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            st = run_colifs("stats", str(mnt), "--json")
            assert '"weight_share": 0.75' in st.stdout
            shard = sorted(primary.glob("*.safetensors"))[0]
            assert (mnt / shard.name).read_bytes() == shard.read_bytes()
            assert run_colifs("umount", str(mnt)).returncode == 0 and not is_mounted(mnt)
            fstab = tmp_path / "fstab"
            fstab.write_text(
                f"# test\n{primary}:{mirror} {mnt} fuse.colifs ro,weights=1:1,nofail,noauto 0 0\n"
            )
            out = subprocess.run(
                ["mount", "-T", str(fstab), str(mnt)], capture_output=True, text=True, timeout=60
            )
            assert out.returncode == 0, out.stderr
            assert '"weight_share": 0.5' in run_colifs("stats", str(mnt), "--json").stdout
            fstab.write_text(f"{primary}:{mirror} {mnt} fuse.colifs ro,weight=1:1 0 0\n")
            assert run_colifs("umount", str(mnt)).returncode == 0
            out = subprocess.run(
                ["mount", "-T", str(fstab), str(mnt)], capture_output=True, text=True, timeout=60
            )
            assert out.returncode != 0 and "unknown option 'weight=1:1'" in out.stderr
            assert not is_mounted(mnt)
        finally:
            if is_mounted(mnt):
                run_colifs("umount", str(mnt))
            force_unmount(mnt)


@pytest.mark.mounts
def test_the_daemon_logs_to_syslog_once_its_stderr_is_gone(model, tmp_path: Path) -> None:
    primary, mirror, mnt = model
    address = str(tmp_path / "log.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    try:
        log_file = tmp_path / "colifs.log"
        args = ("--weights", "1,1", "--log-file", str(log_file))
        with mounted(primary, [mirror], mnt, *args, env={"COLIFS_SYSLOG_SOCKET": address}) as m:
            pid = m.stats()["pid"]
        got = []
        while select.select([sock], [], [], 0.5)[0]:
            got.append(sock.recv(65536).decode())
        assert any(f"colifs[{pid}]: {mnt} was unmounted" in g for g in got), got
        assert f"{mnt} was unmounted" in log_file.read_text()  # and in --log-file, stamped
    finally:
        sock.close()


def read_until(fd: int, want: bytes, within: float = 30.0) -> bytes:
    """What `fd` gave until `want` was in it (a command's first frame, however slow it starts)."""
    got, deadline = b"", time.monotonic() + within
    while want not in got:
        assert time.monotonic() < deadline, got
        if select.select([fd], [], [], 0.1)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, got  # it ended before drawing
            got += chunk
    return got


@pytest.mark.mounts
def test_top_on_a_live_mount_and_q_quits(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        stop = threading.Event()

        def reader() -> None:
            files = sorted(primary.glob("*.safetensors"))
            while not stop.is_set():
                for p in files:
                    (m.path / p.name).read_bytes()
                    with open("/proc/sys/vm/drop_caches", "w") as f:
                        f.write("1\n")

        t = threading.Thread(target=reader)
        t.start()
        try:
            out = run_colifs("top", str(m.path), "--count", "5", "--interval", "0.3")
        finally:
            stop.set()
            t.join()
        assert out.returncode == 0, out.stderr
        frames = out.stdout.strip().split("\n\n")
        assert len(frames) == 5 and all(f.startswith(f"colifs top {m.path}") for f in frames)
        mirror_now = [float(f.splitlines()[3].split()[2]) for f in frames]
        assert max(mirror_now) > 0  # the mirror's MB/s while the reader ran
        # on a terminal it redraws until q
        master, slave = pty.openpty()
        proc = subprocess.Popen([*COLIFS, "top", str(m.path)], stdin=slave, stdout=slave, stderr=slave)
        os.close(slave)
        try:
            seen = read_until(master, b"hottest layers")  # a frame drawn: the terminal is in cbreak
            os.write(master, b"q")
            assert proc.wait(timeout=5) == 0
        finally:
            proc.kill()
            os.close(master)
        assert b"\x1b[H\x1b[2J" in seen
        ctrl_c = subprocess.Popen(  # started as a shell's background job is: SIGINT ignored
            [*COLIFS, "top", str(m.path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
        assert ctrl_c.stdout is not None
        try:
            first = read_until(ctrl_c.stdout.fileno(), b"hottest layers")  # past start-up: Ctrl-C is taken
            ctrl_c.send_signal(signal.SIGINT)
            out_, err_ = ctrl_c.communicate(timeout=5)
        finally:
            ctrl_c.kill()
        assert ctrl_c.returncode == 0 and err_ == b"", (first, out_, err_)  # no traceback
    bad = run_colifs("top", str(primary))
    assert bad.returncode == 3 and bad.stderr.count("\n") == 1
