"""The daemon's control socket: commands that carry arguments (`colifs mirror add/remove`), and
`status` (what a mount serves, read-only) for the commands that must know about other mounts
without touching them (`colifs plan`, `stage`).

Where. A socket file, PID.sock, in a directory only the daemon's user controls: /run/colifs for a
root daemon, $XDG_RUNTIME_DIR/colifs or /run/user/UID/colifs for any other. Each directory on the
way is opened one component at a time without following links and checked: owned by root or that
user, none writable by others unless sticky (/tmp), the last one mode 0700. The daemon refuses one
that fails (a directory planted by another user, a symlink) and takes no commands then (one
warning); clients refuse it too. (colifs used an abstract socket before: abstract names are scoped
by network namespace, so root in a container sharing the host's network reached it, and any user
could bind the name first and leave the mount without one.)

Who. The peer's credentials as the kernel gives them (SO_PEERCRED): the daemon's own uid, and its
mount and user namespaces (/proc/PID/ns, compared by inode): root in another mount namespace (a
container that shares the host's network and uids) is refused. What cannot be checked is refused:
/proc unreadable, a peer gone before it was checked. A daemon that is not root answers its own user
only, root included: it cannot read root's namespaces, so it could not tell root in a container
from root on the host (root can `sudo -u` the user). Clients check the other way: the socket's
listener must be the daemon's pid and uid.

One request per connection, one answer: a JSON object on one line each way. An answer is
{"ok": {...}} or {"error": "one line", "exit": code}; a command runs to its end even if the client
goes away (a removal must never stop half done). Every wait of a client is bounded (connect, send,
receive), and a client never stats anything under another mount.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import platform
import re
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from colifs.errors import EXIT_NOT_RELOADED, QuietError

if TYPE_CHECKING:  # the daemon's side needs trio; the clients (colifs mirror, plan) must not load it
    import trio

log = logging.getLogger("colifs")

RUN_DIR = "/run/colifs"  # root daemons' sockets
NAME = re.compile(r"([1-9][0-9]*)\.sock")
MAX_REQUEST = 64 * 1024  # bytes: a request is a command name and a path or two
MAX_ANSWER = 16 * 1024 * 1024  # bytes: an answer is a few lines of JSON
REQUEST_WITHIN = 10.0  # s a client has to send its request (a silent one holds a task and a descriptor)
Handler = Callable[[dict], Awaitable[dict]]


class Untrusted(Exception):
    """A directory or socket that another user could have put there, or moved (why: the message)."""


class NoAnswer(Exception):
    """The daemon could not be asked, or did not answer in time (why: the message)."""


class NotAsked(NoAnswer):
    """The daemon was not asked at all (no trusted socket, another user's daemon): nothing changed."""


class Gone(NotAsked):
    """Nothing listens on the daemon's socket file: a daemon killed before it could remove it."""


def socket_dirs(uid: int, environ: Mapping[str, str]) -> list[str]:
    """Where a daemon of user `uid` puts its socket, first choice first (`environ`: the daemon's
    own, or the client's when it is that user)."""
    if uid == 0:
        return [RUN_DIR]
    out = []
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        out.append(os.path.join(os.path.normpath(runtime), "colifs"))
    if f"/run/user/{uid}/colifs" not in out:
        out.append(f"/run/user/{uid}/colifs")
    return out


def open_dir(path: str, uid: int, create: bool = False) -> int:
    """A read-only descriptor of directory `path` that only `uid` (and root) controls: walked from
    / without following any link, each component owned by root or `uid` and not writable by
    others unless sticky, `path` itself owned by `uid` (or root) with mode 0700. `create` (the
    daemon): `path` is made when missing, and a mode of its own that others cannot write
    tightened to 0700. Untrusted when a check fails; OSError when it cannot be opened."""
    parts = path.split("/")[1:]
    if not os.path.isabs(path) or not all(parts) or any(p in (".", "..") for p in parts):
        raise Untrusted(f"{path} is not a plain absolute path")
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
    try:
        _check(os.fstat(fd), "/", uid, last=False)
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            nfd = _step(fd, name, "/" + "/".join(parts[: i + 1]), uid, last, create and last)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _step(fd: int, name: str, where: str, uid: int, last: bool, create: bool) -> int:
    """`name` in the directory of `fd`, opened without following a link and checked (`where`:
    its path, for the message); made first when `create`."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=fd)
    flags = (os.O_RDONLY if last else os.O_PATH) | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        nfd = os.open(name, flags, dir_fd=fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Untrusted(f"{where} is a symlink or not a directory") from None
        raise
    try:
        st = os.fstat(nfd)
        if create and st.st_uid == uid and st.st_mode & 0o077 and not st.st_mode & 0o022:
            os.fchmod(nfd, 0o700)  # ours, and nobody else could write it: only tightened
            st = os.fstat(nfd)
        _check(st, where, uid, last)
    except BaseException:
        os.close(nfd)
        raise
    return nfd


def _check(st: os.stat_result, where: str, uid: int, last: bool) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{where} is not a directory")
    if st.st_uid not in (0, uid):
        raise Untrusted(f"{where} is owned by uid {st.st_uid}, not {'root' if uid == 0 else f'uid {uid}'}")
    if last and st.st_mode & 0o077:
        raise Untrusted(f"{where} has mode {stat.S_IMODE(st.st_mode):04o}, not 0700")
    if not last and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise Untrusted(f"{where} is writable by other users")


def _at(dirfd: int, name: str) -> str:
    """A path that reaches `name` in the directory of `dirfd` (checked once, never walked again by
    name: a directory swapped meanwhile is not followed)."""
    return f"/proc/self/fd/{dirfd}/{name}"


def _peer(sock: socket.socket | trio.socket.SocketType) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, as the kernel vouches for them."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


# -- the daemon's side --------------------------------------------------------------------------


def namespaces(pid: int | str) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (device, inode) of process `pid`'s mount and user namespaces (OSError when /proc does
    not say: the caller refuses)."""
    out = []
    for ns in ("mnt", "user"):
        st = os.stat(f"/proc/{pid}/ns/{ns}")
        out.append((st.st_dev, st.st_ino))
    return out[0], out[1]


def refusal(sock: socket.socket | trio.socket.SocketType, own: tuple | None) -> str | None:
    """Why the client at the other end of `sock` may not command this daemon (None: it may).
    `own`: this daemon's namespaces (None: they could not be read, so nobody is answered). Fails
    closed: whatever cannot be checked is a refusal."""
    try:
        return _refusal(sock, own)
    except Exception as e:  # any failure to check is a refusal, never a pass
        return f"not allowed: cannot check the client ({type(e).__name__}: {e})"


def _refusal(sock: socket.socket | trio.socket.SocketType, own: tuple | None) -> str | None:
    pid, uid = _peer(sock)
    me = os.geteuid()
    if uid != me:
        who = "root" if me == 0 else f"uid {me} (not root: it cannot check root's namespaces)"
        return f"not allowed: daemon {os.getpid()} takes commands from {who} only, not {_who(uid)}"
    if own is None:
        return "not allowed: the daemon cannot read its own namespaces (/proc), so it answers nobody"
    if pid <= 0:
        return "not allowed: the client runs in another pid namespace"
    try:
        pidfd = _peer_pidfd(sock, pid)
    except OSError as e:
        return f"not allowed: cannot check the client's namespaces (pid {pid}: {e.strerror})"
    try:
        theirs = namespaces(pid)
        with contextlib.suppress(PermissionError):  # denied to a live process; ESRCH is what matters
            signal.pidfd_send_signal(pidfd, 0)  # still alive: its pid was not reused while /proc was read
    except OSError as e:
        return f"not allowed: cannot check the client's namespaces (pid {pid}: {e.strerror})"
    finally:
        os.close(pidfd)
    for kind, mine, its in zip(("mount", "user"), own, theirs, strict=True):
        if mine != its:
            return f"not allowed: the client (pid {pid}) runs in another {kind} namespace than the daemon"
    return None


# SO_PEERPIDFD (Linux 6.5): a pidfd of the very process that connected, where its number is known
# (the generic one; some architectures number their socket options otherwise).
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77 if platform.machine() in ("x86_64", "aarch64") else None)


def _peer_pidfd(sock: socket.socket | trio.socket.SocketType, pid: int) -> int:
    """A pidfd of the peer: the connecting process itself (SO_PEERPIDFD), else of `pid` now (a
    pid reused between the connect and this call would be checked in its place: a narrow window
    on kernels before 6.5). It must be a pidfd of `pid` (its fdinfo says so)."""
    pidfd = None
    if SO_PEERPIDFD is not None:
        with contextlib.suppress(OSError):
            pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    if pidfd is None:
        pidfd = os.pidfd_open(pid)
    try:
        with open(f"/proc/self/fdinfo/{pidfd}") as f:
            said = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        if said.get("Pid", "").strip() != str(pid):
            raise OSError(errno.ESRCH, f"not the pidfd of {pid} (Pid: {said.get('Pid')})")
    except BaseException:
        os.close(pidfd)
        raise
    return pidfd


class Listening:
    """The daemon's socket file, bound: removed at exit (only if it is still the one bound)."""

    def __init__(self, sock: socket.socket, directory: str, dirfd: int, name: str) -> None:
        self.sock = sock
        self.path = os.path.join(directory, name)
        self._dirfd = dirfd
        self._name = name
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        self._ident = (st.st_dev, st.st_ino)

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            st = os.stat(self._name, dir_fd=self._dirfd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == self._ident:
                os.unlink(self._name, dir_fd=self._dirfd)
        os.close(self._dirfd)


def listen(pid: int, dirs: Sequence[str]) -> Listening:
    """Bind PID.sock in the first of `dirs` that passes the checks (a file left there by a dead
    daemon of the same pid is replaced: only this user or root could have put it there), and
    sweep the sockets of other daemons gone. Untrusted (the reasons) when none does."""
    name = f"{pid}.sock"
    why = []
    for d in dirs:
        try:
            dirfd = open_dir(d, os.geteuid(), create=True)
        except (Untrusted, OSError) as e:
            why.append(str(e) if isinstance(e, Untrusted) else f"{d}: {e.strerror}")
            continue
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dirfd)
            sock.bind(_at(dirfd, name))
            sock.listen(8)
            bound = Listening(sock, d, dirfd, name)
        except OSError as e:
            sock.close()
            os.close(dirfd)
            why.append(f"{os.path.join(d, name)}: {e.strerror}")
            continue
        sweep(dirfd, pid)
        return bound
    raise Untrusted("; ".join(why) or "no directory to put it in")


def sweep(dirfd: int, pid: int) -> None:
    """Remove the sockets of daemons gone (killed before they could remove theirs) from the
    directory of `dirfd`: each one whose pid is no process and that nothing listens on is moved
    aside, and removed only if it is still the file that was found so (else a daemon that just
    took that pid bound it meanwhile, and it is put back)."""
    for name in os.listdir(dirfd):
        m = NAME.fullmatch(name)
        if m is None or int(m[1]) == pid or os.path.exists(f"/proc/{m[1]}"):
            continue
        with contextlib.suppress(OSError):
            found = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if not stat.S_ISSOCK(found.st_mode) or _listened(dirfd, name):
                continue
            aside = f".stale.{pid}.{name}"
            os.rename(name, aside, src_dir_fd=dirfd, dst_dir_fd=dirfd)
            moved = os.stat(aside, dir_fd=dirfd, follow_symlinks=False)
            if (moved.st_dev, moved.st_ino) == (found.st_dev, found.st_ino):
                os.unlink(aside, dir_fd=dirfd)
            else:
                os.rename(aside, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)


def _listened(dirfd: int, name: str) -> bool:
    """Whether something listens on socket file `name` (a full backlog counts as listening)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setblocking(False)
        try:
            s.connect(_at(dirfd, name))
        except ConnectionRefusedError:
            return False
        except OSError:
            return True
    return True


class Control:
    """Answers the commands in `handlers` (name -> async handler of the request) on the socket
    file of daemon `pid`, in the first usable of `dirs` (by default: where this user's go);
    `listening` hears where (None: nowhere)."""

    def __init__(
        self,
        handlers: Mapping[str, Handler],
        pid: int | None = None,
        dirs: Sequence[str] | None = None,
        listening: Callable[[str | None], None] = lambda path: None,
    ) -> None:
        self.handlers = dict(handlers)
        self.pid = pid or os.getpid()
        self.dirs = list(dirs) if dirs is not None else socket_dirs(os.geteuid(), os.environ)
        self.listening = listening
        self.own: tuple | None = None

    async def serve(self) -> None:
        import trio

        try:
            self.own = namespaces("self")
        except OSError as e:
            log.warning("control socket: cannot read the daemon's namespaces (%s): refusing all commands", e)
        try:
            bound = listen(self.pid, self.dirs)
        except Untrusted as e:  # the mount serves on; only its commands are missing
            log.warning("control socket: none (%s); colifs mirror add/remove will not reach this mount", e)
            self.listening(None)
            return
        self.listening(bound.path)
        log.debug("control socket: %s", bound.path)
        try:
            listener = trio.SocketListener(trio.socket.from_stdlib_socket(bound.sock))
            await trio.serve_listeners(self._answer, [listener])
        finally:
            bound.close()

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
        import trio

        why = refusal(stream.socket, self.own)
        if why is not None:
            log.info("control: %s", why)
            raise QuietError(why).with_code(EXIT_NOT_RELOADED)
        request: dict = {}
        with trio.move_on_after(REQUEST_WITHIN) as waited:
            request = await _read_line(stream)
        if waited.cancelled_caught:
            raise QuietError(f"bad request: none within {REQUEST_WITHIN:g} s")
        handler = self.handlers.get(request.get("command", ""))
        if handler is None:
            raise QuietError(f"unknown command {request.get('command')!r} (an older or newer colifs?)")
        return {"ok": await handler(request)}


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


# -- the clients' side --------------------------------------------------------------------------


def _who(uid: int) -> str:
    return "root" if uid == 0 else f"uid {uid}"


def ask(pid: int, uid: int, request: dict, timeout: float, also: str | None = None) -> dict:
    """Send one request to daemon `pid` of user `uid` and return its answer (QuietError with the
    daemon's exit code when it refused). NotAsked when no socket of it can be trusted (or it is
    another user's daemon), NoAnswer when it did not answer in time. `also`: where the daemon
    said its socket is (stats.json), tried when it is not where this user's go; checked the same."""
    me = os.geteuid()
    if uid != me:
        raise NotAsked(f"daemon {pid} runs as {_who(uid)} and takes commands from that user only: run as it")
    dirs = socket_dirs(uid, os.environ)
    if also and uid != 0 and os.path.dirname(also) not in dirs and os.path.basename(also) == f"{pid}.sock":
        dirs.append(os.path.dirname(also))
    deadline = time.monotonic() + timeout
    why = []
    for d in dirs:
        try:
            dirfd = open_dir(d, uid)
        except FileNotFoundError:
            continue
        except (Untrusted, OSError) as e:
            why.append(f"{e} (not trusted)" if isinstance(e, Untrusted) else f"{d}: {e.strerror}")
            continue
        try:
            return _ask_at(dirfd, d, pid, uid, request, deadline)
        except FileNotFoundError:
            continue
        finally:
            os.close(dirfd)
    said = f" ({'; '.join(why)})" if why else ""
    raise NotAsked(f"no control socket of daemon {pid} in {' or '.join(dirs)}{said}")


def _ask_at(dirfd: int, d: str, pid: int, uid: int, request: dict, deadline: float) -> dict:
    """Ask daemon `pid` on its socket in the checked directory `dirfd` (`d`), before `deadline`.
    FileNotFoundError when it has none there."""
    name = f"{pid}.sock"
    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in (0, uid):
        raise NotAsked(f"{os.path.join(d, name)} is not a socket of {_who(uid)} (not trusted)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.settimeout(max(deadline - time.monotonic(), 0.001))
            s.connect(_at(dirfd, name))
            held, by = _peer(s)
            if (held, by) != (pid, uid):  # a socket left by a daemon gone, its pid reused, or planted
                raise NotAsked(f"{os.path.join(d, name)} is held by process {held} ({_who(by)}), not {pid}")
            data = _exchange(s, request, deadline)
        except ConnectionRefusedError:
            raise Gone(f"daemon {pid} does not listen on {os.path.join(d, name)} (gone?)") from None
        except TimeoutError:
            raise NoAnswer("no answer in time") from None
        except BlockingIOError:  # a full backlog on a non-blocking connect
            raise NotAsked(f"daemon {pid} takes no more connections (hung?)") from None
        except FileNotFoundError:
            raise
        except OSError as e:
            raise NoAnswer(f"{os.path.join(d, name)}: {e.strerror or e}") from None
    try:
        answer = json.loads(data)
    except ValueError:
        raise NoAnswer("the daemon's answer is not JSON") from None
    if "error" in answer:
        raise QuietError(answer["error"]).with_code(int(answer.get("exit", 1)))
    return answer["ok"]


def _exchange(s: socket.socket, request: dict, deadline: float) -> bytes:
    """Send `request`, receive the answer's line, each wait bounded by `deadline`."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        s.sendall(json.dumps(request).encode() + b"\n")  # a refusal may come (and close) first
    data = b""
    while not data.endswith(b"\n"):
        s.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            chunk = s.recv(1 << 16)
        except ConnectionResetError:  # closed with our request unread: after a refusal
            chunk = b""
        if not chunk:
            raise NoAnswer("the daemon closed the connection without an answer")
        data += chunk
        if len(data) > MAX_ANSWER:
            raise NoAnswer("the daemon's answer is too long")
    return data


def ask_everyone(request: dict, wait: float) -> tuple[dict[int, dict | str], list[str]]:
    """Ask every daemon of this user (root: of root) with a socket in a trusted directory, all at
    once, for `wait` seconds in all: (pid -> its answer or why there is none, leaving out sockets
    nothing listens on; the directories not trusted, why). A thread waiting on a daemon that does
    not answer is left behind: it waits on a socket, never on a file system, so the process still
    ends at once (on a signal too)."""
    me = os.geteuid()
    found: dict[int, str] = {}  # pid -> the directory of its socket
    untrusted = []
    for d in socket_dirs(me, os.environ):
        try:
            dirfd = open_dir(d, me)
        except FileNotFoundError:
            continue
        except (Untrusted, OSError) as e:
            untrusted.append(str(e) if isinstance(e, Untrusted) else f"{d}: {e.strerror}")
            continue
        try:
            for name in os.listdir(dirfd):
                m = NAME.fullmatch(name)
                if m:
                    found.setdefault(int(m[1]), d)
        finally:
            os.close(dirfd)
    deadline = time.monotonic() + wait
    got: dict[int, dict | str | None] = {}

    def one(pid: int, d: str) -> None:
        try:
            dirfd = open_dir(d, me)  # each thread its own descriptor, checked again
        except (Untrusted, OSError) as e:
            got[pid] = str(e)
            return
        try:
            got[pid] = _ask_at(dirfd, d, pid, me, request, deadline)
        except (Gone, FileNotFoundError):
            got[pid] = None
        except (NoAnswer, QuietError, OSError, ValueError, KeyError, TypeError) as e:
            got[pid] = str(e) or type(e).__name__
        finally:
            os.close(dirfd)

    threads = [threading.Thread(target=one, args=item, daemon=True) for item in found.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    answers = {pid: got.get(pid, f"no answer within {wait:g} s") for pid in found}
    return {pid: a for pid, a in answers.items() if a is not None}, untrusted
