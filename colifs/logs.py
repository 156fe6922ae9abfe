"""Logging set-up and the once-per-subject warnings the read path needs (never one per read)."""

from __future__ import annotations

import logging
import logging.handlers
import os
import socket
import sys
import time
from collections import deque
from collections.abc import Hashable

log = logging.getLogger("colifs")


def setup(debug: bool = False, log_file: str | None = None) -> None:
    """`colifs: warning: ...` lines on stderr (and in `log_file` with timestamps)."""
    log.setLevel(logging.DEBUG if debug else logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(_Short(tracebacks=debug))
    err.setLevel(logging.DEBUG if debug else logging.INFO)
    log.addHandler(err)
    if log_file:
        fh = logging.FileHandler(log_file, errors="backslashreplace")
        fh.setFormatter(_Stamped())
        log.addHandler(fh)


SYSLOG_ENV = "COLIFS_SYSLOG_SOCKET"  # where the daemon's syslog goes (default /dev/log: journald)


def to_syslog() -> str | None:
    """Once daemonised (stderr gone), also log to syslog/journald; the socket used, if any."""
    address = os.environ.get(SYSLOG_ENV, "/dev/log")
    if not os.path.exists(address):
        return None
    try:
        handler = logging.handlers.SysLogHandler(
            address, logging.handlers.SysLogHandler.LOG_DAEMON, socket.SOCK_DGRAM
        )
    except OSError:
        return None
    handler.setFormatter(_Syslog())
    log.addHandler(handler)
    return address


def one_line(text: str) -> str:
    """Control characters (a newline in a file name) escaped: one record, one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Short(logging.Formatter):
    """`colifs: message` for information, `colifs: warning: message` for the rest; one line per
    record (a traceback only with --debug: the log file has them)."""

    def __init__(self, tracebacks: bool) -> None:
        super().__init__()
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else record.levelname.lower() + ": "
        text = f"colifs: {level}{one_line(record.getMessage())}"
        if record.exc_info and self.tracebacks:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _Syslog(logging.Formatter):
    """`colifs[pid]: warning: message`: the tag journald and syslog file records under."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else record.levelname.lower() + ": "
        return f"colifs[{os.getpid()}]: {level}{one_line(record.getMessage())}"


class _Stamped(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = f"{self.formatTime(record)} {record.levelname} {one_line(record.getMessage())}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class WarnOnce:
    """Logs a warning the first time a subject (a file, a file+replica pair) has a problem."""

    def __init__(self) -> None:
        self._seen: set[Hashable] = set()

    def __call__(self, subject: Hashable, msg: str, *args: object) -> None:
        if subject not in self._seen:
            self._seen.add(subject)
            log.warning(msg, *args)


class RecentWarnings(logging.Handler):
    """Keeps the latest warnings for stats.json: a daemon's stderr is gone once it is ready."""

    def __init__(self, keep: int = 50) -> None:
        super().__init__(logging.WARNING)
        self._lines: deque[str] = deque(maxlen=keep)

    def emit(self, record: logging.LogRecord) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        self._lines.append(f"{stamp} {one_line(record.getMessage())}")

    def lines(self) -> list[str]:
        return list(self._lines)
