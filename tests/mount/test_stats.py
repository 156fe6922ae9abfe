"""Stats through a mount: current, shown by the CLI, reads in flight; $COLI_DISK_WEIGHTS honoured."""

from __future__ import annotations

import pytest

from tests.helpers import (
    mounted,
    read_direct,
    run_colifs,
    shards,
)

pytestmark = pytest.mark.mounts  # every test here runs on both engines


def test_stats_are_current_and_the_cli_shows_them(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "9,3") as m:
        line = (mnt / ".colifs" / "stats").read_text()
        zero = "MIRROR: primary 0.00 GB (0 reads) | mirror 0.00 GB (0 reads) | fallbacks 0"
        assert line.rstrip(" \n") == zero
        assert line.endswith("\n")  # after the spaces that keep its size steady (see test_boundary)
        s = shards(primary)[1]
        read_direct(mnt / s.name, 0, s.stat().st_size)
        line = (mnt / ".colifs" / "stats").read_text()
        st = m.stats()
        reads = [r["reads"] for r in st["replicas"]]
        assert f"primary {st['replicas'][0]['bytes_served'] / 1e9:.2f} GB ({reads[0]} reads)" in line
        assert sum(r["bytes_served"] for r in st["replicas"]) == s.stat().st_size
        assert [r["weight"] for r in st["replicas"]] == [9.0, 3.0]
        assert st["weights_source"] == "given (--weights)"
        assert "weights given (--weights): primary" in m.stderr
        out = run_colifs("stats", str(mnt))
        assert out.returncode == 0 and "primary" in out.stdout and "fallbacks 0" in out.stdout
        out = run_colifs("stats", str(mnt), "--json")
        assert out.returncode == 0 and '"replicas"' in out.stdout


def test_coli_disk_weights_is_honoured(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, env={"COLI_DISK_WEIGHTS": "5,2"}) as m:
        st = m.stats()
        assert [r["weight"] for r in st["replicas"]] == [5.0, 2.0]
        assert st["weights_source"] == "given ($COLI_DISK_WEIGHTS)"


def test_stats_show_reads_in_flight_per_drive(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        assert [r["in_flight"] for r in m.stats()["replicas"]] == [0, 0]  # idle: nothing queued
        p = shards(primary)[0]
        assert read_direct(mnt / p.name, 0, p.stat().st_size) == p.read_bytes()
        assert [r["in_flight"] for r in m.stats()["replicas"]] == [0, 0]  # every read accounted back
