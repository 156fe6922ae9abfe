"""The startup probe (`colifs probe` and the mount's own) and the kernel knobs a mount sets."""

from __future__ import annotations

import os

import pytest

from tests.helpers import (
    mounted,
    refuse,
    run_colifs,
)

pytestmark = pytest.mark.mounts  # every test here runs on both engines


def test_without_weights_the_mount_probes_each_drive(model) -> None:
    """The suite's copies are directories on one filesystem: probed one at a time, each measured
    the whole drive, so they share its figure (one warning), and the weights split it evenly."""
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--probe-seconds", "0.5") as m:
        st = m.stats()
        assert st["weights_source"] == "probed"
        assert [p["path"] for p in st["probe"]] == [str(primary), str(mirror)]
        rates = [p["mb_per_s"] for p in st["probe"]]
        assert all(r > 0 for r in rates)
        half = float(f"{max(rates) / 2:.3g}")
        assert [r["weight"] for r in st["replicas"]] == [half, half]
        assert "probe: suggested: --weights" in m.stderr
        assert m.stderr.count("are on one drive") == 1, m.stderr


def test_given_weights_stay_and_the_native_engine_still_times_the_drives(model, engine: str) -> None:
    """--weights: the split is the user's, but a short probe times the drives for what the native
    engine decides from their speed (the readahead, fills, passthrough) from the first open."""
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "3,1") as m:
        st = m.stats()
        assert st["weights_source"] == "given (--weights)"
        assert [r["weight"] for r in st["replicas"]] == [3.0, 1.0]
        if engine == "pyfuse3":
            assert st["probe"] == [] and "probe:" not in m.stderr
            return
        assert [p["path"] for p in st["probe"]] == [str(primary), str(mirror)], st["probe"]
        assert all(p["mb_per_s"] > 0 and p["seconds"] < 1.0 for p in st["probe"]), st["probe"]
        assert "suggested: --weights" not in m.stderr
        if os.geteuid() == 0:  # the readahead is set through sysfs
            assert "probed at" in st["kernel"]["read_ahead_chosen"], st["kernel"]


@pytest.mark.parametrize("routing", ["stripe", "queue"])
def test_no_probe_means_equal_weights(model, engine: str, routing: str) -> None:
    """Weights given (here: equal) and copies on one drive: still one warning that says so; and
    the weights do not follow the copies' measured rates, which are that one drive's load."""
    if routing == "queue" and engine == "pyfuse3":
        pytest.skip("--routing queue is the native engine's")
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--no-probe", "--routing", routing) as m:
        st = m.stats()
        assert st["weights_source"] == "default (equal)" and st["probe"] == []
        assert [r["weight"] for r in st["replicas"]] == [1.0, 1.0]
        assert m.stderr.count("are on one drive") == 1, m.stderr
        assert not st["balance"]["adaptive"]  # stripe routing's default, but not on one drive


def test_probe_command_prints_a_table_and_suggested_weights(model) -> None:
    primary, mirror, _ = model
    out = run_colifs("probe", str(primary), str(mirror), "--seconds", "0.3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["replica", "path", "MB/s"]
    assert lines[1].startswith("primary") and lines[2].startswith("mirror")
    assert lines[1].endswith("one drive with mirror 1") and lines[2].endswith("one drive with the primary")
    assert lines[3].startswith("suggested: --weights ")
    a, b = lines[3].split()[-1].split(",")
    assert a == b, lines  # one drive: its figure split evenly
    assert "are on one drive" in out.stderr
    refuse(["probe", str(primary / "nope")], 2, "does not exist")


@pytest.mark.skipif(os.geteuid() != 0, reason="sysfs knobs need root")
def test_kernel_knobs_are_set_and_reported(model) -> None:
    primary, mirror, mnt = model
    with mounted(
        primary, [mirror], mnt, "--no-probe", "--readahead-kb", "1024", "--max-background", "32"
    ) as m:
        assert m.stats()["kernel"] == {
            "read_ahead_kb": 1024,
            "max_background": 32,
            "congestion_threshold": 24,
            "read_ahead_chosen": "given",
        }
    with mounted(primary, [mirror], mnt, "--no-probe", "--readahead-kb", "0", "--max-background", "0") as m:
        kernel = m.stats()["kernel"]
        assert kernel["read_ahead_kb"] not in (None, 1024, 4096) and kernel["max_background"] == 12
