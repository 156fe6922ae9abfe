"""Seeing what the mount does: xattrs, `colifs route`, `--prometheus`, `top`."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from colifs.formats import format_of
from colifs.formats.layout import ExpertKey
from tests.helpers import ROOT, mounted, read_direct, run_colifs

sys.path.insert(0, str(ROOT / "contrib" / "bench"))
from dual_drive import cpu_seconds

pytestmark = pytest.mark.mounts  # every test here runs on both engines


def test_replicas_xattr_lists_the_valid_copies(model) -> None:
    primary, mirror, mnt = model
    shards = sorted(primary.glob("*.safetensors"))
    (mirror / shards[1].name).unlink()  # a partial mirror
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        full = m.path / shards[0].name
        assert "user.colifs.replicas" in os.listxattr(full)
        assert os.getxattr(full, "user.colifs.replicas").decode() == f"primary {primary}\nmirror {mirror}\n"
        assert os.getxattr(m.path / shards[1].name, "user.colifs.replicas").decode() == f"primary {primary}\n"
        assert os.getxattr(m.path / "config.json", "user.colifs.replicas").decode() == f"primary {primary}\n"
        assert os.listxattr(m.path) == []  # directories have none


def test_route_names_tensor_key_and_the_drive_that_really_serves_it(model) -> None:
    primary, mirror, mnt = model
    shard = sorted(primary.glob("*.safetensors"))[0]
    fmt = format_of(shard.name)
    assert fmt is not None
    size, header, layout = fmt.read(str(shard))
    spans = fmt.spans(header, size)
    with mounted(primary, [mirror], mnt, "--weights", "1,1", "--routing", "expert") as m:
        f = m.path / shard.name
        seen = set()
        keys = [layout.keys[layout.pieces(s, s + 1)[0][2]] for s, _, _ in spans]
        for (start, end, name), key in zip(spans, keys, strict=True):
            block = -(-start // 4096) * 4096  # the first aligned offset inside the tensor
            if block >= end:
                continue  # a tensor smaller than the alignment gap
            ans = json.loads(os.getxattr(f, f"user.colifs.route.{block}"))  # what `colifs route` asks
            assert ans["tensor"] == name and ans["offset"] == block
            assert ans["key"] == (key._asdict() if isinstance(key, ExpertKey) else key)
            if block + 4096 <= end:  # only that drive reads this block
                before = [r["bytes_served"] for r in m.stats()["replicas"]]
                assert read_direct(f, block, 4096) == shard.read_bytes()[block : block + 4096]
                after = [r["bytes_served"] for r in m.stats()["replicas"]]
                grew = [i for i in range(2) if after[i] > before[i]]
                assert grew == [["primary", "mirror"].index(ans["drive"])], (name, ans)
                seen.add(ans["drive"])
        start, _, name = spans[len(spans) // 2]
        out = run_colifs("route", str(f), str(start), "--json")
        assert out.returncode == 0 and json.loads(out.stdout)["tensor"] == name
        assert seen == {"primary", "mirror"}  # both answers were checked against real reads
        text = run_colifs("route", str(f), "0x10").stdout
        assert "(header)" in text and "primary" in text
        keyed = dict(layout.keying)
        assert keyed and sum(keyed.values()) == len([s for s in spans if s[1] > s[0]])
        assert json.loads(out.stdout)["tensors_keyed"] == keyed  # why each tensor got its key
        assert "tensors keyed: " + ", ".join(f"{n} {why}" for why, n in keyed.items()) in text
        assert "not a model file" in run_colifs("route", str(m.path / "config.json"), "3").stdout
        past = run_colifs("route", str(f), str(size))
        assert past.returncode == 2 and "outside" in past.stderr
    off = run_colifs("route", str(shard), "100")
    assert off.returncode == 3 and "not a file on a colifs mount" in off.stderr


def test_prometheus_output_parses_and_matches_stats_json(model) -> None:
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        for p in sorted(primary.glob("*.safetensors")):
            (m.path / p.name).read_bytes()
        out = run_colifs("stats", str(m.path), "--prometheus")
        assert out.returncode == 0, out.stderr
        st = m.stats()
    families = {f.name: f for f in text_string_to_metric_families(out.stdout)}
    served = {s.labels["replica"]: s.value for s in families["colifs_served_bytes"].samples}
    assert served == {r["name"]: r["bytes_served"] for r in st["replicas"]}
    assert served["mirror"] > 0 and families["colifs_served_bytes"].type == "counter"
    (up,) = families["colifs_mirror_up"].samples
    assert up.value == 1 and up.labels["path"] == str(mirror)
    assert families["colifs_info"].samples[0].labels["routing"] == st["routing"]
    assert st["routing"] == {"native": "queue", "pyfuse3": "stripe"}[st["engine"]]  # the defaults
    layers = families["colifs_layer_routed_bytes"].samples
    assert {s.labels["layer"] for s in layers} == set(st["layers_routed_bytes"])
    (cpu,) = families["colifs_cpu_seconds"].samples  # rendered before st: at most st's figure
    assert 0 < cpu.value <= st["cpu"]["seconds"] and families["colifs_cpu_seconds"].type == "counter"
    shutil.rmtree(mnt, ignore_errors=True)


def test_stats_show_the_daemons_own_cpu_and_its_cost_per_gb_served(model) -> None:
    primary, mirror, mnt = model
    tick = 1.5 / os.sysconf("SC_CLK_TCK")
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        before = m.stats()
        for p in sorted(primary.glob("*.safetensors")):
            read_direct(m.path / p.name, 0, p.stat().st_size)
        low = cpu_seconds(before["pid"])
        st = m.stats()
        high = cpu_seconds(before["pid"])
    served = sum(r["bytes_served"] for r in st["replicas"])
    assert served > sum(r["bytes_served"] for r in before["replicas"])
    assert low - tick <= st["cpu"]["seconds"] <= high + tick  # the daemon's, not the reader's
    assert st["cpu"]["seconds"] >= before["cpu"]["seconds"]
    assert st["cpu"]["per_gb_served"] == pytest.approx(st["cpu"]["seconds"] / (served / 1e9), rel=1e-2)
    shutil.rmtree(mnt, ignore_errors=True)
