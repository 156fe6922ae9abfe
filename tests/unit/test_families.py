"""Every MoE family's experts, keyed from its real checkpoint layout and its own config.

tests/families/*.json hold, for each family, config.json and the safetensors headers that
transformers' `save_pretrained` wrote for a tiny random model (contrib/gen_family_fixtures.py).
Here they become sparse zero-filled files, and each family's tensors are checked against what its
modeling code says is an expert (FAMILIES below: the README's table)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

from colifs.catalogue import validate
from colifs.formats import format_of
from colifs.formats.layout import DENSE_LAYER, DISAGREED, ExpertConfig, ExpertKey, Layout
from colifs.formats.moe import CONFIG_NAME, Configs, expert_count, moe_layers
from colifs.replicas import Replica
from colifs.routing import pick, positions
from tests.helpers import ROOT

FIXTURES = ROOT / "tests" / "families"


@dataclass(frozen=True)
class Experts:
    """Which tensors of a family are routed experts, and how: one tensor per expert (`per_expert`),
    fused [E, ...] (`fused`), or row-fused [E·rows, ...] (`row_fused`)."""

    pattern: str
    how: str = "per_expert"


PER_EXPERT_W = Experts(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")


PER_EXPERT_PROJ = Experts(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


FAMILIES: dict[str, Experts] = {
    "mixtral": PER_EXPERT_W,
    "phimoe": PER_EXPERT_W,
    "minimax": PER_EXPERT_W,
    "kimi_linear": PER_EXPERT_W,
    "qwen2_moe": PER_EXPERT_PROJ,
    "qwen3_moe": PER_EXPERT_PROJ,
    "qwen3_next": PER_EXPERT_PROJ,
    "olmoe": PER_EXPERT_PROJ,
    "ernie4_5_moe": PER_EXPERT_PROJ,
    "glm4_moe": PER_EXPERT_PROJ,
    "deepseek_v2": PER_EXPERT_PROJ,
    "deepseek_v3": PER_EXPERT_PROJ,
    "jamba": Experts(r"\.feed_forward\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "gpt_oss": Experts(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$", "fused"),
    "llama4": Experts(r"\.feed_forward\.experts\.(gate_up_proj|down_proj)$", "fused"),
    "granitemoe": Experts(r"\.block_sparse_moe\.(input|output)_linear\.weight$", "fused"),
    "jetmoe": Experts(r"\.(mlp|self_attention\.experts)\.(input|output)_linear\.weight$", "fused"),
    "dbrx": Experts(r"\.ffn\.experts\.mlp\.(w1|v1|w2)$", "row_fused"),
}


NAME = re.compile(r"^(?P<stack>.+?)\.(?P<layer>\d+)\.")


def load(family: str) -> dict:
    return json.loads((FIXTURES / f"{family}.json").read_text())


def build(fixture: dict, root: Path, config: dict | None = None) -> dict[str, dict]:
    """The family's files, sparse and zero-filled, under `root`; returns each file's header."""
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_NAME).write_text(json.dumps(fixture["config"] if config is None else config))
    for name, f in fixture["files"].items():
        text = json.dumps(f["header"]).encode()
        end = max((e["data_offsets"][1] for k, e in f["header"].items() if k != "__metadata__"), default=0)
        with open(root / name, "wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            out.truncate(8 + len(text) + end)
    return {name: f["header"] for name, f in fixture["files"].items()}


def layouts(root: Path, headers: dict[str, dict]) -> dict[str, Layout]:
    configs = Configs(str(root))
    out = {}
    for name in headers:
        fmt = format_of(name)
        assert fmt is not None
        out[name] = fmt.read(str(root / name), configs.experts_for(name))[2]
    return out


def expected(family: str, header: dict, data_start: int, n_experts: int) -> list[tuple[int, object]]:
    """(start, key) of every extent the family's modeling code implies, in file order."""
    rule = FAMILIES[family]
    out = []
    for name, e in sorted(
        header.items(), key=lambda kv: kv[1]["data_offsets"] if kv[0] != "__metadata__" else []
    ):
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        if end == begin:
            continue
        m = NAME.match(name)
        if not re.search(rule.pattern, name):
            out.append((data_start + begin, name))
        elif rule.how == "per_expert":
            expert = int(re.search(r"\.experts\.(\d+)\.", name)[1])  # type: ignore[index]
            out.append((data_start + begin, ExpertKey(m["stack"], int(m["layer"]), expert)))  # type: ignore[index]
        else:
            step = (end - begin) // n_experts
            for k in range(n_experts):
                out.append((data_start + begin + k * step, ExpertKey(m["stack"], int(m["layer"]), k)))  # type: ignore[index]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_is_keyed_exactly_from_its_config(family: str, tmp_path: Path) -> None:
    fixture = load(family)
    n_experts = expert_count(fixture["config"])
    assert n_experts == 4  # every fixture is built with 4 routed experts
    headers = build(fixture, tmp_path)
    found = 0
    for name, lay in layouts(tmp_path, headers).items():
        want = expected(family, headers[name], lay.data_start, n_experts)
        assert list(zip(lay.starts, lay.keys, strict=True)) == want, name
        assert sum(n for _, n in lay.keying) == sum(
            1
            for k, e in headers[name].items()
            if k != "__metadata__" and e["data_offsets"][1] > e["data_offsets"][0]
        )
        assert lay.disagreed == ()
        found += sum(isinstance(k, ExpertKey) for k in lay.keys)
    assert found > 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_moe_layer_splits_exactly_as_the_weights_say(family: str, tmp_path: Path) -> None:
    fixture = load(family)
    keys = [k for lay in layouts(tmp_path, build(fixture, tmp_path)).values() for k in lay.keys]
    where = positions(keys)
    per_layer: dict[tuple[str, int], list[int]] = {}
    for k in {k for k in keys if isinstance(k, ExpertKey)}:
        per_layer.setdefault((k.stack, k.layer), [0, 0])[pick(where[k], [3.0, 1.0])] += 1
    assert per_layer and all(split == [3, 1] for split in per_layer.values()), per_layer


def test_row_fused_experts_need_the_config(tmp_path: Path) -> None:
    """DBRX's [E·I, H] tensors: cut into E slices of I rows by the config, never into rows."""
    fixture = load("dbrx")
    config = dict(fixture["config"])
    config.pop("ffn_config")
    headers = build(fixture, tmp_path, config)
    for lay in layouts(tmp_path, headers).values():
        assert not any(isinstance(k, ExpertKey) for k in lay.keys)  # by name, not 128 "experts"


def test_without_a_config_fused_experts_are_cut_by_their_shape(tmp_path: Path) -> None:
    for family in ("gpt_oss", "granitemoe", "jetmoe", "mixtral"):
        fixture = load(family)
        headers = build(fixture, tmp_path / family)
        (tmp_path / family / CONFIG_NAME).unlink()
        for name, lay in layouts(tmp_path / family, headers).items():
            assert list(zip(lay.starts, lay.keys, strict=True)) == expected(
                family, headers[name], lay.data_start, 4
            )


def test_a_shape_that_disagrees_with_the_config_is_keyed_by_name_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fixture = load("gpt_oss")
    config = {**fixture["config"], "num_local_experts": 8}  # the tensors hold 4
    headers = build(fixture, tmp_path, config)
    (name,) = headers
    with caplog.at_level(logging.WARNING, logger="colifs"):
        f = validate(
            str(tmp_path / name), name, [Replica(0, str(tmp_path), 1.0)], format_of(name), ExpertConfig(8)
        )  # type: ignore[arg-type]
    assert f.layout is not None and not any(isinstance(k, ExpertKey) for k in f.layout.keys)
    assert dict(f.layout.keying)[DISAGREED] == 8  # gate_up_proj, down_proj and their biases, 2 layers
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and name in warnings[0] and "model.layers.0.mlp.experts" in warnings[0]


def test_routers_gates_shared_experts_and_norms_are_never_experts(tmp_path: Path) -> None:
    for family in FAMILIES:
        fixture = load(family)
        headers = build(fixture, tmp_path / family)
        for name, lay in layouts(tmp_path / family, headers).items():
            for start, key in zip(lay.starts, lay.keys, strict=True):
                if not isinstance(key, ExpertKey):
                    continue
                owner = max(
                    (lay.data_start + e["data_offsets"][0], n)
                    for n, e in headers[name].items()
                    if n != "__metadata__" and lay.data_start + e["data_offsets"][0] <= start
                )[1]
                assert not re.search(r"router|\.gate\.|shared_expert|norm", owner), (family, owner)


def test_the_nearest_config_decides(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / CONFIG_NAME).write_text('{"num_experts": 8}')
    (tmp_path / "a" / CONFIG_NAME).write_text('{"hidden_size": 64}')  # dense: states no experts
    configs = Configs(str(tmp_path))
    assert configs.experts_for("x.safetensors") == ExpertConfig(8)
    assert configs.experts_for("a/b/x.safetensors") is None
    shutil.rmtree(tmp_path / "a")
    assert Configs(str(tmp_path)).experts_for("a/b/x.safetensors") == ExpertConfig(8)
    assert expert_count({"text_config": {"num_local_experts": 16}}) == 16
    assert expert_count({"ffn_config": {"moe_num_experts": 16}}) == 16
    assert expert_count({"num_experts": None, "n_routed_experts": 256}) == 256
    assert expert_count({"num_experts_per_tok": 8}) is None


def quantized(fixture: dict, rename: dict[str, list[tuple[str, str, list[int]]]]) -> dict:
    """The fixture with tensors replaced as a quantised checkpoint stores them: each name matching
    a pattern of `rename` becomes the (suffix, dtype, shape) tensors given; offsets laid out anew."""
    from colifs.formats.safetensors import DTYPE_BITS

    files = {}
    for fname, f in fixture["files"].items():
        specs = []
        for name, e in sorted(
            ((n, e) for n, e in f["header"].items() if n != "__metadata__"),
            key=lambda x: x[1]["data_offsets"],
        ):
            hit = next((p for p in rename if re.search(p, name)), None)
            if hit is None:
                specs.append((name, e["dtype"], e["shape"]))
            else:
                specs.extend((re.sub(hit, suffix, name), dt, shape) for suffix, dt, shape in rename[hit])
        header, pos = {}, 0
        for name, dt, shape in specs:
            n = DTYPE_BITS[dt] // 8
            for d in shape:
                n *= d
            header[name] = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + n]}
            pos += n
        files[fname] = {"header": header}
    return {**fixture, "files": files}


def test_quantised_layouts_fp8_scales_and_mxfp4_blocks(tmp_path: Path) -> None:
    """DeepSeek-V3 FP8 (`weight` + `weight_scale_inv` per expert) and gpt-oss MXFP4 (fused
    `_blocks` and `_scales`, [E, ...]) key every piece of an expert to that expert."""
    ds = quantized(
        load("deepseek_v3"),
        {
            r"(experts\.\d+\.\w+_proj)\.weight$": [
                (r"\1.weight", "F8_E4M3", [32, 64]),
                (r"\1.weight_scale_inv", "F32", [1, 1]),
            ]
        },
    )
    oss = quantized(
        load("gpt_oss"),
        {
            r"experts\.gate_up_proj$": [
                ("experts.gate_up_proj_blocks", "U8", [4, 64, 2, 16]),
                ("experts.gate_up_proj_scales", "U8", [4, 64, 2]),
            ],
            r"experts\.down_proj$": [
                ("experts.down_proj_blocks", "U8", [4, 64, 1, 16]),
                ("experts.down_proj_scales", "U8", [4, 64, 1]),
            ],
        },
    )
    for family, fixture in (("deepseek_v3", ds), ("gpt_oss", oss)):
        headers = build(fixture, tmp_path / family)
        pattern = r"(_scale_inv|_blocks|_scales|_bias)$"
        assert any(re.search(pattern, n) for h in headers.values() for n in h)
        for name, lay in layouts(tmp_path / family, headers).items():
            keyed = dict(zip(lay.starts, lay.keys, strict=True))
            for tensor, e in headers[name].items():
                start = lay.data_start + e["data_offsets"][0]
                if re.search(r"experts\.\d+\.", tensor):
                    assert isinstance(keyed[start], ExpertKey), tensor
                elif re.search(r"\.mlp\.experts\.(gate_up|down)_proj", tensor):
                    step = (e["data_offsets"][1] - e["data_offsets"][0]) // 4
                    assert [keyed[start + k * step] for k in range(4)] == [
                        ExpertKey("model.layers", int(tensor.split(".")[2]), k) for k in range(4)
                    ], tensor


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_moe_layers_a_config_states_are_where_the_experts_are(family: str) -> None:
    fixture = load(family)
    held = {
        int(NAME.match(n)["layer"])  # type: ignore[index]
        for f in fixture["files"].values()
        for n in f["header"]
        if re.search(FAMILIES[family].pattern, n)
    }
    stated = moe_layers(fixture["config"])
    assert stated is None or stated == held, (stated, held)


def test_moe_layer_placement_of_real_configs() -> None:
    assert moe_layers(
        {"n_routed_experts": 256, "num_hidden_layers": 61, "first_k_dense_replace": 3}
    ) == frozenset(range(3, 61))
    qwen2 = {"num_experts": 60, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [5]}
    assert moe_layers(qwen2) == {1, 3}
    assert moe_layers(
        {"num_experts": 16, "num_hidden_layers": 8, "expert_layer_period": 2, "expert_layer_offset": 1}
    ) == {1, 3, 5, 7}
    assert moe_layers(
        {"text_config": {"num_local_experts": 128, "num_hidden_layers": 4, "interleave_moe_layer_step": 2}}
    ) == {1, 3}
    assert moe_layers(
        {
            "num_local_experts": 16,
            "num_hidden_layers": 4,
            "moe_layers": [0, 2],
            "interleave_moe_layer_step": 1,
        }
    ) == {0, 2}
    ernie = {
        "moe_num_experts": 64,
        "num_hidden_layers": 6,
        "moe_layer_start_index": 1,
        "moe_layer_end_index": 4,
        "moe_layer_interval": 1,
    }
    assert moe_layers(ernie) == {1, 2, 3, 4}
    assert moe_layers({"num_local_experts": 8, "num_hidden_layers": 32}) is None  # every layer
    assert moe_layers({"hidden_size": 64}) is None


def test_a_fused_expert_tensor_in_a_layer_the_config_makes_dense_is_keyed_by_name(tmp_path: Path) -> None:
    fixture = load("granitemoe")
    headers = build(fixture, tmp_path, {**fixture["config"], "moe_layers": [1]})
    (lay,) = layouts(tmp_path, headers).values()
    layers = {k.layer for k in lay.keys if isinstance(k, ExpertKey)}
    assert layers == {1} and dict(lay.keying)[DENSE_LAYER] == 2
    assert all(".0." in n for n in lay.disagreed) and len(lay.disagreed) == 2


def test_a_hostile_config_is_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / CONFIG_NAME).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with caplog.at_level(logging.WARNING, logger="colifs"):
        assert Configs(str(tmp_path)).experts_for("x.safetensors") is None
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "config.json: unusable (nested too deeply)" in warning
