"""Header parsing, tensor keys and offset → pieces splitting (pure; no mount)."""

from __future__ import annotations

import contextlib
import itertools
import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save

from colifs.formats.experts import tensor_key
from colifs.formats.layout import HEADER, ExpertKey, LayoutError
from colifs.formats.safetensors import parse_header


def header_of(blob: bytes) -> bytes:
    (n,) = struct.unpack("<Q", blob[:8])
    return blob[: 8 + n]


def raw_file(meta: dict, data: bytes = b"") -> bytes:
    text = json.dumps(meta).encode()
    return struct.pack("<Q", len(text)) + text + data


# -- keys ----------------------------------------------------------------------------------------

EXPERT_NAMES = {
    # DeepSeek-V3, Kimi-K2, Qwen3-MoE, GLM-4.5, OLMoE (+ FP8 / GPTQ / compressed-tensors suffixes)
    "model.layers.7.mlp.experts.42.down_proj.weight": ("model.layers", 7, 42),
    "model.layers.7.mlp.experts.42.down_proj.weight_scale_inv": ("model.layers", 7, 42),
    "model.layers.3.mlp.experts.0.gate_proj.qweight": ("model.layers", 3, 0),
    "model.layers.3.mlp.experts.0.gate_proj.scales": ("model.layers", 3, 0),
    "model.layers.3.mlp.experts.0.gate_proj.weight_packed": ("model.layers", 3, 0),
    "model.layers.61.mlp.experts.5.up_proj.weight": ("model.layers", 61, 5),  # DeepSeek MTP layer
    "mtp.layers.0.mlp.experts.5.up_proj.weight": ("mtp.layers", 0, 5),
    # Mixtral, MiniMax, Phi-3.5-MoE, Arctic
    "model.layers.0.block_sparse_moe.experts.7.w1.weight": ("model.layers", 0, 7),
    # Jamba
    "model.layers.1.feed_forward.experts.15.gate_proj.weight": ("model.layers", 1, 15),
    # ERNIE-4.5, Hunyuan, multimodal wrappers
    "ernie.layers.2.mlp.experts.3.up_gate_proj.weight": ("ernie.layers", 2, 3),
    "model.layers.2.mlp.experts.3.gate_and_up_proj.weight": ("model.layers", 2, 3),
    "model.language_model.layers.9.mlp.experts.1.down_proj.weight": ("model.language_model.layers", 9, 1),
}
NAME_KEYED = [
    "model.layers.3.mlp.shared_experts.down_proj.weight",
    "model.layers.3.mlp.shared_expert.down_proj.weight",
    "model.layers.3.mlp.shared_mlp.output_linear.weight",
    "model.layers.3.mlp.gate.weight",
    "model.layers.3.mlp.gate.e_score_correction_bias",
    "model.layers.3.self_attn.q_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
]


@pytest.mark.parametrize(("name", "key"), EXPERT_NAMES.items())
def test_expert_names_key_by_stack_layer_expert(name: str, key: tuple) -> None:
    assert tensor_key(name) == ExpertKey(*key)


@pytest.mark.parametrize("name", NAME_KEYED)
def test_other_tensors_key_by_name(name: str) -> None:
    assert tensor_key(name) == name


# -- layouts -------------------------------------------------------------------------------------


def test_layout_of_a_safetensors_file() -> None:
    blob = save(
        {
            "model.layers.0.mlp.experts.1.w.weight": np.zeros((4, 8), np.float16),
            "model.layers.0.mlp.experts.0.w.weight": np.zeros((2, 2), np.float32),
            "model.norm.weight": np.zeros(3, np.float32),
        }
    )
    lay = parse_header(header_of(blob), len(blob))
    assert lay.size == len(blob)
    assert len(lay.starts) == 3
    assert lay.starts[0] == lay.data_start
    sizes = np.diff([*lay.starts, lay.size]).tolist()
    by_key = dict(zip(lay.keys, sizes, strict=True))
    assert by_key[ExpertKey("model.layers", 0, 1)] == 64
    assert by_key[ExpertKey("model.layers", 0, 0)] == 16
    assert by_key["model.norm.weight"] == 12


@pytest.mark.parametrize(
    ("name", "shape", "dtype"),
    [
        ("model.layers.4.mlp.experts.gate_up_proj_blocks", (8, 6, 2, 16), np.uint8),  # gpt-oss
        ("model.layers.4.mlp.experts.down_proj_bias", (8, 6), np.float32),
        ("language_model.model.layers.4.feed_forward.experts.gate_up_proj", (8, 4, 6), np.float16),
        ("model.layers.4.block_sparse_moe.input_linear.weight", (8, 6, 4), np.float16),  # Granite
    ],
)
def test_fused_experts_are_cut_in_equal_slices(name: str, shape: tuple, dtype: type) -> None:
    blob = save({name: np.zeros(shape, dtype)})
    lay = parse_header(header_of(blob), len(blob))
    stack = name.split(".4.")[0]
    assert lay.keys == tuple(ExpertKey(stack, 4, e) for e in range(8))
    step = (len(blob) - lay.data_start) // 8
    assert lay.starts == tuple(lay.data_start + e * step for e in range(8))


def test_fused_name_with_uneven_bytes_stays_whole() -> None:
    blob = save({"model.layers.0.mlp.experts.gate_up_proj": np.zeros((1, 5), np.float16)})
    assert parse_header(header_of(blob), len(blob)).keys == ("model.layers.0.mlp.experts.gate_up_proj",)


def test_zero_tensors_and_zero_size_tensors() -> None:
    empty = raw_file({"__metadata__": {"a": "b"}})
    assert parse_header(empty, len(empty)).starts == ()
    assert list(parse_header(empty, len(empty)).extents()) == []
    blob = save({"a": np.zeros((0, 4), np.float32), "b": np.zeros(2, np.float32)})
    assert parse_header(header_of(blob), len(blob)).keys == ("b",)


def test_sub_byte_dtypes() -> None:
    f = raw_file({"x": {"dtype": "F4", "shape": [6], "data_offsets": [0, 3]}}, b"abc")
    assert parse_header(f, len(f)).keys == ("x",)


def json_file(text: bytes) -> bytes:
    """A file whose header is `text`, verbatim (what json.dumps would never write)."""
    return struct.pack("<Q", len(text)) + text


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


MALFORMED = {
    "short": (b"\x01\x02", "shorter than the 8-byte"),
    "past end": (struct.pack("<Q", 100) + b"{}", "past the end"),
    "too big": (struct.pack("<Q", 200_000_000) + b"{}", "over the 100000000-byte limit"),
    "utf8": (struct.pack("<Q", 2) + b"\xff\xfe", "not valid UTF-8"),
    "json": (struct.pack("<Q", 2) + b"{x", "not valid JSON"),
    "not object": (raw_file([1, 2]), "not an object"),  # type: ignore[arg-type]
    "fields": (raw_file({"x": {"dtype": "F32"}}), "lacks dtype, shape or data_offsets"),
    "dtype": (raw_file({"x": entry("F33", [1], 0, 4)}, b"abcd"), "unknown dtype"),
    "range": (raw_file({"x": entry("F32", [1], 0, 4)}, b"ab"), "past the end"),
    "overlap": (raw_file({"x": entry("F32", [2], 0, 8), "y": entry("F32", [1], 4, 8)}, b"a" * 8), "overlaps"),
    "gap": (raw_file({"x": entry("F32", [1], 0, 4), "y": entry("F32", [1], 8, 12)}, b"a" * 12), "gap"),
    "shape": (raw_file({"x": entry("F32", [3], 0, 4)}, b"abcd"), "do not match"),
    "trailing": (raw_file({"x": entry("F32", [1], 0, 4)}, b"abcdef"), "trailing bytes"),
    "negative": (raw_file({"x": entry("F32", [1], -4, 0)}), r"not \[begin, end\]"),
    "bool shape": (raw_file({"x": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"a"), "shape"),
    # hostile: what would crash a parser that trusts its input
    "nested": (json_file(b"[" * 100_000 + b"]" * 100_000), "nested too deeply"),
    "nested metadata": (
        json_file(b'{"__metadata__":' + b"[" * 10_000 + b"]" * 10_000 + b"}"),
        "nested too deeply",
    ),
    "huge integer": (json_file(b'{"x": [' + b"9" * 5000 + b"]}"), "not valid JSON"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_headers_are_refused_with_a_reason(case: str) -> None:
    blob, reason = MALFORMED[case]
    with pytest.raises(LayoutError, match=reason):
        parse_header(blob, len(blob))


@given(st.binary(max_size=300), st.integers(0, 10**12))
def test_parser_never_raises_anything_but_layout_error(blob: bytes, size: int) -> None:
    with contextlib.suppress(LayoutError):
        parse_header(blob, size)


# -- pieces --------------------------------------------------------------------------------------


@st.composite
def layouts(draw):
    n = draw(st.integers(0, 12))
    tensors = {}
    for i in range(n):
        expert = draw(st.integers(0, 3))
        name = f"model.layers.{i % 2}.mlp.experts.{expert}.w{i}.weight" if draw(st.booleans()) else f"t{i}"
        tensors[name] = np.zeros(draw(st.integers(0, 40)), np.uint8)
    blob = save(tensors)
    return parse_header(header_of(blob), len(blob))


@settings(max_examples=300)
@given(layouts(), st.data())
def test_pieces_cover_the_request_exactly_each_inside_one_extent(lay, data) -> None:
    off = data.draw(st.integers(0, lay.size + 5))
    end = data.draw(st.integers(off, lay.size + 50))
    pieces = lay.pieces(off, end)
    want_end = min(end, lay.size)
    if off >= want_end:
        assert pieces == []
        return
    assert pieces[0][0] == off and pieces[-1][1] == want_end
    for (_s0, e0, _), (s1, _, _) in itertools.pairwise(pieces):
        assert e0 == s1  # in order, no gap, no overlap
    bounds = [*lay.starts, lay.size]
    for start, stop, ext in pieces:
        assert start < stop
        if ext == HEADER:
            assert stop <= lay.data_start
        else:
            assert bounds[ext] <= start and stop <= bounds[ext + 1]


_PARTS = [
    "model",
    "layers",
    "mtp",
    "experts",
    "mlp",
    "weight",
    "0",
    "1",
    "17",
    "",
    "\n",
    "a\nb",
    "٣",
    "²",
    "e",
]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(_PARTS), min_size=1, max_size=9), st.sampled_from(["", ".", "x."]))
def test_tensor_key_is_exactly_the_reference_regex(parts: list[str], prefix: str) -> None:
    """The fast split-based tensor_key agrees with the regex it replaced, on odd names too."""
    from colifs.formats.experts import _PER_EXPERT, tensor_key
    from colifs.formats.layout import ExpertKey

    name = prefix + ".".join(parts)
    m = _PER_EXPERT.match(name)
    want = ExpertKey(m["stack"], int(m["layer"]), int(m["expert"])) if m else name
    assert tensor_key(name) == want


def test_key_sizes_of_a_file_without_tensors() -> None:
    """A valid zero-tensor file (it crashed the mount once, and key_sizes once more)."""
    from colifs.formats.safetensors import parse_header
    from colifs.usage import key_sizes

    text = json.dumps({"__metadata__": {"a": "b"}}).encode()
    layout = parse_header(struct.pack("<Q", len(text)) + text, 8 + len(text))
    assert layout.starts == () and key_sizes([layout]) == {}


_FEW = ["m", "1", "17", "experts", "", "a\nb", "٣"]  # dense in what makes an earlier `experts` win


@settings(max_examples=3000, deadline=None)
@given(
    st.lists(st.sampled_from(_FEW), min_size=1, max_size=7),
    st.lists(st.lists(st.sampled_from(_FEW), max_size=4), min_size=2, max_size=5),
)
def test_names_sharing_a_prefix_key_as_the_regex_does(prefix: list[str], rests: list[list[str]]) -> None:
    """Names that share what comes before their last `.experts.N.` (worked out once, then reused)
    still key exactly as the regex does, whatever follows."""
    from colifs.formats.experts import _PER_EXPERT, tensor_key
    from colifs.formats.layout import ExpertKey

    for n, rest in enumerate(rests):
        name = ".".join([*prefix, "experts", str(n * 7), *rest])
        m = _PER_EXPERT.match(name)
        want = ExpertKey(m["stack"], int(m["layer"]), int(m["expert"])) if m else name
        assert tensor_key(name) == want
