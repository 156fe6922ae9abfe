"""colifs' own files in a mirror directory: the receipt `colifs stage` writes once every staged
copy is in place (each copy's SHA-256 and both copies' mtimes), which the mount reads to know
which copies were checked byte for byte, and the temporaries staging copies through.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence

from colifs.jsonin import BadJSON, load_file

RECEIPT_NAME = ".colifs-receipt.json"
MAX_RECEIPT = 64 << 20  # bytes: ~300 bytes per shard
TMP_PREFIX = ".colifs-stage-"
TMP_SUFFIX = ".tmp"
log = logging.getLogger("colifs")


def is_ours(name: str) -> bool:
    """colifs' own files in a mirror directory (temporaries, receipt): not model copies."""
    return name == RECEIPT_NAME or (name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX))


def load_receipt(mirror: str) -> dict[str, dict]:
    """Entries of an earlier receipt by path (empty if none or unusable: it is only a cache)."""
    path = os.path.join(mirror, RECEIPT_NAME)
    try:
        data = load_file(path, MAX_RECEIPT)
        return {e["path"]: e for e in data["shards"]}  # type: ignore[index]
    except FileNotFoundError:
        return {}
    except OSError as e:
        reason = e.strerror
    except BadJSON as e:
        reason = str(e)
    except (KeyError, TypeError):
        reason = "not a colifs receipt"
    log.warning("%s: unusable (%s); ignored: its copies are checked by header only", path, reason)
    return {}


def write_receipt(mirror: str, primary: str, entries: Sequence[dict]) -> None:
    """Replace the receipt atomically (a temporary, fsynced, renamed)."""
    path = os.path.join(mirror, RECEIPT_NAME)
    tmp = os.path.join(mirror, f"{TMP_PREFIX}receipt.{os.getpid()}{TMP_SUFFIX}")
    body = {
        "format": "colifs-receipt",
        "version": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "primary": primary,
        "shards": sorted(entries, key=lambda e: e["path"]),
    }
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(mirror)


def receipt_vouches(entry: dict | None, size: int, primary_mtime_ns: int, mirror_mtime_ns: int) -> bool:
    """Both copies are still the ones whose SHA-256s matched when the receipt was written."""
    return (
        entry is not None
        and bool(entry.get("sha256"))
        and entry.get("size") == size
        and entry.get("primary_mtime_ns") == primary_mtime_ns
        and entry.get("mirror_mtime_ns") == mirror_mtime_ns
    )


def fsync_dir(path: str) -> None:
    """Make a rename or link in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
