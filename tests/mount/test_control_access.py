"""Who may steer a mount (issue 40): the control socket is a file in a directory only the daemon's
user controls, and the daemon answers only a client of its own user in its own mount and user
namespaces. Root in another mount namespace that shares the host's network (`unshare -m`, as a
container with `--network=host` and no user namespace) reached the old abstract socket; now it is
refused. A directory planted by another user is used by neither the daemon nor the client, and a
squatter on the old abstract name blocks nothing."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import COLIFS, force_unmount, is_mounted, mounted, run_colifs
from tests.mount.test_security import NOBODY, fuse_open_to_all, model_in, nobody_python

RUN_DIR = "/run/colifs"  # root daemons' sockets (colifs.control.RUN_DIR)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
    reason="needs root, unshare and setpriv",
)


def one_line(out: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The one error line of a refused command (its exit code `code`, no traceback)."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code and len(lines) == 1, out
    assert lines[0].startswith("colifs: error: ") and all(w in lines[0] for w in words), lines[0]
    return lines[0]


def in_another_mount_namespace(*args: str) -> subprocess.CompletedProcess:
    """`colifs ARGS` run as root in a mount namespace of its own (the host's network, uids, pids)."""
    return subprocess.run(["unshare", "--mount", *COLIFS, *args], capture_output=True, text=True, timeout=60)


def test_root_in_another_mount_namespace_is_refused(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        for command, state in (("remove", "up"), ("add", "removed")):
            out = in_another_mount_namespace("mirror", command, str(mnt), str(mirror))
            one_line(out, 7, "not allowed", "another mount namespace")
            assert m.stats()["replicas"][1]["health"]["state"] == state  # nothing changed
            if command == "remove":  # the host's root may: then the add is the one to refuse
                assert run_colifs("mirror", "remove", str(mnt), str(mirror)).returncode == 0
        assert run_colifs("mirror", "add", str(mnt), str(mirror)).returncode == 0
        plan = ("plan", str(primary), str(mirror), "--budget", "1G", "--weights", "1,1")
        out = in_another_mount_namespace(*plan)
        assert out.returncode == 0 and f"served by: {mnt}" not in out.stdout, out
        assert f"colifs: {mnt}: its daemon does not answer; not checked" in out.stderr
        out = run_colifs(*plan)
        assert out.returncode == 0 and f"served by: {mnt}" in out.stdout, out
        st = m.stats()
        sock = Path(st["control_socket"])
        assert sock == Path(RUN_DIR) / f"{st['pid']}.sock" and st["uid"] == 0
        assert stat.S_IMODE(sock.parent.lstat().st_mode) == 0o700 and sock.parent.lstat().st_uid == 0
    assert not sock.exists()  # the daemon removed its socket at exit


def test_a_squatter_on_the_old_abstract_name_blocks_nothing(model) -> None:
    """Any user could bind `colifs-control-PID` before the daemon did (its pid shows first): the
    mount then took no commands. The daemon is stopped at its start while the name is taken."""
    primary, mirror, mnt = model
    log = mnt.parent / "squatted.daemon.log"
    cmd = [
        *COLIFS,
        "mount",
        "-f",
        str(primary),
        str(mirror),
        str(mnt),
        "--weights",
        "1,1",
        "--log-file",
        str(log),
    ]
    daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.kill(daemon.pid, signal.SIGSTOP)
        squatter.bind(f"\0colifs-control-{daemon.pid}")
        squatter.listen(1)
        os.kill(daemon.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not (is_mounted(mnt) and (mnt / ".colifs" / "stats.json").exists()):
            assert daemon.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        out = run_colifs("mirror", "remove", str(mnt), str(mirror))
        assert out.returncode == 0 and out.stdout.startswith(f"mirror {mirror} removed"), out
        out = run_colifs("mirror", "add", str(mnt), str(mirror))
        assert out.returncode == 0 and out.stdout.startswith(f"mirror {mirror} added"), out
        assert "control socket" not in log.read_text()  # no warning: it listens where it should
    finally:
        squatter.close()
        os.kill(daemon.pid, signal.SIGCONT)
        run_colifs("umount", str(mnt))
        force_unmount(mnt)
        daemon.wait(30)


PLANTED = """
set -u
mount -t tmpfs -o mode=0755 colifs-test-run /run
{plant}
{colifs} mount {primary} {mirror} {mnt} --weights 1,1 --log-file {log}
echo "mount=$?"
trap '{colifs} umount {mnt}; fusermount3 -u -z {mnt} 2>/dev/null' EXIT
{colifs} mirror remove {mnt} {mirror}
echo "remove=$?"
ls -la /run/colifs/ /run/colifs 2>&1 | sed 's/^/ls: /'
"""


@pytest.mark.parametrize(
    ("plant", "why"),
    [
        ("mkdir -m 0700 /run/colifs && chown 65534 /run/colifs", "/run/colifs is owned by uid 65534"),
        ("mkdir -m 0700 /tmp/{name} && chown 65534 /tmp/{name} && ln -s /tmp/{name} /run/colifs",
         "/run/colifs is a symlink"),
        ("mkdir -m 0777 /run/colifs", "/run/colifs has mode 0777, not 0700"),
    ],
    ids=["owned-by-another-user", "a-symlink", "world-writable"],
)  # fmt: skip
def test_a_socket_directory_planted_by_another_user_is_not_used(model, plant: str, why: str) -> None:
    """Run in a mount namespace of its own with a fresh /run, where the directory is planted
    before the daemon starts: the daemon takes no commands there (one warning says why) and the
    client trusts nothing in it (one line, exit 7); the mount serves on."""
    primary, mirror, mnt = model
    log = mnt.parent / "planted.daemon.log"
    name = f"colifs-planted-{os.getpid()}"
    script = PLANTED.format(
        plant=plant.format(name=name),
        colifs=" ".join(COLIFS),
        primary=primary,
        mirror=mirror,
        mnt=mnt,
        log=log,
    )
    try:
        out = subprocess.run(["unshare", "--mount", "sh", "-c", textwrap.dedent(script)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        shutil.rmtree(f"/tmp/{name}", ignore_errors=True)
    said = out.stdout.splitlines()
    assert "mount=0" in said and "remove=7" in said, out
    assert f"WARNING control socket: none ({why}" in log.read_text()  # in the daemon's words
    refused = [line for line in out.stderr.splitlines() if line.startswith("colifs: error: ")]
    assert len(refused) == 1 and why in refused[0] and "not trusted" in refused[0], out.stderr
    assert "nothing asked of it" in refused[0]
    assert not any(line.endswith(".sock") for line in said), said  # nothing put there
    assert not is_mounted(mnt)


def test_a_daemon_of_another_user_answers_that_user_and_not_root(open_dir: Path) -> None:
    """A daemon run as `nobody`, its socket in its own runtime directory: `nobody` steers it; root
    is told to run as that user (a root client trusts no socket in a directory another user
    controls), and the daemon itself refuses root when asked anyway."""
    primary, mirror = model_in(open_dir)
    runtime = open_dir / "runtime"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, 65534, 65534)
    mnt = open_dir / "mnt"
    mnt.mkdir()
    os.chown(mnt, 65534, 65534)
    colifs = [*NOBODY, "env", f"XDG_RUNTIME_DIR={runtime}", *nobody_python()[1:]]

    def as_nobody(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*colifs, *args], capture_output=True, text=True, timeout=60)

    with fuse_open_to_all():
        out = as_nobody("mount", str(primary), str(mirror), str(mnt), "--weights", "1,1")
        try:
            assert out.returncode == 0, out.stderr
            out = as_nobody("mirror", "remove", str(mnt), str(mirror))
            assert out.returncode == 0 and "removed" in out.stdout, out.stderr
            out = run_colifs("mirror", "add", str(mnt), str(mirror))  # root
            one_line(out, 7, "runs as uid 65534 and takes commands from that user only", "nothing asked")
            st = json.loads(as_nobody_read(mnt / ".colifs" / "stats.json"))
            sock = runtime / "colifs" / f"{st['pid']}.sock"
            assert st["uid"] == 65534 and st["control_socket"] == str(sock)
            assert (sock.parent.lstat().st_uid, stat.S_IMODE(sock.parent.lstat().st_mode)) == (65534, 0o700)
            answer = raw_ask(sock, {"command": "mirror-add", "path": str(mirror), "wait": 5})
            assert answer["exit"] == 7 and "takes commands from uid 65534" in answer["error"]
            assert "not root" in answer["error"]
            out = as_nobody("mirror", "add", str(mnt), str(mirror))
            assert out.returncode == 0 and "added" in out.stdout, out.stderr
            out = run_colifs("plan", str(primary), str(mirror), "--budget", "1G", "--weights", "1,1")
            assert f"colifs: {mnt}: mounted by uid 65534; not checked" in out.stderr, out.stderr
        finally:
            done = as_nobody("umount", str(mnt))
            force_unmount(mnt)
        assert done.returncode == 0, done.stderr
        assert not sock.exists()


def as_nobody_read(path: Path) -> str:
    return subprocess.run([*NOBODY, "cat", str(path)], capture_output=True, text=True, check=True).stdout


def raw_ask(path: Path, request: dict) -> dict:
    """A request sent on a socket file as it is, without the client's checks (root may connect)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused before it was read
            s.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            try:
                chunk = s.recv(4096)
            except ConnectionResetError:  # closed with the request unread: the answer came first
                chunk = b""
            assert chunk, data
            data += chunk
    return json.loads(data)
