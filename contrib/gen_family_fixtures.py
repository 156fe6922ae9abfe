"""Record the checkpoint layout of each MoE family, as transformers writes it, into small fixtures.

    pip install torch transformers   # (a CPU torch is enough)
    python contrib/gen_family_fixtures.py tests/families

Each family's config is built tiny (a few layers, 4 experts, small dimensions), the model is
instantiated with random weights and written with `save_pretrained`; what is kept is config.json
and each safetensors file's header and size: the tensor names, dtypes, shapes and offsets are the
family's own. The tests rebuild sparse zero-filled files from them (make test needs neither torch
nor transformers). Run again when transformers changes a family's layout.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile

COMMON = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
    "num_experts_per_tok": 2, "tie_word_embeddings": False,
}  # fmt: skip
MLA = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}

# family → (model_type, config fields over COMMON); every family with 4 routed experts.
FAMILIES: dict[str, tuple[str, dict]] = {
    "mixtral": ("mixtral", {"num_local_experts": 4}),
    "phimoe": ("phimoe", {"num_local_experts": 4}),
    "minimax": ("minimax", {"num_local_experts": 4, "layer_types": ["linear_attention", "full_attention"]}),
    "kimi_linear": ("kimi_linear", {
        "num_experts": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "num_hidden_layers": 3,
        "num_shared_experts": 1, "pad_token_id": 0, **MLA,
    }),
    "qwen2_moe": ("qwen2_moe", {
        "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    }),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "moe_intermediate_size": 32}),
    "qwen3_next": ("qwen3_next", {
        "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "num_hidden_layers": 4, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    }),
    "olmoe": ("olmoe", {"num_experts": 4}),
    "ernie4_5_moe": ("ernie4_5_moe", {
        "moe_num_experts": 4, "moe_intermediate_size": 32, "moe_layer_start_index": 1, "num_hidden_layers": 3,
        "moe_num_shared_experts": 1,
    }),
    "glm4_moe": ("glm4_moe", {
        "n_routed_experts": 4, "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "num_hidden_layers": 3, "n_group": 1, "topk_group": 1,
    }),
    "deepseek_v2": ("deepseek_v2", {
        "n_routed_experts": 4, "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "num_hidden_layers": 3, "n_group": 1, "topk_group": 1, **MLA,
    }),
    "deepseek_v3": ("deepseek_v3", {
        "n_routed_experts": 4, "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "num_hidden_layers": 3, "n_group": 1, "topk_group": 1, **MLA,
    }),
    "jamba": ("jamba", {
        "num_experts": 4, "num_hidden_layers": 4, "expert_layer_period": 2, "expert_layer_offset": 1,
        "attn_layer_period": 4, "attn_layer_offset": 3, "mamba_d_state": 4, "mamba_d_conv": 2,
        "mamba_expand": 2, "mamba_dt_rank": 8, "use_mamba_kernels": False,
    }),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "layer_types": ["sliding_attention", "full_attention"]}),
    "llama4": ("llama4_text", {
        "num_local_experts": 4, "intermediate_size_mlp": 64, "interleave_moe_layer_step": 1,
    }),
    "granitemoe": ("granitemoe", {"num_local_experts": 4}),
    "jetmoe": ("jetmoe", {"num_local_experts": 4, "num_experts_per_tok": 2, "kv_channels": 16}),
    "dbrx": ("dbrx", {
        "d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 128, "vocab_size": 128,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    }),
}  # fmt: skip


def header(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def record(family: str, model_type: str, fields: dict, out_dir: str) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    kw = {**COMMON, **fields} if family != "dbrx" else fields
    config = AutoConfig.for_model(model_type, **kw)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size="200KB")
        with open(os.path.join(tmp, "config.json")) as f:
            cfg = json.load(f)
        names = sorted(n for n in os.listdir(tmp) if n.endswith(".safetensors"))
        files = {
            n: {"size": os.path.getsize(os.path.join(tmp, n)), "header": header(os.path.join(tmp, n))}
            for n in names
        }
    import transformers

    fixture = {"family": family, "transformers": transformers.__version__, "config": cfg, "files": files}
    path = os.path.join(out_dir, f"{family}.json")
    with open(path, "w") as f:
        json.dump(fixture, f, indent=None, separators=(",", ":"), sort_keys=True)
        f.write("\n")
    n = sum(len(v["header"]) for v in files.values())
    return f"{family}: {len(files)} files, {n} tensors"


def main() -> int:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "tests/families"
    only = set(sys.argv[2:])
    os.makedirs(out_dir, exist_ok=True)
    failed = 0
    for family, (model_type, fields) in FAMILIES.items():
        if only and family not in only:
            continue
        try:
            print(record(family, model_type, fields, out_dir))
        except Exception as e:  # one family's config problem must not stop the others
            failed += 1
            print(f"{family}: FAILED {type(e).__name__}: {str(e)[:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
