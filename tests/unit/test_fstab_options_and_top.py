"""Fitting where users are, the pure parts: fstab options → colifs flags, a `colifs top` frame."""

from __future__ import annotations

import pytest

from colifs.errors import UsageError
from colifs.fstab import mount_args, parse_argv
from colifs.top import render


def test_fstab_options_become_colifs_flags() -> None:
    assert mount_args(
        "/fast/m:/second/m", "/mnt/model", "ro,weights=9:3,allow_other,nofail,x-systemd.after=a"
    ) == [
        "/fast/m",
        "/second/m",
        "/mnt/model",
        "--weights",
        "9,3",
        "--allow-other",
    ]
    assert mount_args(
        "/a", "/m", "defaults,no_probe,mirror_timeout=2,usage_file=/var/u.json,routing=expert"
    ) == [
        "/a",
        "/m",
        "--no-probe",
        "--mirror-timeout",
        "2",
        "--usage-file",
        "/var/u.json",
        "--routing",
        "expert",
    ]
    # every `colifs mount` option, the newest included (the helper reads them from the parser)
    assert mount_args("/a", "/m", "engine=pyfuse3,fuse_threads=4,debug") == [
        "/a",
        "/m",
        "--engine",
        "pyfuse3",
        "--fuse-threads",
        "4",
        "--debug",
    ]
    with pytest.raises(UsageError, match="unknown option 'foreground'"):
        mount_args("/a", "/m", "foreground")
    assert parse_argv(["/a:/b", "/m", "-o", "ro,weights=1:1", "-n", "-t", "fuse.colifs"]) == (
        "/a:/b",
        "/m",
        "ro,weights=1:1",
        False,
    )
    assert parse_argv(["/a", "/m", "-fv", "-oro"])[3] is True  # mount -f: fake, nothing mounted
    for bad, reason in [
        ("weight=1:1", "unknown option"),
        ("weights", "needs a value"),
        ("debug=1", "takes no"),
    ]:
        with pytest.raises(UsageError, match=reason):
            mount_args("/a:/b", "/m", bad)
    with pytest.raises(UsageError, match="usage"):
        parse_argv(["/a"])


def _stats(served: list[int], fallbacks: int, layers: dict, health: dict | None = None) -> dict:
    total = sum(served) or 1
    reps = []
    for i, b in enumerate(served):
        r = {
            "name": ["primary", "mirror"][i],
            "path": f"/d{i}",
            "bytes_served": b,
            "byte_share": b / total,
            "weight_share": 0.5,
            "in_flight": 0,
            "read_errors": 0,
        }
        if i:
            r["health"] = health or {"state": "up", "timeouts": 0}
        reps.append(r)
    return {
        "mountpoint": "/mnt/x",
        "uptime_s": 10.0,
        "routing": "stripe",
        "weights_source": "given",
        "balance": {
            "adaptive": True,
            "measured_mb_per_s": [912.0, None],
            "last_change": {"at": None},
        },
        "replicas": reps,
        "fallbacks": fallbacks,
        "layers_routed_bytes": layers,
    }


def test_top_frame_shows_rates_shares_health_and_hot_layers() -> None:
    prev = _stats([0, 0], 0, {"model.layers.1": [0, 0]})
    down = {
        "state": "down",
        "timeouts": 3,
        "down_for_s": 4.0,
        "next_check_in_s": 2.0,
        "last_error": "timeout at 0: no answer within 5 s",
    }
    cur = _stats(
        [30_000_000, 10_000_000],
        7,
        {"model.layers.1": [5_000_000, 0], "model.layers.2": [9_000_000, 1]},
        down,
    )
    frame = render(prev, cur, 2.0)
    rows = frame.splitlines()
    assert rows[2].split()[:5] == ["primary", "-", "15.0", "3.0", "75.0%"]
    assert rows[3].split()[:5] == ["mirror", "down", "5.0", "1.0", "25.0%"]
    assert "next check in 2.0 s: timeout at 0: no answer within 5 s" in rows[4]
    assert "fallbacks 7 (3.5/s now)" in frame
    assert rows[0].endswith("weights given, adaptive (measured 912 / ? MB/s, no change yet)")
    assert frame.rstrip().endswith("model.layers.2 4.5 MB/s, model.layers.1 2.5 MB/s")
    assert "daemon CPU" not in frame  # an older daemon's stats.json: no cpu figures


def test_top_frame_shows_the_daemons_cpu_now_and_per_gb_served() -> None:
    prev = {**_stats([0, 0], 0, {}), "cpu": {"seconds": 1.0, "per_gb_served": None}}
    cur = {**_stats([3_000_000_000, 1_000_000_000], 0, {}), "cpu": {"seconds": 5.4, "per_gb_served": 1.35}}
    assert "daemon CPU 2.20 cores now, 1.10 s per GB served now, 1.35 since mount" in render(prev, cur, 2.0)
    assert "daemon CPU 0.00 cores now, - s per GB served now, 1.35 since mount" in render(cur, cur, 2.0)
