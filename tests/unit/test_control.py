"""The control socket (colifs.control): one JSON request, one answer; refusals keep their exit
code; a daemon without a socket is said, not waited for."""

from __future__ import annotations

import os
import threading

import pytest
import trio

from colifs.control import Control, NoAnswer, ask
from colifs.errors import QuietError, UsageError

OURS = os.getpid()  # the socket is served by this process, as a daemon serves its own
NOBODY = 999_999_001  # above pid_max: no process has it


def serving(handlers: dict, pid: int = OURS) -> tuple[threading.Thread, tuple, list]:
    """A control socket served on a thread of its own (as in the daemon's trio loop)."""
    got: list = []
    ready = threading.Event()
    cancel: list = []

    async def main() -> None:
        async with trio.open_nursery() as n:
            cancel.append((n.cancel_scope, trio.lowlevel.current_trio_token()))
            n.start_soon(Control(handlers, pid).serve)
            await trio.sleep(0.1)  # bound by now
            ready.set()

    t = threading.Thread(target=trio.run, args=(main,))
    t.start()
    ready.wait(10)
    return t, cancel[0], got


def test_a_request_is_answered_and_a_refusal_keeps_its_exit_code() -> None:
    seen = []

    async def echo(request: dict) -> dict:
        seen.append(request)
        return {"done": request["path"]}

    async def refuse(request: dict) -> dict:
        raise UsageError(f"{request['path']} is the primary")

    async def crash(request: dict) -> dict:
        raise RuntimeError("bug")

    t, (scope, token), _ = serving({"echo": echo, "refuse": refuse, "crash": crash})
    try:
        assert ask(OURS, {"command": "echo", "path": "/m"}, 5) == {"done": "/m"}
        assert seen == [{"command": "echo", "path": "/m"}]
        with pytest.raises(QuietError, match="/m is the primary") as e:
            ask(OURS, {"command": "refuse", "path": "/m"}, 5)
        assert e.value.exit_code == 2
        with pytest.raises(QuietError, match="RuntimeError: bug") as e:
            ask(OURS, {"command": "crash"}, 5)
        assert e.value.exit_code == 1
        with pytest.raises(QuietError, match="unknown command 'nope'"):
            ask(OURS, {"command": "nope"}, 5)
        assert ask(OURS, {"command": "echo", "path": "/again"}, 5) == {"done": "/again"}  # serves on
    finally:
        token.run_sync_soon(scope.cancel)
        t.join(10)


def test_a_daemon_without_a_control_socket_is_said_at_once() -> None:
    with pytest.raises(NoAnswer, match="takes no commands"):
        ask(NOBODY, {"command": "echo"}, 5)


def test_a_socket_held_by_another_process_than_the_daemon_is_not_asked() -> None:
    async def echo(request: dict) -> dict:
        return {}

    t, (scope, token), _ = serving({"echo": echo}, pid=NOBODY)  # this process poses as daemon NOBODY
    try:
        with pytest.raises(NoAnswer, match=f"held by process {OURS}"):
            ask(NOBODY, {"command": "echo"}, 5)
    finally:
        token.run_sync_soon(scope.cancel)
        t.join(10)
