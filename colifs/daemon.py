"""Running a mount: in the foreground, or as a daemon that the command returns from once the mount
serves (a forked child sends its messages through a pipe until then)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from colifs.config import MountConfig
from colifs.errors import MountError, QuietError

READY = b"\0colifs-ready\n"


def foreground(cfg: MountConfig, debug: bool, log_file: str | None, on_ready: Callable[[], None]) -> int:
    from colifs import logs
    from colifs.mount import serve  # pyfuse3 and trio: only where a mount runs

    logs.setup(debug, log_file)
    serve(cfg, on_ready)
    return 0


def daemonize(cfg: MountConfig, debug: bool, log_file: str | None) -> int:
    """Fork; the child builds and mounts, sending its messages through a pipe until it is serving.

    The parent copies them to stderr and exits 0 on the ready marker, or with the child's code.
    Forking happens before any thread exists (the workers start in the child).
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(cfg, debug, log_file, w)  # never returns
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        for line in pipe:
            if line == READY:
                return 0
            sys.stderr.buffer.write(line)
            sys.stderr.flush()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code or MountError.exit_code  # 0: it exited without ever serving


def _child(cfg: MountConfig, debug: bool, log_file: str | None, pipe: int) -> None:
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(pipe, 1)
    os.dup2(pipe, 2)
    os.close(pipe)

    def ready() -> None:
        from colifs import logs

        sys.stderr.flush()
        os.write(2, READY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        logs.to_syslog()  # stderr is gone: from here on the log is syslog (and --log-file)

    try:
        code = foreground(cfg, debug, log_file, ready)
    except QuietError as e:
        print(f"colifs: error: {e}", file=sys.stderr)
        code = e.exit_code
    except BaseException as e:  # the parent must get a line, never a silent failure
        print(f"colifs: error: daemon failed: {e!r}", file=sys.stderr)
        code = 1
    sys.stderr.flush()
    os._exit(code)
