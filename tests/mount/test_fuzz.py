"""A short run of the request fuzzer (contrib/fuzz_mount.py) against a live mount of each engine:
the mount survives, every byte read is the primary's, every write is refused, the daemon stays
bounded. `python contrib/fuzz_mount.py --demo --seconds 600` is the long run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, mounted

pytestmark = pytest.mark.mounts

FUZZER = ROOT / "contrib" / "fuzz_mount.py"


def test_the_request_fuzzer_finds_nothing(model, tmp_path: Path) -> None:
    primary, mirror, mnt = model
    (primary / "sub").mkdir()
    (primary / "sub" / "notes.txt").write_bytes(bytes(range(256)) * 64)
    (mirror / "sub").mkdir()
    (mirror / "sub" / "notes.txt").write_bytes(bytes(range(256)) * 64)
    log = tmp_path / "daemon.log"
    with mounted(primary, [mirror], mnt, "--weights", "1,1", "--log-file", str(log)):
        args = ["--mount", str(mnt), "--primary", str(primary), "--seconds", "4", "--procs", "3"]
        cmd = [sys.executable, str(FUZZER), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        print(done.stdout)
        assert done.returncode == 0 and done.stdout.strip().endswith("PASS"), done.stdout + done.stderr
        assert "requests from 3 processes" in done.stdout
    assert "internal error" not in log.read_text()
