"""Synthetic MoE checkpoints with real tensor names, written with safetensors' own writer.

Used by `make demo`, the tests and the benchmarks: no model has to be downloaded. Every family
uses the naming its real checkpoints use, so the routing keys are the real ones.

    python -m colifs.synth DIR [--family deepseek] [--layers 4] [--experts 16] [--hidden 256] ...
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterator

import numpy as np

Tensor = tuple[str, str, tuple[int, ...]]  # name, numpy dtype, shape
FAMILIES: dict[str, Callable[[int, int, int, int], Iterator[Tensor]]] = {}


def family(name: str):
    def register(fn: Callable[[int, int, int, int], Iterator[Tensor]]):
        FAMILIES[name] = fn
        return fn

    return register


def _dense(prefix: str, h: int) -> Iterator[Tensor]:
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        yield f"{prefix}.self_attn.{proj}.weight", "float16", (h, h)
    yield f"{prefix}.input_layernorm.weight", "float32", (h,)


@family("deepseek")  # DeepSeek-V3 / Kimi-K2 / GLM-4.5: FP8 experts with block scales, shared experts, MTP
def _deepseek(layers: int, experts: int, h: int, i: int) -> Iterator[Tensor]:
    yield "model.embed_tokens.weight", "float16", (256, h)
    for stack, n in (("model.layers", layers), ("mtp.layers", 1)):
        for L in range(n):
            p = f"{stack}.{L}"
            yield from _dense(p, h)
            yield f"{p}.mlp.gate.weight", "float32", (experts, h)
            yield f"{p}.mlp.gate.e_score_correction_bias", "float32", (experts,)
            for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                yield f"{p}.mlp.shared_experts.{proj}.weight", "float16", shape
            for e in range(experts):
                for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                    yield f"{p}.mlp.experts.{e}.{proj}.weight", "uint8", shape
                    yield f"{p}.mlp.experts.{e}.{proj}.weight_scale_inv", "float32", (1, 1)
    yield "lm_head.weight", "float16", (256, h)


@family("mixtral")  # Mixtral / MiniMax / Phi-3.5-MoE / Arctic
def _mixtral(layers: int, experts: int, h: int, i: int) -> Iterator[Tensor]:
    yield "model.embed_tokens.weight", "float16", (256, h)
    for L in range(layers):
        p = f"model.layers.{L}"
        yield from _dense(p, h)
        yield f"{p}.block_sparse_moe.gate.weight", "float16", (experts, h)
        for e in range(experts):
            for w, shape in (("w1", (i, h)), ("w2", (h, i)), ("w3", (i, h))):
                yield f"{p}.block_sparse_moe.experts.{e}.{w}.weight", "float16", shape


@family("qwen3")  # Qwen3-MoE / OLMoE, GPTQ-style quantised experts
def _qwen3(layers: int, experts: int, h: int, i: int) -> Iterator[Tensor]:
    for L in range(layers):
        p = f"model.layers.{L}"
        yield from _dense(p, h)
        yield f"{p}.mlp.gate.weight", "float16", (experts, h)
        for e in range(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"{p}.mlp.experts.{e}.{proj}.qweight", "int32", (h // 8, i)
                yield f"{p}.mlp.experts.{e}.{proj}.scales", "float16", (1, i)


@family("jamba")
def _jamba(layers: int, experts: int, h: int, i: int) -> Iterator[Tensor]:
    for L in range(layers):
        p = f"model.layers.{L}"
        yield f"{p}.feed_forward.router.weight", "float16", (experts, h)
        for e in range(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"{p}.feed_forward.experts.{e}.{proj}.weight", "float16", (i, h)


@family("gptoss")  # fused [E, ...] MXFP4 blocks + scales + biases
def _gptoss(layers: int, experts: int, h: int, i: int) -> Iterator[Tensor]:
    for L in range(layers):
        p = f"model.layers.{L}"
        yield from _dense(p, h)
        yield f"{p}.mlp.router.weight", "float16", (experts, h)
        yield f"{p}.mlp.experts.gate_up_proj_blocks", "uint8", (experts, 2 * i, h // 32, 16)
        yield f"{p}.mlp.experts.gate_up_proj_scales", "uint8", (experts, 2 * i, h // 32)
        yield f"{p}.mlp.experts.gate_up_proj_bias", "float32", (experts, 2 * i)
        yield f"{p}.mlp.experts.down_proj_blocks", "uint8", (experts, h, i // 32, 16)
        yield f"{p}.mlp.experts.down_proj_scales", "uint8", (experts, h, i // 32)
        yield f"{p}.mlp.experts.down_proj_bias", "float32", (experts, h)


@family("llama4")  # fused [E, H, 2I] experts, one shared expert
def _llama4(layers: int, experts: int, h: int, i: int) -> Iterator[Tensor]:
    for L in range(layers):
        p = f"language_model.model.layers.{L}"
        yield from _dense(p, h)
        yield f"{p}.feed_forward.router.weight", "float16", (experts, h)
        yield f"{p}.feed_forward.experts.gate_up_proj", "float16", (experts, h, 2 * i)
        yield f"{p}.feed_forward.experts.down_proj", "float16", (experts, i, h)
        yield f"{p}.feed_forward.shared_expert.down_proj.weight", "float16", (h, i)


@family("granite")  # fused input_linear / output_linear [E, ...]
def _granite(layers: int, experts: int, h: int, i: int) -> Iterator[Tensor]:
    for L in range(layers):
        p = f"model.layers.{L}"
        yield f"{p}.block_sparse_moe.router.layer.weight", "float16", (experts, h)
        yield f"{p}.block_sparse_moe.input_linear.weight", "float16", (experts, 2 * i, h)
        yield f"{p}.block_sparse_moe.output_linear.weight", "float16", (experts, h, i)


@family("dbrx")  # row-fused experts [E·I, H]: only the config's expert count can cut them
def _dbrx(layers: int, experts: int, h: int, i: int) -> Iterator[Tensor]:
    for L in range(layers):
        p = f"transformer.blocks.{L}"
        yield f"{p}.norm_attn_norm.attn.Wqkv.weight", "float16", (3 * h, h)
        yield f"{p}.ffn.router.layer.weight", "float16", (experts, h)
        for w in ("w1", "v1", "w2"):
            yield f"{p}.ffn.experts.mlp.{w}", "float16", (experts * i, h)


def write_checkpoint(
    out: str,
    family: str = "deepseek",
    layers: int = 4,
    experts: int = 16,
    hidden: int = 256,
    inter: int = 128,
    shards: int = 4,
    seed: int = 0,
) -> list[str]:
    """Write `shards` safetensors files + index + config into `out`; returns the shard paths.

    Tensor bytes are random (seeded): every tensor differs, so a misplaced byte is caught.
    """
    from safetensors.numpy import save_file

    os.makedirs(out, exist_ok=True)
    specs = list(FAMILIES[family](layers, experts, hidden, inter))
    sizes = [int(np.prod(s)) * np.dtype(d).itemsize for _, d, s in specs]
    per_shard = sum(sizes) / shards
    rng = np.random.default_rng(seed)
    paths, weight_map = [], {}
    start, acc = 0, 0
    for k in range(shards):
        stop = start
        while stop < len(specs) and (acc + sizes[stop] <= per_shard * (k + 1) or k == shards - 1):
            acc += sizes[stop]
            stop += 1
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {
            n: rng.integers(0, 256, size=sizes[j], dtype=np.uint8).view(d).reshape(s)
            for j, (n, d, s) in enumerate(specs[start:stop], start)
        }
        path = os.path.join(out, name)
        save_file(tensors, path, metadata={"format": "pt"})
        paths.append(path)
        weight_map.update({n: name for n in tensors})
        start = stop
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(
            {
                "colifs_synthetic": family,
                "num_hidden_layers": layers,
                "n_routed_experts": experts,
                "hidden_size": hidden,
                "moe_intermediate_size": inter,
            },
            f,
            indent=1,
        )
    return paths


# GGUF: llama.cpp's tensor names. Experts are fused per layer, numpy shape [n_expert, rows, cols]
# (GGUF ne = [cols, rows, n_expert]: the expert is the slowest-varying dimension).
GGUF_ARCHS: dict[str, list[str]] = {
    "qwen3moe": ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"],
    "deepseek2": ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "exp_probs_b"],
    "gpt-oss": ["ffn_gate_up_exps", "ffn_down_exps"],
    "ernie4_5-moe": ["ffn_gate_exps", "ffn_up_exps", "ffn_down_chexps"],
}


def write_gguf(
    path: str,
    arch: str = "qwen3moe",
    layers: int = 2,
    experts: int = 8,
    hidden: int = 64,
    inter: int = 64,
    qtype: str = "F16",
    alignment: int | None = None,
    seed: int = 0,
    split_max_tensors: int = 0,
) -> None:
    """A GGUF MoE model written with llama.cpp's own `gguf` writer; F16, F32 or Q8_0 experts.

    With `split_max_tensors`, a split model (`NAME-0000k-of-0000n.gguf`, each with split.* keys).
    """
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_block_count(layers)
    w.add_expert_count(experts)
    if alignment is not None:
        w.add_custom_alignment(alignment)

    def add(name: str, shape: tuple[int, ...], kind: str = "F32") -> None:
        data = rng.standard_normal(shape).astype(np.float32)
        if kind == "Q8_0":
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data.astype(np.float16) if kind == "F16" else data)

    add("token_embd.weight", (32, hidden), "F16")
    for L in range(layers):
        add(f"blk.{L}.attn_norm.weight", (hidden,))
        add(f"blk.{L}.attn_q.weight", (hidden, hidden), "F16")
        add(f"blk.{L}.ffn_gate_inp.weight", (experts, hidden))
        for t in GGUF_ARCHS[arch]:
            if t == "exp_probs_b":
                add(f"blk.{L}.exp_probs_b.bias", (experts,))
            elif t.endswith("shexp"):
                add(f"blk.{L}.{t}.weight", (inter, hidden), "F16")
            elif t.startswith("ffn_down"):
                add(f"blk.{L}.{t}.weight", (experts, hidden, inter), qtype)
            else:
                rows = 2 * inter if "gate_up" in t else inter
                add(f"blk.{L}.{t}.weight", (experts, rows, hidden), qtype)
    add("output.weight", (32, hidden), "F16")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m colifs.synth", description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--family", choices=sorted(FAMILIES), default="deepseek")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    paths = write_checkpoint(a.out, a.family, a.layers, a.experts, a.hidden, a.inter, a.shards, a.seed)
    total = sum(os.path.getsize(x) for x in paths)
    print(f"wrote {len(paths)} shards, {total / 1e6:.1f} MB, to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def write_runnable_gguf(
    path: str,
    vocab: str,
    layers: int = 12,
    experts: int = 64,
    used: int = 4,
    hidden: int = 1024,
    inter: int = 512,
    heads: int = 8,
    kv_heads: int = 4,
    head_dim: int = 128,
    seed: int = 0,
) -> None:
    """A qwen3moe model llama.cpp loads and runs: random F16 weights (small, so activations stay
    finite), the tokenizer of `vocab` (one of llama.cpp's ggml-vocab-*.gguf files). With the
    defaults, 12 layers x 64 experts of 3 MiB and top-4 routing: decoding streams ~144 MiB a token."""
    import gguf

    rng = np.random.default_rng(seed)
    tok = gguf.GGUFReader(vocab)
    field = tok.fields
    n_vocab = len(field["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name("colifs synthetic qwen3moe")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_expert_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model(str(field["tokenizer.ggml.model"].contents()))
    w.add_tokenizer_pre(str(field["tokenizer.ggml.pre"].contents()))
    w.add_token_list(field["tokenizer.ggml.tokens"].contents())
    w.add_token_types(field["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(field["tokenizer.ggml.merges"].contents())
    for name, add in (
        ("eos", w.add_eos_token_id),
        ("bos", w.add_bos_token_id),
        ("padding", w.add_pad_token_id),
    ):
        if f"tokenizer.ggml.{name}_token_id" in field:
            add(int(field[f"tokenizer.ggml.{name}_token_id"].contents()))

    def add(name: str, shape: tuple[int, ...], scale: float = 0.02) -> None:
        w.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16))

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    # Embeddings of unit scale: the token, not the context average the near-uniform attention adds,
    # dominates the residual stream, so each token routes to other experts, as a trained router's
    # load balancing does (at 0.02 a decode step re-used the last steps' experts: ~65% cache hits).
    add("token_embd.weight", (n_vocab, hidden), 1.0)
    for L in range(layers):
        p = f"blk.{L}"
        ones(f"{p}.attn_norm.weight", hidden)
        add(f"{p}.attn_q.weight", (heads * head_dim, hidden))
        add(f"{p}.attn_k.weight", (kv_heads * head_dim, hidden))
        add(f"{p}.attn_v.weight", (kv_heads * head_dim, hidden))
        add(f"{p}.attn_output.weight", (hidden, heads * head_dim))
        ones(f"{p}.attn_q_norm.weight", head_dim)
        ones(f"{p}.attn_k_norm.weight", head_dim)
        ones(f"{p}.ffn_norm.weight", hidden)
        w.add_tensor(f"{p}.ffn_gate_inp.weight", rng.standard_normal((experts, hidden), dtype=np.float32))
        add(f"{p}.ffn_gate_exps.weight", (experts, inter, hidden))
        add(f"{p}.ffn_up_exps.weight", (experts, inter, hidden))
        add(f"{p}.ffn_down_exps.weight", (experts, hidden, inter))
    ones("output_norm.weight", hidden)
    add("output.weight", (n_vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
