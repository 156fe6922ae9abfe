"""The control socket (colifs.control): one JSON request, one answer; refusals keep their exit
code; a daemon without a socket is said, not waited for; the socket's directory must be one only
the daemon's user controls (issue 40), and a peer that cannot be checked is refused."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
import trio

from colifs import control
from colifs.control import (
    Control,
    NoAnswer,
    NotAsked,
    Untrusted,
    ask,
    ask_everyone,
    listen,
    open_dir,
    refusal,
)
from colifs.errors import QuietError, UsageError

OURS = os.getpid()  # the socket is served by this process, as a daemon serves its own
ME = os.geteuid()
NOBODY = 999_999_001  # above pid_max: no process has it
NOBODY_UID = 65534

root_only = pytest.mark.skipif(ME != 0, reason="needs root (chown to another user, /run/colifs)")


def serving(handlers: dict, pid: int = OURS) -> tuple[threading.Thread, tuple]:
    """A control socket served on a thread of its own (as in the daemon's trio loop), where this
    user's daemons put theirs."""
    ready = threading.Event()
    cancel: list = []
    where: list = []

    async def main() -> None:
        async with trio.open_nursery() as n:
            cancel.append((n.cancel_scope, trio.lowlevel.current_trio_token()))
            n.start_soon(Control(handlers, pid, listening=where.append).serve)
            while not where:
                await trio.sleep(0.01)
            ready.set()

    t = threading.Thread(target=trio.run, args=(main,))
    t.start()
    assert ready.wait(10)
    if where[0] is None:
        cancel[0][1].run_sync_soon(cancel[0][0].cancel)
        t.join(10)
        pytest.skip(f"no directory for this user's control sockets ({control.socket_dirs(ME, os.environ)})")
    return t, cancel[0]


def stop(t: threading.Thread, scope_token: tuple) -> None:
    scope, token = scope_token
    token.run_sync_soon(scope.cancel)
    t.join(10)


def test_a_request_is_answered_and_a_refusal_keeps_its_exit_code() -> None:
    seen = []

    async def echo(request: dict) -> dict:
        seen.append(request)
        return {"done": request["path"]}

    async def refuse(request: dict) -> dict:
        raise UsageError(f"{request['path']} is the primary")

    async def crash(request: dict) -> dict:
        raise RuntimeError("bug")

    t, scope = serving({"echo": echo, "refuse": refuse, "crash": crash})
    try:
        assert ask(OURS, ME, {"command": "echo", "path": "/m"}, 5) == {"done": "/m"}
        assert seen == [{"command": "echo", "path": "/m"}]
        with pytest.raises(QuietError, match="/m is the primary") as e:
            ask(OURS, ME, {"command": "refuse", "path": "/m"}, 5)
        assert e.value.exit_code == 2
        with pytest.raises(QuietError, match="RuntimeError: bug") as e:
            ask(OURS, ME, {"command": "crash"}, 5)
        assert e.value.exit_code == 1
        with pytest.raises(QuietError, match="unknown command 'nope'"):
            ask(OURS, ME, {"command": "nope"}, 5)
        assert ask(OURS, ME, {"command": "echo", "path": "/again"}, 5) == {"done": "/again"}  # serves on
        path = Path(control.socket_dirs(ME, os.environ)[0]) / f"{OURS}.sock"
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert stat.S_IMODE(path.parent.lstat().st_mode) == 0o700 and path.parent.lstat().st_uid == ME
    finally:
        stop(t, scope)
    assert not path.exists()  # removed at exit


def test_a_daemon_without_a_control_socket_is_said_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(NotAsked, match=f"no control socket of daemon {NOBODY}"):
        ask(NOBODY, ME, {"command": "echo"}, 5)
    assert time.monotonic() - t0 < 1


def test_a_socket_held_by_another_process_than_the_daemon_is_not_asked() -> None:
    async def echo(request: dict) -> dict:
        return {}

    t, scope = serving({"echo": echo}, pid=NOBODY)  # this process poses as daemon NOBODY
    try:
        with pytest.raises(NotAsked, match=f"held by process {OURS}"):
            ask(NOBODY, ME, {"command": "echo"}, 5)
    finally:
        stop(t, scope)


def test_another_users_daemon_is_not_asked_at_all() -> None:
    other = NOBODY_UID if ME == 0 else 0
    with pytest.raises(
        NotAsked, match=f"daemon 4242 runs as (uid {other}|root) and takes commands from that user"
    ):
        ask(4242, other, {"command": "echo"}, 5)


def test_a_daemon_that_does_not_answer_costs_its_bound_and_no_more() -> None:
    """A socket that accepts and never answers (a stopped daemon): `ask` and `ask_everyone` give up
    at their bound."""
    d = control.socket_dirs(ME, os.environ)[0]
    try:
        bound = listen(OURS, [d])  # listening, never accepting: this process is that daemon
    except Untrusted:
        pytest.skip(f"no directory for this user's control sockets ({d})")
    try:
        t0 = time.monotonic()
        with pytest.raises(NoAnswer, match="no answer in time"):
            ask(OURS, ME, {"command": "status"}, 0.5)
        assert 0.4 < time.monotonic() - t0 < 1.5
        t0 = time.monotonic()
        answers, _ = ask_everyone({"command": "status"}, 0.5)
        assert time.monotonic() - t0 < 1.5
        assert "no answer" in str(answers[OURS])
    finally:
        bound.close()


# -- where the socket may be ------------------------------------------------------------------------


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A directory on a trusted path (pytest's, under /tmp: sticky) where tests plant things."""
    tmp_path.chmod(0o755)
    return tmp_path


@root_only
def test_a_directory_planted_by_another_user_is_refused(base: Path) -> None:
    planted = base / "colifs"
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY_UID, NOBODY_UID)
    for create in (False, True):  # neither the client nor the daemon takes it
        with pytest.raises(Untrusted, match=f"{planted} is owned by uid {NOBODY_UID}, not root"):
            open_dir(str(planted), 0, create=create)
    with pytest.raises(Untrusted, match="owned by uid 65534"):
        listen(4242, [str(planted)])
    assert os.listdir(planted) == []
    # ... and nor is anything under a directory another user controls, whatever its own owner
    inner = planted / "inner"
    inner.mkdir(mode=0o700)
    with pytest.raises(Untrusted, match=f"{planted} is owned by uid {NOBODY_UID}"):
        open_dir(str(inner), 0)


@root_only
def test_a_symlink_or_a_directory_others_may_write_is_refused(base: Path) -> None:
    good = base / "good"
    good.mkdir(mode=0o700)
    link = base / "link"
    link.symlink_to(good)
    for create in (False, True):
        with pytest.raises(Untrusted, match=f"{link} is a symlink"):
            open_dir(str(link), 0, create=create)
    open_dir_closed = open_dir(str(good), 0)
    os.close(open_dir_closed)
    loose = base / "loose"
    loose.mkdir()
    loose.chmod(0o770)  # group-writable: the daemon does not take it, the client does not trust it
    for create in (False, True):
        with pytest.raises(Untrusted, match=f"{loose} has mode 0770, not 0700"):
            open_dir(str(loose), 0, create=create)
    open_parent = base / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # not sticky: anyone may rename what is in it
    (open_parent / "colifs").mkdir(mode=0o700)
    with pytest.raises(Untrusted, match=f"{open_parent} is writable by other users"):
        open_dir(str(open_parent / "colifs"), 0)
    readable = base / "readable"
    readable.mkdir()
    readable.chmod(0o755)
    with pytest.raises(Untrusted, match="mode 0755"):
        open_dir(str(readable), 0)  # the client wants 0700
    os.close(open_dir(str(readable), 0, create=True))  # the daemon tightens its own
    assert stat.S_IMODE(readable.stat().st_mode) == 0o700
    made = base / "made"
    os.close(open_dir(str(made), 0, create=True))
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 and made.stat().st_uid == 0


def test_a_file_left_by_a_dead_daemon_of_the_same_pid_is_replaced_and_removed_at_exit(base: Path) -> None:
    d = base / "run"
    os.close(open_dir(str(d), ME, create=True))
    stale = d / "4242.sock"
    old = socket.socket(socket.AF_UNIX)
    old.bind(str(stale))  # a daemon killed before it could remove its socket
    old.close()
    bound = listen(4242, [str(d)])
    assert bound.path == str(stale)
    replaced = stale.lstat().st_ino
    bound.close()
    assert not stale.exists()
    bound = listen(4242, [str(d)])
    stale.unlink()
    stale.write_text("someone else's")  # not ours any more: left alone at exit
    bound.close()
    assert stale.read_text() == "someone else's" and replaced


def test_sockets_of_daemons_gone_are_swept_and_nothing_else(base: Path) -> None:
    d = base / "run"
    os.close(open_dir(str(d), ME, create=True))
    for pid in (NOBODY, NOBODY + 1):  # killed before they could remove their sockets
        left = socket.socket(socket.AF_UNIX)
        left.bind(str(d / f"{pid}.sock"))
        left.close()
    alive = socket.socket(socket.AF_UNIX)  # listened on: kept, whatever its name
    alive.bind(str(d / f"{NOBODY + 2}.sock"))
    alive.listen(1)
    (d / f"{NOBODY + 3}.sock").write_text("not a socket")
    (d / "notes").write_text("not ours")
    try:
        bound = listen(OURS, [str(d)])
        bound.close()
    finally:
        alive.close()
    assert sorted(os.listdir(d)) == [f"{NOBODY + 2}.sock", f"{NOBODY + 3}.sock", "notes"]


# -- who may ask -------------------------------------------------------------------------------------


def test_a_peer_is_answered_only_when_every_check_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = socket.socketpair()
    with a, b:
        own = control.namespaces("self")
        assert refusal(a, own) is None  # this process, same user and namespaces
        assert "another mount namespace" in str(refusal(a, ((0, 0), own[1])))
        assert "another user namespace" in str(refusal(a, (own[0], (0, 0))))
        assert "cannot read its own namespaces" in str(refusal(a, None))

        def unreadable(pid: int | str) -> tuple:
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(control, "namespaces", unreadable)  # /proc says nothing: refused
        assert "cannot check the client's namespaces" in str(refusal(a, own))

        def broken(pid: int | str) -> tuple:
            raise RuntimeError("surprise")

        monkeypatch.setattr(control, "namespaces", broken)  # any failure refuses, never passes
        assert "cannot check the client" in str(refusal(a, own))
        monkeypatch.undo()
        monkeypatch.setattr(os, "geteuid", lambda: ME + 1000)  # the peer is another user
        assert f"takes commands from uid {ME + 1000}" in str(refusal(a, own))
