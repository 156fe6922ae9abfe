"""Bad input at mount: every malformed file is one warning line naming it and the reason, is served
as plain bytes from the primary, and the good files beside it are still routed."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from colifs.synth import write_checkpoint
from tests.helpers import (
    mounted,
    read_direct,
    refuse,
)

pytestmark = pytest.mark.mounts  # every test here runs on both engines


def st_file(meta: object, data: bytes = b"", length: int | None = None) -> bytes:
    text = json.dumps(meta).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def raw_header(text: bytes) -> bytes:
    """A safetensors file whose header is `text`, verbatim (what json.dumps would never write)."""
    return struct.pack("<Q", len(text)) + text


def gguf_kv(value: bytes) -> bytes:
    """A GGUF file of no tensors and one metadata key, `general.x`, of type and value `value`."""
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 9) + b"general.x" + value


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# name → (content, what the warning must say)
CORPUS: dict[str, tuple[bytes, str]] = {
    "short.safetensors": (b"\x01\x02\x03", "shorter than the 8-byte"),
    "empty.safetensors": (b"", "shorter than the 8-byte"),
    "length-past-end.safetensors": (struct.pack("<Q", 5000) + b"{}", "past the end"),
    "length-huge.safetensors": (struct.pack("<Q", 200_000_000) + b"{}", "over the 100000000-byte limit"),
    "utf8.safetensors": (struct.pack("<Q", 3) + b"\xff\xfe{", "not valid UTF-8"),
    "json.safetensors": (struct.pack("<Q", 5) + b"{nope", "not valid JSON"),
    "not-object.safetensors": (st_file([1, 2, 3]), "not an object"),
    "missing-fields.safetensors": (st_file({"x": {"dtype": "F32"}}), "lacks dtype, shape or data_offsets"),
    "dtype.safetensors": (st_file({"x": entry("F99", [1], 0, 4)}, b"abcd"), "unknown dtype"),
    "out-of-range.safetensors": (st_file({"x": entry("F32", [4], 0, 16)}, b"abcd"), "past the end"),
    "overlap.safetensors": (
        st_file({"x": entry("F32", [2], 0, 8), "y": entry("F32", [2], 4, 12)}, b"a" * 12),
        "overlaps",
    ),
    "gap.safetensors": (
        st_file({"x": entry("F32", [1], 0, 4), "y": entry("F32", [1], 8, 12)}, b"a" * 12),
        "gap",
    ),
    "shape.safetensors": (st_file({"x": entry("F32", [2], 0, 4)}, b"abcd"), "do not match"),
    "trailing.safetensors": (st_file({"x": entry("F32", [1], 0, 4)}, b"abcdEXTRA"), "trailing bytes"),
    "with space and ünïcode.safetensors": (b"\x00", "shorter than the 8-byte"),
    "new\nline.safetensors": (b"\x00", "shorter than the 8-byte"),
    "bad.gguf": (b"GGUF" + struct.pack("<IQQ", 3, 2**40, 0), "does not fit"),
    # hostile: what would end a daemon whose parsers trust their input
    "nested.safetensors": (raw_header(b"[" * 100_000 + b"]" * 100_000), "nested too deeply"),
    "nested-metadata.safetensors": (
        raw_header(b'{"__metadata__": {"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}"),
        "nested too deeply",
    ),
    "huge-integer.safetensors": (raw_header(b'{"x": [' + b"9" * 100_000 + b"]}"), "not valid JSON"),
    "nested.gguf": (
        gguf_kv(struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 10_000),
        "nested deeper than 4",
    ),
    "huge-array.gguf": (gguf_kv(struct.pack("<IIQ", 9, 4, 2**62)), "does not fit"),
}


@pytest.mark.daemon_warns("malformed header")
def test_every_bad_file_is_one_warning_and_plain_bytes(tmp_path: Path) -> None:
    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "mixtral", layers=1, experts=8, hidden=128, inter=128, shards=2)
    for name, (blob, _) in CORPUS.items():
        (primary / name).write_bytes(blob)
    (primary / "zero-tensors.safetensors").write_bytes(st_file({"__metadata__": {"a": "b"}}))
    (primary / "dir.safetensors").mkdir()  # a directory with a model name: shown as a directory
    (primary / "loop.safetensors").symlink_to("loop.safetensors")  # a symlink loop: shown, not followed
    (primary / "mode000.safetensors").write_bytes(b"\x00")
    os.chmod(primary / "mode000.safetensors", 0)
    shutil.copytree(primary, mirror, symlinks=True)
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        lines = m.stderr.splitlines()
        st = m.stats()
        for name, (blob, reason) in CORPUS.items():
            shown = name.replace("\n", "\\n")
            hits = [x for x in lines if x.startswith(f"colifs: warning: {shown}: malformed header")]
            assert len(hits) == 1 and reason in hits[0], (name, lines)
            assert st["files"][name]["replicas"] == [str(primary)]
            assert (m.path / name).read_bytes() == blob
        assert st["files"]["zero-tensors.safetensors"]["note"] == ""  # valid: no tensor at all
        assert (m.path / "dir.safetensors").is_dir()
        assert os.readlink(m.path / "loop.safetensors") == "loop.safetensors"
        with pytest.raises(OSError):
            (m.path / "loop.safetensors").read_bytes()  # ELOOP from the kernel, no daemon trouble
        # Root reads mode-000 files (CAP_DAC_OVERRIDE): served like any other; as another user the
        # kernel (default_permissions) refuses it before the daemon is asked.
        assert (m.path / "mode000.safetensors").stat().st_mode & 0o777 == 0
        if os.geteuid() == 0:
            assert (m.path / "mode000.safetensors").read_bytes() == b"\x00"
        for p in sorted(primary.glob("model-*.safetensors")):  # the good files are still routed
            assert st["files"][p.name]["replicas"] == [str(primary), str(mirror)]
            assert (m.path / p.name).read_bytes() == p.read_bytes()
        assert all(r["bytes_served"] > 0 for r in m.stats()["replicas"])
        assert all("\n" not in w for w in st["recent_warnings"])


@pytest.mark.daemon_warns("receipt.json: unusable", "usage.json: not valid JSON")
def test_hostile_usage_file_and_receipt_are_one_warning_each(tmp_path: Path) -> None:
    from colifs.receipt import RECEIPT_NAME
    from colifs.usage import USAGE_NAME

    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "mixtral", layers=1, experts=8, hidden=128, inter=128, shards=2)
    shutil.copytree(primary, mirror)
    nested = b"[" * 100_000 + b"]" * 100_000
    (primary / USAGE_NAME).write_bytes(nested)
    (mirror / RECEIPT_NAME).write_bytes(nested)
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        lines = m.stderr.splitlines()
        usage = [x for x in lines if USAGE_NAME in x]
        receipt = [x for x in lines if RECEIPT_NAME in x]
        assert len(usage) == 1 and "nested too deeply" in usage[0] and "not updated this run" in usage[0]
        assert len(receipt) == 1 and "nested too deeply" in receipt[0] and "ignored" in receipt[0]
        for p in sorted(primary.glob("model-*.safetensors")):
            assert m.stats()["files"][p.name]["replicas"] == [str(primary), str(mirror)]
            assert (m.path / p.name).read_bytes() == p.read_bytes()
    assert (primary / USAGE_NAME).read_bytes() == nested  # left as it was: the user decides


def test_bad_input_is_one_line_and_a_specific_exit_code(model, tmp_path: Path) -> None:
    primary, mirror, mnt = model
    p, m, t = str(primary), str(mirror), str(mnt)
    refuse(["mount", str(tmp_path / "nope"), m, t], 32, "does not exist", mnt)
    refuse(["mount", str(primary / "config.json"), m, t], 32, "is not a directory", mnt)
    (tmp_path / "alias").symlink_to(primary)
    refuse(["mount", p, str(tmp_path / "alias"), t], 32, "are the same directory", mnt)
    refuse(["mount", p, m, str(primary / "sub")], 32, "does not exist")
    (primary / "inner").mkdir()
    refuse(["mount", p, m, str(primary / "inner")], 32, "is inside", primary / "inner")
    (mnt / "file").write_text("x")
    refuse(["mount", p, m, t], 32, "is not empty", mnt)
    (mnt / "file").unlink()
    refuse(["mount", p, m, t, "--weights", "1"], 2, "1 given, 2 replicas", mnt)
    refuse(["mount", p, m, t, "--weights", "1,0"], 2, "positive", mnt)
    refuse(["mount", p], 2, "PRIMARY [MIRROR ...] MOUNTPOINT")
    refuse(["umount", t], 3, "is not a colifs mount")
    refuse(["stats", t], 3, "is not a colifs mount")


def test_a_second_mount_on_the_same_mountpoint_is_refused(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt):
        refuse(["mount", str(primary), str(mirror), str(mnt)], 32, "already a mount point")
        assert np.frombuffer(read_direct(mnt / "config.json", 0, 10), np.uint8).size == 10
