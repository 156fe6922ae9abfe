"""The daemon's control socket: commands that carry arguments (`colifs mirror add/remove`).

A mount is read-only and a signal carries no argument, so each daemon listens on a Unix socket in
the abstract namespace, named by its pid (`address`): nothing to create or clean up on disk, gone
with the process. One request per connection, one answer: a JSON object on one line each way.
Only root and the daemon's own user are answered (the peer's credentials, SO_PEERCRED).
An answer is {"ok": {...}} or {"error": "one line", "exit": code}; a command runs to its end even
if the client goes away (a removal must never stop half done).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from colifs.errors import QuietError

if TYPE_CHECKING:  # the daemon's side needs trio; the client's (colifs mirror) must not load it
    import trio

log = logging.getLogger("colifs")

MAX_REQUEST = 64 * 1024  # bytes: a request is a command name and a path or two
REQUEST_WITHIN = 10.0  # s a client has to send its request (a silent one holds a task and a descriptor)
Handler = Callable[[dict], Awaitable[dict]]


def address(pid: int) -> str:
    """The control socket of daemon `pid` (abstract: the leading NUL)."""
    return f"\0colifs-control-{pid}"


class Control:
    """Answers the commands in `handlers` (name -> async handler of the request)."""

    def __init__(self, handlers: Mapping[str, Handler], pid: int | None = None) -> None:
        self.handlers = dict(handlers)
        self.address = address(pid or os.getpid())

    async def serve(self) -> None:
        import trio

        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await sock.bind(self.address)
        except OSError as e:  # the mount serves on; only its commands are missing
            log.warning("control socket: cannot listen (%s); colifs mirror add/remove will not reach it", e)
            sock.close()
            return
        sock.listen(8)
        await trio.serve_listeners(self._answer, [trio.SocketListener(sock)])

    async def _answer(self, stream: trio.SocketStream) -> None:
        import trio

        async with stream:
            try:
                answer = await self._handle(stream)
            except QuietError as e:
                answer = {"error": str(e), "exit": e.exit_code}
            except Exception as e:  # the daemon serves on; the client hears why
                log.exception("control command failed")
                answer = {"error": f"{type(e).__name__}: {e}", "exit": 1}
            try:
                await stream.send_all(json.dumps(answer).encode() + b"\n")
            except trio.BrokenResourceError:
                log.info("control: the client left before its answer: %s", answer)

    async def _handle(self, stream: trio.SocketStream) -> dict:
        if not _allowed(stream.socket):
            raise QuietError("not allowed: run as root or as the daemon's user")
        import trio

        request: dict = {}
        with trio.move_on_after(REQUEST_WITHIN) as waited:
            request = await _read_line(stream)
        if waited.cancelled_caught:
            raise QuietError(f"bad request: none within {REQUEST_WITHIN:g} s")
        handler = self.handlers.get(request.get("command", ""))
        if handler is None:
            raise QuietError(f"unknown command {request.get('command')!r} (an older or newer colifs?)")
        return {"ok": await handler(request)}


def _peer(sock: socket.socket | trio.socket.SocketType) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, as the kernel vouches for them."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def _allowed(sock: trio.socket.SocketType) -> bool:
    return _peer(sock)[1] in (0, os.geteuid())


async def _read_line(stream: trio.SocketStream) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some(MAX_REQUEST)
        if not chunk or len(data) + len(chunk) > MAX_REQUEST:
            raise QuietError("bad request: not one JSON line")
        data += chunk
    try:
        request = json.loads(data)
    except ValueError:
        raise QuietError("bad request: not JSON") from None
    if not isinstance(request, dict):
        raise QuietError("bad request: not a JSON object")
    return request


class NoAnswer(Exception):
    """The daemon could not be asked, or did not answer in time (why: the message)."""


def ask(pid: int, request: dict, timeout: float) -> dict:
    """Send one request to daemon `pid` and return its answer (QuietError with the daemon's exit
    code when it refused); NoAnswer when it cannot be reached or does not answer in time."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(address(pid))
            if _peer(s)[0] != pid:  # any process may bind an abstract name: only the daemon is asked
                raise NoAnswer(f"the control socket of daemon {pid} is held by process {_peer(s)[0]}")
            s.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(MAX_REQUEST)
                if not chunk:
                    raise NoAnswer("the daemon closed the connection without an answer")
                data += chunk
        except (ConnectionRefusedError, FileNotFoundError):
            raise NoAnswer("its daemon takes no commands (an older colifs: remount it)") from None
        except TimeoutError:
            raise NoAnswer(f"no answer within {timeout:g} s") from None
    answer = json.loads(data)
    if "error" in answer:
        raise QuietError(answer["error"]).with_code(int(answer.get("exit", 1)))
    return answer["ok"]
