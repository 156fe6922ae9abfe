"""What the mount served, per routing key and per file, kept across runs; and Colibrì's `.coli_usage`.

Expert heat is what makes a partial mirror worth it: `colifs plan` puts the shards whose traffic
per byte is highest on the smaller drive, and the mount raises the mirror's share among the keys
it holds. Only reads that reach the daemon are counted: reads the kernel answers from its page
cache never do, so a hot expert that stays cached counts once.

The usage file (JSON) is written next to the primary by default, never on a mirror, through a
temporary file and a rename; each save adds what was served since the last save to what the file
holds then, so two mounts of one primary both add up.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from colifs.errors import UsageError
from colifs.formats.layout import ExpertKey, Key, Layout
from colifs.jsonin import BadJSON, TooLarge, load_file, read_bounded

USAGE_NAME = ".colifs-usage.json"
COLI_USAGE_NAME = ".coli_usage"
MAX_USAGE_FILE = 256 << 20  # bytes: a million keys fit in a tenth of it
FORMAT = "colifs-usage"
VERSION = 1
COLI_VERSION = 1  # the newest .coli_usage version understood


class BadUsageFile(UsageError):
    """A usage file that cannot be read: one line saying which and why."""


@dataclass
class Usage:
    """Bytes and reads per routing key and per file."""

    keys: dict[Key, list[int]] = field(default_factory=dict)  # key -> [bytes, reads]
    files: dict[str, list[int]] = field(default_factory=dict)  # relpath -> [bytes, reads]
    runs: int = 0

    def count(self, key: Key, nbytes: int, reads: int = 1) -> None:
        row = self.keys.get(key)
        if row is None:
            self.keys[key] = [nbytes, reads]
        else:
            row[0] += nbytes
            row[1] += reads

    def count_file(self, relpath: str, nbytes: int, reads: int = 1) -> None:
        row = self.files.get(relpath)
        if row is None:
            self.files[relpath] = [nbytes, reads]
        else:
            row[0] += nbytes
            row[1] += reads

    def add(self, other: Usage) -> None:
        for mine, theirs in ((self.keys, other.keys), (self.files, other.files)):
            for k, (b, r) in theirs.items():
                row = mine.setdefault(k, [0, 0])
                row[0] += b
                row[1] += r
        self.runs += other.runs

    def __bool__(self) -> bool:
        return bool(self.keys or self.files)

    def to_json(self) -> dict:
        experts: dict[str, dict[str, dict[str, list[int]]]] = {}
        tensors: dict[str, list[int]] = {}
        for k, row in self.keys.items():
            if isinstance(k, ExpertKey):
                experts.setdefault(k.stack, {}).setdefault(str(k.layer), {})[str(k.expert)] = row
            else:
                tensors[k] = row
        return {
            "format": FORMAT,
            "version": VERSION,
            "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "runs": self.runs,
            "note": "bytes and reads served by colifs ([bytes, reads]); page-cache hits never reach it",
            "files": dict(sorted(self.files.items())),
            "experts": experts,
            "tensors": dict(sorted(tensors.items())),
        }

    @classmethod
    def from_json(cls, data: object, where: str) -> Usage:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise BadUsageFile(f"{where}: not a colifs usage file")
        if not isinstance(data.get("version"), int) or data["version"] > VERSION:
            raise BadUsageFile(
                f"{where}: version {data.get('version')!r} is newer than this colifs reads ({VERSION})"
            )
        keys: dict[Key, list[int]] = {}
        try:
            for stack, layers in data.get("experts", {}).items():
                for layer, experts in layers.items():
                    keys.update({ExpertKey(stack, int(layer), int(e)): _row(r) for e, r in experts.items()})
            keys.update({name: _row(row) for name, row in data.get("tensors", {}).items()})
            files = {name: _row(row) for name, row in data.get("files", {}).items()}
            runs = int(data.get("runs", 0))
        except (AttributeError, TypeError, ValueError) as e:
            raise BadUsageFile(f"{where}: malformed entry ({e})") from None
        return cls(keys, files, runs)


def _row(row: object) -> list[int]:
    if not (isinstance(row, list) and len(row) == 2 and all(isinstance(x, int) and x >= 0 for x in row)):
        raise ValueError(f"{row!r} is not [bytes, reads]")
    return [row[0], row[1]]


def load(path: str) -> Usage:
    """The usage file at `path` (empty if there is none); BadUsageFile if it cannot be used."""
    try:
        data = load_file(path, MAX_USAGE_FILE)
    except FileNotFoundError:
        return Usage()
    except OSError as e:
        raise BadUsageFile(f"{path}: cannot read ({e.strerror})") from None
    except BadJSON as e:
        raise BadUsageFile(f"{path}: not valid JSON ({e})") from None
    return Usage.from_json(data, path)


def save(path: str, pending: Usage) -> None:
    """Add `pending` to the file at `path` (as it is now) and write it back atomically.

    Raises OSError or BadUsageFile; the caller keeps `pending` then, so nothing is lost.
    """
    total = load(path)
    total.add(pending)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(total.to_json(), f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dirfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def read_coli_usage(path: str, key_bytes: Mapping[Key, int], main_stack: str) -> Usage:
    """Colibrì's text usage file as a Usage: each activation of (layer, expert) reads that expert.

    Lines: `-1 <n_layers> <n_experts>`, `-2 <version> <engine_id>`, then `<layer> <expert> <count>`.
    Its layers are the main stack's (`main_stack`); an expert the model lacks is skipped.
    """
    try:
        lines = read_bounded(path, MAX_USAGE_FILE).decode("ascii").splitlines()
    except TooLarge as e:
        raise BadUsageFile(f"{path}: {e}: not a usage file") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not ASCII text"
        raise BadUsageFile(f"{path}: cannot read ({reason})") from None
    keys: dict[Key, list[int]] = {}
    dims: tuple[int, int] | None = None
    for n, line in enumerate(lines, 1):
        nums = _coli_numbers(line, f"{path}:{n}")
        if not nums or nums[0] == -2:
            continue
        if nums[0] == -1:
            dims = (nums[1], nums[2])
            continue
        layer, expert, count = nums
        if dims is not None and (layer >= dims[0] or expert >= dims[1]):
            raise BadUsageFile(f"{path}:{n}: layer {layer} expert {expert} outside {dims[0]} x {dims[1]}")
        key = ExpertKey(main_stack, layer, expert)
        if key in key_bytes and count:
            keys[key] = [count * key_bytes[key], count]
    return Usage(keys=keys, runs=1)


def _coli_numbers(line: str, where: str) -> list[int]:
    """One line of a .coli_usage as checked numbers ([] for a blank line)."""
    parts = line.split()
    if not parts:
        return []
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise BadUsageFile(f"{where}: not numbers: {line[:60]!r}") from None
    if nums[0] == -2:
        if len(nums) < 2:
            raise BadUsageFile(f"{where}: version line without a version")
        if nums[1] > COLI_VERSION:
            raise BadUsageFile(
                f"{where}: .coli_usage version {nums[1]} is newer than this colifs reads ({COLI_VERSION})"
            )
    elif nums[0] == -1:
        if len(nums) != 3:
            raise BadUsageFile(f"{where}: expected '-1 <n_layers> <n_experts>'")
    elif len(nums) != 3 or min(nums) < 0:
        raise BadUsageFile(f"{where}: expected '<layer> <expert> <count>'")
    return nums


def key_sizes(layouts: Iterable[Layout]) -> dict[Key, int]:
    """Bytes of each key over all files (a key may span shards)."""
    out: dict[Key, int] = {}
    get = out.get
    for layout in layouts:
        ends = (*layout.starts[1:], layout.size) if layout.starts else ()  # a file may hold no tensor
        for s, e, k in zip(layout.starts, ends, layout.keys, strict=True):
            out[k] = get(k, 0) + e - s
    return out


def main_stack(keys: Iterable[Key]) -> str:
    """The stack most experts belong to (`model.layers`, `blk`, ...): where `.coli_usage` layers live."""
    counts: dict[str, int] = {}
    for k in keys:
        if isinstance(k, ExpertKey):
            counts[k.stack] = counts.get(k.stack, 0) + 1
    return max(counts, key=lambda s: (counts[s], s)) if counts else ""


def traffic(layouts: Mapping[str, Layout], usage: Usage | None) -> dict[str, float]:
    """Expected bytes read per file: each key's served bytes shared among its extents by size.

    Without usage every byte counts once (an even estimate).
    """
    sizes = key_sizes(layouts.values())
    out: dict[str, float] = {}
    for relpath, layout in layouts.items():
        if not usage:
            out[relpath] = float(layout.size - layout.data_start)
            continue
        t = 0.0
        for s, e, k in layout.extents():
            row = usage.keys.get(k)
            if row is not None:
                t += row[0] * (e - s) / sizes[k]
        out[relpath] = t
    return out
