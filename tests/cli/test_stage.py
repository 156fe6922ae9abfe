"""A smaller second drive without a mount: plan from Colibrì's usage, stage safely (a full drive,
kill -9 anywhere), bad sizes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from colifs.plan import choose, estimate, survey
from colifs.receipt import RECEIPT_NAME
from colifs.stage import EXIT_SHORT, StageError, stage
from colifs.usage import Usage
from tests.helpers import (
    COLIFS,
    HOT,
    plan_json,
    run_colifs,
    sha,
    skewed_model,
    small_drive,
    snapshot,
)


def test_plan_from_colibri_usage(tmp_path: Path) -> None:
    primary, _, hot, _ = skewed_model(tmp_path)
    mirror = tmp_path / "m"
    mirror.mkdir()
    lines = ["-1 4 16", "-2 1 3"] + [f"{k.layer} {k.expert} 100" for k in hot]
    (primary / ".coli_usage").write_text("\n".join(lines) + "\n")
    plan = plan_json(primary, mirror, "--budget", str(sum((primary / n).stat().st_size for n in HOT)))
    assert ".coli_usage" in plan["usage"]
    assert sorted(r["shard"] for r in plan["shards"] if r["selected"]) == sorted(HOT)
    (primary / ".coli_usage").write_text("-2 9 3\n0 0 1\n")
    out = run_colifs("plan", str(primary), str(mirror), "--budget", "1G", "--weights", "1,1")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "version 9 is newer" in out.stderr


def test_stage_stops_cleanly_when_the_drive_fills(tmp_path: Path) -> None:
    primary, _, _, _ = skewed_model(tmp_path)
    with small_drive(tmp_path / "small", 4) as small:
        shards = survey(str(primary), str(small))
        choices = choose(
            estimate(shards, Usage()), 10**12, 10**12
        )  # as if the plan had been made with more space
        with pytest.raises(StageError) as e:
            stage(str(primary), str(small), choices, 1 << 20, True, lambda _: None)
        assert e.value.exit_code == EXIT_SHORT and "no receipt written" in str(e.value)
        left = sorted(os.listdir(small))
        assert left and RECEIPT_NAME not in left
        for name in left:  # what was placed is whole and right; nothing half-done under a final name
            assert sha(small / name) == sha(primary / name)
        st = os.statvfs(small)
        assert st.f_bavail * st.f_frsize >= 1 << 20  # the reserve was kept


def test_stage_killed_at_any_moment_leaves_nothing_partial_and_resumes(tmp_path: Path) -> None:
    primary, _, _, _ = skewed_model(tmp_path, hidden=1024, inter=512)  # ~100 MB: copies take a while
    mirror = tmp_path / "m"
    mirror.mkdir()
    before = snapshot(primary)
    budget = str(sum(p.stat().st_size for p in primary.glob("*.safetensors")) // 2)
    cmd = [*COLIFS, "stage", str(primary), str(mirror), "--budget", budget, "-q"]

    def sizes() -> dict[str, int]:
        out = {}
        for n in os.listdir(mirror):
            with contextlib.suppress(FileNotFoundError):  # a temporary renamed meanwhile
                out[n] = (mirror / n).stat().st_size
        return out

    kills = 0
    for delay in (0.0, 0.01, 0.03, 0.06, 0.1, 0.2):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        start = sizes()
        while proc.poll() is None and sizes() == start:  # killed mid-copy, whatever the machine's speed
            time.sleep(0.002)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        for name in os.listdir(mirror):  # after every kill: whatever has a final name is whole and right
            if name.endswith(".safetensors") and not name.startswith(".colifs-stage-"):
                assert sha(mirror / name) == sha(primary / name), (delay, name)
        if (mirror / RECEIPT_NAME).exists():  # the receipt only once everything it lists is in place
            for e in json.loads((mirror / RECEIPT_NAME).read_text())["shards"]:
                assert sha(mirror / e["path"]) == e["sha256"] == sha(primary / e["path"])
        assert snapshot(primary) == before
    assert kills >= 3  # the run really was interrupted, several times
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not [n for n in os.listdir(mirror) if n.startswith(".colifs-stage-")]  # temporaries cleaned
    receipt = json.loads((mirror / RECEIPT_NAME).read_text())
    assert {e["path"] for e in receipt["shards"]} == {n for n in os.listdir(mirror) if n != RECEIPT_NAME}
    assert run_colifs("verify", str(primary), str(mirror), "--deep", "-q").returncode == 0


def test_a_bad_size_is_a_usage_error(tmp_path: Path) -> None:
    out = run_colifs("plan", str(tmp_path), str(tmp_path), "--budget", "lots")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
