"""GGUF header parsing (pure): cross-checked against llama.cpp's own reader, bad input, real files."""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colifs.formats.gguf import parse_gguf, read_gguf_header
from colifs.formats.layout import DISAGREED, FUSED_CONFIG, ExpertKey, LayoutError
from colifs.synth import GGUF_ARCHS, write_gguf


def parse_file(path: Path):
    data = path.read_bytes()
    return read_gguf_header(lambda off, n: data[off : off + n], len(data))


def s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def build(
    tensors: list[tuple[str, list[int], int, int]],
    data_len: int,
    kvs: bytes = b"",
    n_kv: int = 0,
    version: int = 3,
    magic: bytes = b"GGUF",
    n_tensors: int | None = None,
    alignment: int = 32,
) -> bytes:
    """A GGUF file by hand: tensors are (name, dims, ggml type, offset)."""
    out = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors, n_kv) + kvs
    for name, dims, ttype, off in tensors:
        out += s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", ttype, off)
    out += b"\0" * (-len(out) % alignment)
    return out + bytes(data_len)


# -- against llama.cpp's reader ------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["F16", "F32", "Q8_0"])
@pytest.mark.parametrize("arch", sorted(GGUF_ARCHS))
def test_extents_match_gguf_reader(tmp_path: Path, arch: str, qtype: str) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(str(path), arch, layers=2, experts=8, hidden=64, inter=64, qtype=qtype)
    lay, header = parse_file(path)
    ref = gguf.GGUFReader(str(path))
    assert lay.data_start == ref.data_offset
    assert header == path.read_bytes()[: ref.data_offset]
    extents = set(zip(lay.keys, lay.starts, strict=True))
    for t in ref.tensors:
        if "_exps" in t.name or "_chexps" in t.name:
            step = t.n_bytes // 8
            for e in range(8):
                assert (ExpertKey("blk", int(t.name.split(".")[1]), e), t.data_offset + e * step) in extents
        else:
            assert (t.name, t.data_offset) in extents


def test_custom_alignment_and_expert_slices(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(str(path), "qwen3moe", layers=1, experts=4, qtype="F16", alignment=256)
    lay, _ = parse_file(path)
    assert lay.data_start % 256 == 0
    keys = [k for k in lay.keys if isinstance(k, ExpertKey)]
    assert sorted(set(keys)) == [ExpertKey("blk", 0, e) for e in range(4)]


# -- bad input -----------------------------------------------------------------------------------

GOOD = [("blk.0.ffn_down_exps.weight", [32, 4, 2], 0, 0)]  # F32 [2 experts × 4 × 32]: 1024 bytes


def test_hand_built_file_parses() -> None:
    blob = build(GOOD, 1024)
    lay = parse_gguf(blob, len(blob))
    assert lay.keys == (ExpertKey("blk", 0, 0), ExpertKey("blk", 0, 1))
    assert lay.starts == (lay.data_start, lay.data_start + 512)


def test_the_metadata_expert_count_decides() -> None:
    count = s("qwen3moe.expert_count") + struct.pack("<II", 4, 2)
    blob = build(GOOD, 1024, kvs=count, n_kv=1)
    lay = parse_gguf(blob, len(blob))
    assert lay.keys == (ExpertKey("blk", 0, 0), ExpertKey("blk", 0, 1))
    assert dict(lay.keying) == {FUSED_CONFIG: 1}
    count = s("qwen3moe.expert_count") + struct.pack("<II", 4, 8)  # the tensor holds 2
    blob = build(GOOD, 1024, kvs=count, n_kv=1)
    lay = parse_gguf(blob, len(blob))
    assert lay.keys == ("blk.0.ffn_down_exps.weight",) and lay.disagreed == ("blk.0.ffn_down_exps.weight",)
    assert dict(lay.keying) == {DISAGREED: 1}


BAD = {
    "magic": (build(GOOD, 1024, magic=b"GGML"), "bad magic"),
    "version 1": (build(GOOD, 1024, version=1), "version 1 is not supported"),
    "absurd tensor count": (
        build(GOOD, 1024, n_tensors=2**60),
        "tensor count 1152921504606846976 does not fit",
    ),
    "absurd string": (
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**62) + b"x" * 100,
        "string byte count 4611686018427387904 does not fit",
    ),
    "unknown value type": (
        build([], 0, kvs=s("general.x") + struct.pack("<I", 99), n_kv=1),
        "unknown metadata value type 99",
    ),
    "nested arrays": (
        build([], 0, kvs=s("general.x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 6, n_kv=1),
        "nested deeper than 4",
    ),
    "absurd array count": (
        build([], 0, kvs=s("general.x") + struct.pack("<IIQ", 9, 4, 2**61), n_kv=1),
        "array count 2305843009213693952 does not fit",
    ),
    "unknown ggml type": (build([("x", [32], 77, 0)], 128), "unknown ggml type 77"),
    "too many dims": (build([("x", [1, 1, 1, 1, 32], 0, 0)], 128), "5 dimensions"),
    "block": (build([("x", [33], 8, 0)], 128), "not a multiple of 32"),
    "past the end": (build(GOOD, 1000), "ends past the end"),
    "overlap": (build([("a", [32], 0, 0), ("b", [32], 0, 64)], 128), "overlaps"),
    "unaligned": (build([("a", [32], 0, 8)], 256), "not aligned"),
    "alignment": (
        build([], 0, kvs=s("general.alignment") + struct.pack("<II", 4, 48), n_kv=1),
        "not a power of two",
    ),
    "truncated in a tensor info": (build(GOOD, 1024)[:60], "past the end"),
    "truncated before the tensor infos": (build(GOOD, 1024)[:30], "tensor count 1 does not fit"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_headers_are_refused_with_a_reason(case: str) -> None:
    blob, reason = BAD[case]
    with pytest.raises(LayoutError, match=reason):
        read_gguf_header(lambda off, n: blob[off : off + n], len(blob))


def test_zero_tensors_with_data_start_past_the_end_is_valid() -> None:
    blob = build([], 0, kvs=s("general.name") + struct.pack("<I", 8) + s("vocab"), n_kv=1)
    blob = blob.rstrip(b"\0")  # the aligned data start now lies past the end of the file
    lay, header = read_gguf_header(lambda off, n: blob[off : off + n], len(blob))
    assert lay.starts == () and lay.data_start > len(blob) and header == blob


@settings(max_examples=300)
@given(st.binary(max_size=400))
def test_parser_never_raises_anything_but_layout_error(tail: bytes) -> None:
    blob = b"GGUF" + tail
    with contextlib.suppress(LayoutError):
        read_gguf_header(lambda off, n: blob[off : off + n], len(blob))


def test_a_string_array_ending_at_the_end_of_the_file_is_read_whole() -> None:
    # The first read (1 MiB) ends inside the last string, which ends at the end of the file.
    words = [b"w%d" % i for i in range(70_000)] + [b"x" * 200_000]
    arr = struct.pack("<IQ", 8, len(words)) + b"".join(struct.pack("<Q", len(w)) + w for w in words)
    blob = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + s("tokenizer.ggml.tokens") + struct.pack("<I", 9) + arr
    assert len(blob) - 200_000 < 1 << 20 < len(blob)
    lay, header = read_gguf_header(lambda off, n: blob[off : off + n], len(blob))
    assert header == blob and lay.starts == ()


def test_a_header_larger_than_the_first_read_is_read_in_steps() -> None:
    big = s("general.blob") + struct.pack("<I", 8) + s("x" * (3 << 20))
    blob = build(GOOD, 1024, kvs=big, n_kv=1)
    calls = []

    def read(off: int, n: int) -> bytes:
        calls.append((off, n))
        return blob[off : off + n]

    lay, header = read_gguf_header(read, len(blob))
    assert len(calls) > 1 and header == blob[: lay.data_start]


# -- files nobody here wrote ---------------------------------------------------------------------

VOCAB = os.environ.get("COLIFS_GGUF_VOCAB_DIR")


@pytest.mark.skipif(not VOCAB, reason="COLIFS_GGUF_VOCAB_DIR unset (make test sets it)")
def test_real_llama_cpp_vocab_files_parse_like_gguf_reader() -> None:
    files = sorted(Path(VOCAB).glob("ggml-vocab-*.gguf"), key=lambda p: p.stat().st_size)  # type: ignore[arg-type]
    assert len(files) >= 10, f"expected llama.cpp's vocab files in {VOCAB}"
    for path in files:  # every file parses; its header ends inside the file or at its padding
        lay, header = parse_file(path)
        assert len(header) == min(lay.data_start, path.stat().st_size) and lay.data_start > 24
    for path in files[:6]:  # GGUFReader builds numpy arrays of every vocabulary: ~5 s a file
        lay, header = parse_file(path)
        ref = gguf.GGUFReader(str(path))
        assert lay.data_start == ref.data_offset, path.name
        assert header == path.read_bytes()[: min(ref.data_offset, path.stat().st_size)]
        named = {k for k in lay.keys if isinstance(k, str) and k != "<padding>"}
        assert named <= {t.name for t in ref.tensors}, path.name


@pytest.mark.skipif(not VOCAB, reason="COLIFS_GGUF_VOCAB_DIR unset (make test sets it)")
def test_the_runnable_synthetic_model_is_a_whole_qwen3moe(tmp_path: Path) -> None:
    """What llama-decode.sh runs: llama.cpp's tensor set and metadata, a real tokenizer, experts
    keyed by the expert count in its metadata."""
    from colifs.synth import write_runnable_gguf

    path = tmp_path / "m.gguf"
    dims = {"layers": 2, "experts": 8, "used": 2, "hidden": 64, "inter": 32, "heads": 2, "kv_heads": 1}
    write_runnable_gguf(str(path), str(Path(VOCAB) / "ggml-vocab-qwen2.gguf"), head_dim=32, **dims)  # type: ignore[arg-type]
    ref = gguf.GGUFReader(str(path))
    assert ref.fields["general.architecture"].contents() == "qwen3moe"
    assert ref.fields["qwen3moe.expert_count"].contents() == 8
    assert len(ref.fields["tokenizer.ggml.tokens"].data) == 151936
    names = {t.name for t in ref.tensors}
    for L in range(2):
        want = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_gate_inp")
        assert {f"blk.{L}.{t}.weight" for t in want} <= names
    lay, _ = parse_file(path)
    assert dict(lay.keying)[FUSED_CONFIG] == 6  # gate, up, down in each of the 2 layers
    assert {k for k in lay.keys if isinstance(k, ExpertKey)} == {
        ExpertKey("blk", L, e) for L in range(2) for e in range(8)
    }
