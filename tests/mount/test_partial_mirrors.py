"""Partial and divergent mirrors: a missing or different copy, a malformed header: served from the
primary."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest

from colifs.synth import write_checkpoint
from tests.helpers import (
    mounted,
    read_direct,
    shards,
)

pytestmark = pytest.mark.mounts  # every test here runs on both engines


@pytest.mark.daemon_warns("served without this mirror")
def test_partial_and_divergent_mirror_files_are_served_from_the_primary(tmp_path: Path) -> None:
    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "deepseek", layers=3, experts=8, hidden=64, inter=64, shards=4)
    shutil.copytree(primary, mirror)
    s1, s2, s3, s4 = (p.name for p in shards(primary))
    (mirror / s1).unlink()  # missing
    blob = bytearray((mirror / s2).read_bytes())  # same size, header differs
    i = blob.index(b'"pt"')
    blob[i + 1 : i + 3] = b"PT"
    (mirror / s2).write_bytes(blob)
    with open(mirror / s3, "ab") as f:  # size differs
        f.write(b"x")
    (mirror / "extra.safetensors").write_bytes(b"ignored")
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        for name, reason in ((s2, "header differs"), (s3, "size differs")):
            line = next(x for x in m.stderr.splitlines() if name in x)
            assert "warning" in line and str(mirror) in line and reason in line
        assert s1 not in m.stderr  # missing: a partial mirror, counted in the summary line
        assert f"mirror {mirror} (weight 1, 1/4 model files)" in m.stderr
        st = m.stats()
        assert st["files"][s4] == {
            "replicas": [str(primary), str(mirror)],
            "vouched_by_receipt": [],
            "note": "",
            "tensors_keyed": {"by name": 9, "expert, by its name": 48},
        }
        for name, reason in ((s1, "missing"), (s2, "header differs"), (s3, "size differs")):
            assert st["files"][name]["replicas"] == [str(primary)]
            assert reason in st["files"][name]["note"]
        assert "extra.safetensors" not in st["files"]
        assert not (m.path / "extra.safetensors").exists()
        for name in (s1, s2, s3):
            want = (primary / name).read_bytes()
            assert read_direct(m.path / name, 0, len(want)) == want
        assert m.stats()["replicas"][1]["bytes_served"] == 0  # nothing came from the bad copies
        want = (primary / s4).read_bytes()
        assert read_direct(m.path / s4, 0, len(want)) == want
        assert m.stats()["replicas"][1]["bytes_served"] > 0


@pytest.mark.daemon_warns("malformed header")
def test_malformed_primary_header_is_served_as_plain_bytes(model) -> None:
    primary, mirror, mnt = model
    bad = primary / "broken.safetensors"
    bad.write_bytes(struct.pack("<Q", 10**9) + b"{}" + os.urandom(1000))
    shutil.copy(bad, mirror / bad.name)
    with mounted(primary, [mirror], mnt) as m:
        line = next(x for x in m.stderr.splitlines() if "broken.safetensors" in x)
        assert "malformed header" in line and "over the 100000000-byte limit" in line
        assert (mnt / bad.name).read_bytes() == bad.read_bytes()
        assert m.stats()["files"]["broken.safetensors"]["replicas"] == [str(primary)]
        good = shards(primary)[0]
        assert read_direct(mnt / good.name, 0, good.stat().st_size) == good.read_bytes()
