"""A smaller second drive with a mount: stage what real usage asks for, verify, and routing that
knows the mirror is partial."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from colifs.receipt import RECEIPT_NAME
from colifs.stage import EXIT_DIFFERS
from tests.helpers import (
    HOT,
    is_mounted,
    learn_usage,
    mounted,
    plan_json,
    read_experts,
    run_colifs,
    sha,
    skewed_model,
    small_drive,
    snapshot,
)


def test_plan_picks_the_hot_shards_within_budget_and_reserve(tmp_path: Path) -> None:
    primary, ranges, hot, cold = skewed_model(tmp_path)
    mirror = tmp_path / "m"
    mirror.mkdir()
    even = plan_json(primary, mirror, "--budget", "3M")
    assert "no usage history" in even["usage"]
    learn_usage(primary, ranges, hot, cold, tmp_path / "mnt")
    hot_bytes = sum((primary / n).stat().st_size for n in HOT)
    plan = plan_json(primary, mirror, "--budget", str(hot_bytes))
    assert "usage history" in plan["usage"] and "1 run" in plan["usage"]
    assert sorted(r["shard"] for r in plan["shards"] if r["selected"]) == sorted(HOT)
    assert plan["bytes_to_copy"] <= hot_bytes and plan["coverage"] > 0.6
    assert plan["predicted_speedup"] == pytest.approx(2.0)  # 1:1 weights, coverage over a half
    assert plan["shards"][0]["shard"] in HOT  # ordered by traffic per byte
    with small_drive(tmp_path / "small", 8) as small:
        free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
        shard = (primary / HOT[0]).stat().st_size
        tight = plan_json(primary, small, "--budget", "1T", "--reserve", str(free - shard - 4096))
        assert [r["shard"] for r in tight["shards"] if r["selected"]] == [HOT[0]]  # only one fits
        none = plan_json(primary, small, "--budget", "1T", "--reserve", str(free))
        assert not any(r["selected"] for r in none["shards"])


@pytest.mark.daemon_warns("served without this mirror")
@pytest.mark.mounts
def test_stage_copies_the_plan_resumes_and_verify_deep_catches_one_byte(tmp_path: Path) -> None:
    primary, ranges, hot, cold = skewed_model(tmp_path)
    mirror = tmp_path / "m"
    mirror.mkdir()
    learn_usage(primary, ranges, hot, cold, tmp_path / "mnt")
    before = snapshot(primary)
    budget = str(sum((primary / n).stat().st_size for n in HOT))
    out = run_colifs("stage", str(primary), str(mirror), "--budget", budget)
    assert out.returncode == 0, out.stderr
    assert "staged 2 shard(s)" in out.stdout and "copying:" in out.stderr  # progress on stderr
    assert sorted(os.listdir(mirror)) == sorted([*HOT, RECEIPT_NAME])
    receipt = json.loads((mirror / RECEIPT_NAME).read_text())
    assert [e["path"] for e in receipt["shards"]] == sorted(HOT)
    for e in receipt["shards"]:
        assert e["sha256"] == sha(primary / e["path"]) == sha(mirror / e["path"])
        assert e["primary_mtime_ns"] == (primary / e["path"]).stat().st_mtime_ns
    again = run_colifs("stage", str(primary), str(mirror), "--budget", budget, "-q")
    said = [line for line in again.stderr.splitlines() if "not checked" not in line]  # other tests' mounts
    assert again.returncode == 0 and "staged 0 shard(s)" in again.stdout and len(said) == 1, again.stderr
    assert snapshot(primary) == before  # the primary is never touched
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        files = m.stats()["files"]
        assert {n for n, f in files.items() if f["vouched_by_receipt"] == [str(mirror)]} == set(HOT)
        assert "SHA-256-checked" in os.getxattr(m.path / HOT[0], "user.colifs.replicas").decode()
    os.utime(mirror / HOT[0])  # touched since the receipt: no longer vouched for (still used)
    with mounted(primary, [mirror], tmp_path / "mnt", "--weights", "1,1") as m:
        files = m.stats()["files"]
        assert files[HOT[0]]["vouched_by_receipt"] == [] and files[HOT[0]]["replicas"] == [
            str(primary),
            str(mirror),
        ]
        assert files[HOT[1]]["vouched_by_receipt"] == [str(mirror)]
    ok = run_colifs("verify", str(primary), str(mirror), "--deep", "-q")
    assert ok.returncode == 0 and "2 ok" in ok.stdout and "6 missing" in ok.stdout
    target = mirror / HOT[1]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 1
    stamp = target.stat().st_mtime_ns
    target.write_bytes(bytes(data))
    os.utime(target, ns=(stamp, stamp))  # mtime restored: only the data can tell
    fast = run_colifs("verify", str(primary), str(mirror))
    assert fast.returncode == 0 and "data differs" not in fast.stdout
    deep = run_colifs("verify", str(primary), str(mirror), "--deep", "--json", "-q")
    assert deep.returncode == EXIT_DIFFERS
    rows = {r["relpath"]: r["status"] for r in json.loads(deep.stdout)}
    assert rows[HOT[1]] == "data differs" and rows[HOT[0]] == "ok"
    (mirror / "model-00009-of-00008.safetensors").write_bytes(b"x")
    extra = run_colifs("verify", str(primary), str(mirror))
    assert "extra (not on the primary)" in extra.stdout


@pytest.mark.daemon_warns("served without this mirror")
@pytest.mark.mounts
def test_partial_mirror_routing_moves_the_byte_split_toward_the_weights(tmp_path: Path) -> None:
    primary, ranges, hot, cold = skewed_model(tmp_path, hidden=128, inter=64, experts=64)
    mirror = tmp_path / "m"
    mirror.mkdir()
    for name in HOT:
        (mirror / name).write_bytes((primary / name).read_bytes())
    usage = tmp_path / "usage.json"
    shares = []
    for _ in range(2):
        with mounted(
            primary, [mirror], tmp_path / "mnt", "--weights", "1,1", "--usage-file", str(usage)
        ) as m:
            read_experts(m.path, ranges, hot, times=10)
            read_experts(m.path, ranges, cold)
            st = m.stats()
            mirror_bytes = st["replicas"][1]["bytes_served"]
            shares.append(mirror_bytes / (mirror_bytes + st["replicas"][0]["bytes_served"]))
            partial = st["partial_mirror"]
    print(f"\nmirror byte share: plain {shares[0]:.3f}, with usage history {shares[1]:.3f}; {partial}")
    assert not is_mounted(tmp_path / "mnt")
    plain, informed = shares
    # plain weights give the mirror only half of the traffic it holds; with the history it gets
    # enough of it for the bytes to split 1:1
    assert abs(informed - 0.5) < abs(plain - 0.5) and abs(informed - 0.5) < 0.05, shares
    assert partial["predicted_byte_share"][1] == pytest.approx(informed, abs=0.05)
    assert (
        partial["coverage"][1] > 0.6
        and partial["weights_for_held_files"][1] > partial["weights_for_held_files"][0]
    )


@pytest.mark.daemon_warns("served without this mirror")
@pytest.mark.mounts
def test_two_partial_mirrors_split_the_bytes_as_the_weights_say(tmp_path: Path) -> None:
    primary, ranges, hot, cold = skewed_model(tmp_path, hidden=128, inter=64, experts=64)
    m1, m2 = tmp_path / "m1", tmp_path / "m2"
    for mirror, names in ((m1, [HOT[0]]), (m2, [HOT[1], "model-00001-of-00008.safetensors"])):
        mirror.mkdir()
        for name in names:
            (mirror / name).write_bytes((primary / name).read_bytes())
    usage = tmp_path / "usage.json"
    learn_usage(primary, ranges, hot, cold, tmp_path / "mnt", "--usage-file", str(usage))
    with mounted(primary, [m1, m2], tmp_path / "mnt", "--weights", "2,1,1", "--usage-file", str(usage)) as m:
        read_experts(m.path, ranges, hot, times=10)
        read_experts(m.path, ranges, cold)
        st = m.stats()
        table = run_colifs("stats", str(m.path)).stdout
        assert "byte split expected 50.0% / 25.0% / 25.0%" in table and "usage: " in table
    served = [r["bytes_served"] for r in st["replicas"]]
    actual = [b / sum(served) for b in served]
    predicted = st["partial_mirror"]["predicted_byte_share"]
    print(f"\nthree drives 2:1:1, partial mirrors: predicted {predicted}, actual {actual}")
    assert predicted == pytest.approx([0.5, 0.25, 0.25], abs=0.01)  # reachable, so reached
    assert actual == pytest.approx(predicted, abs=0.06)
    plain = st["partial_mirror"]["plain_byte_share"]
    assert plain[1] < 0.2 and plain[2] < 0.2  # what plain weights would have given the mirrors
