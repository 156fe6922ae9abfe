"""JSON that colifs did not write (headers, usage files, receipts): every way it can be malformed
is one `BadJSON` with a short reason, never a RecursionError (deep nesting), a stray ValueError (an
integer of thousands of digits) or an unbounded read."""

from __future__ import annotations

import json


class BadJSON(ValueError):
    """Not JSON colifs can use; the message is the reason, short."""


def loads(doc: str | bytes) -> object:
    try:
        return json.loads(doc)
    except json.JSONDecodeError as e:
        raise BadJSON(f"{e.msg} at char {e.pos}") from None
    except UnicodeDecodeError as e:
        raise BadJSON(f"not UTF-8 (byte {e.start})") from None
    except RecursionError:
        raise BadJSON("nested too deeply") from None
    except ValueError as e:  # e.g. Python's limit on the digits of an integer
        raise BadJSON(str(e).split(";")[0]) from None


class TooLarge(ValueError):
    """A file longer than any file of its kind colifs reads."""


def read_bounded(path: str, limit: int) -> bytes:
    """The bytes of the file at `path`, TooLarge past `limit`; OSError if it cannot be read."""
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise TooLarge(f"larger than {limit} bytes")
    return raw


def load_file(path: str, limit: int) -> object:
    """The JSON in the file at `path`, refused past `limit` bytes; OSError if it cannot be read."""
    try:
        raw = read_bounded(path, limit)
    except TooLarge as e:
        raise BadJSON(str(e)) from None
    return loads(raw)
