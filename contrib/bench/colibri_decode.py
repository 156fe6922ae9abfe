"""Colibrì decoding a GLM-shaped MoE model streamed from two throttled drives: directly from the fast
drive, with Colibrì's own mirror of the two drives (COLI_MODEL_MIRROR), and through colifs over both
drives or the fast one alone; buffered reads and O_DIRECT (DIRECT=1); the engine in a memory cgroup
well below the model's size, as on a workstation whose RAM is smaller than the model.

    contrib/bench/colibri-decode.sh --colibri DIR [--fast 150] [--slow 50] [--mem-mib 1200]
                                    [--tokens 16] [--repeats 3] [--modes buffered,direct]
                                    [--configs direct128,mirror,defaults,fastonly] [--cap 8]
                                    [--engine-env KEY=VALUE ...] [--model-dir DIR] [--ram | --latency]
                                    [--json FILE]

--colibri (default $COLIBRI): a built Colibrì checkout (v1.6.2, see its README).

The model: GLM-5's layout (MLA attention, routed experts with one shared expert, sigmoid router)
with random F16 weights, written here in Hugging Face's layout and converted by the checkout's own
converter (c/tools/convert_fp8_to_int4.py, under $ENGINE_PYTHON, default .venv-engines/bin/python:
it needs torch) to Colibrì's int8 container: 8 layers (the first dense), 64 routed experts of 6.3 MB
per sparse layer (hidden 2048, expert width 1024; top 8), 3.0 GB in 9 shards, and a byte-level
tokenizer.json. Made once into --model-dir (default .cache/colibri-glm-<shape and converter>),
copied to both drives for each benchmark.

Each run decodes --tokens tokens after a 2-token prompt (PROMPT mode), sampled with a fixed seed
(COLI_TEMP=1, SEED=1: greedy decoding of random weights repeats tokens, so it would route to the
same, cached, experts); the tokens must be the same in every run. The engine's expert cache is
--cap slots per layer (CAP_RAISE=0, RAM_GB=16: its RAM budget, not the cgroup's, would size it),
AUTOPIN=0, and the routing history it writes into the model directory (.coli_usage) is removed after
every run. --modes: DIRECT=0 (buffered preads of whole experts) or DIRECT=1 (O_DIRECT). Its column
"read wait s" is the engine's own profile of its decode: the seconds its compute thread waited for
reads. Caches dropped before every run; configurations interleaved; medians and min-max. For colifs
runs the daemon joins the engine's memory cgroup (one limit for every configuration). Root only;
cleans up.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from dual_drive import Rig
from engines import (
    CONFIGS,
    MIRROR_CONFIGS,
    Config,
    MemoryCgroup,
    can_run,
    engine_python,
    interleaved,
    median_of,
    one_run,
    rig_arguments,
    run_command_in_cgroup,
    set_readahead,
)

MODES = {"buffered": "0", "direct": "1"}  # --modes -> DIRECT
PROMPT = "Hi"  # 2 tokens: the prefill's own expert reads stay small


class Shape(NamedTuple):
    """The model's dimensions (config.json's names in the comments)."""

    vocab: int = 8192
    hidden: int = 2048
    inter: int = 4096  # intermediate_size: the dense layers' MLP
    moe_inter: int = 1024  # moe_intermediate_size: an expert's width (int8: 3 x 2048 x 1024 B)
    layers: int = 8
    dense: int = 1  # first_k_dense_replace
    experts: int = 64
    topk: int = 8
    heads: int = 16
    q_lora: int = 512
    kv_lora: int = 256
    nope: int = 64  # qk_nope_head_dim
    rope: int = 32  # qk_rope_head_dim
    v: int = 64  # v_head_dim

    def expert_bytes(self) -> int:
        """One routed expert in the int8 container: its three matrices and their f32 row scales."""
        return 3 * self.hidden * self.moe_inter + 4 * (2 * self.moe_inter + self.hidden)

    def config(self) -> dict:
        return {
            "architectures": ["GlmMoeDsaForCausalLM"],
            "model_type": "glm_moe_dsa",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.inter,
            "moe_intermediate_size": self.moe_inter,
            "num_hidden_layers": self.layers,
            "first_k_dense_replace": self.dense,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.heads,
            "n_routed_experts": self.experts,
            "num_experts_per_tok": self.topk,
            "n_shared_experts": 1,
            "q_lora_rank": self.q_lora,
            "kv_lora_rank": self.kv_lora,
            "qk_nope_head_dim": self.nope,
            "qk_rope_head_dim": self.rope,
            "v_head_dim": self.v,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "rms_norm_eps": 1e-5,
            "index_topk": 0,  # no DSA indexer: dense attention (the converter drops indexers anyway)
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        }  # no eos_token_id: nothing stops a run before --tokens


Tensor = tuple[str, tuple[int, ...], str]  # name, shape, what: w (random F16), w32 (random F32), one, zero


def _mlp(prefix: str, hidden: int, width: int) -> Iterator[Tensor]:
    yield f"{prefix}.gate_proj.weight", (width, hidden), "w"
    yield f"{prefix}.up_proj.weight", (width, hidden), "w"
    yield f"{prefix}.down_proj.weight", (hidden, width), "w"


def _layer(s: Shape, i: int) -> Iterator[Tensor]:
    """Layer `i`'s tensors, named as GLM-5 (and DeepSeek-V3) checkpoints name them."""
    p, d, h = f"model.layers.{i}", s.hidden, s.heads
    yield f"{p}.input_layernorm.weight", (d,), "one"
    yield f"{p}.post_attention_layernorm.weight", (d,), "one"
    yield f"{p}.self_attn.q_a_proj.weight", (s.q_lora, d), "w"
    yield f"{p}.self_attn.q_a_layernorm.weight", (s.q_lora,), "one"
    yield f"{p}.self_attn.q_b_proj.weight", (h * (s.nope + s.rope), s.q_lora), "w"
    yield f"{p}.self_attn.kv_a_proj_with_mqa.weight", (s.kv_lora + s.rope, d), "w"
    yield f"{p}.self_attn.kv_a_layernorm.weight", (s.kv_lora,), "one"
    yield f"{p}.self_attn.kv_b_proj.weight", (h * (s.nope + s.v), s.kv_lora), "w"
    yield f"{p}.self_attn.o_proj.weight", (d, h * s.v), "w"
    if i < s.dense:
        yield from _mlp(f"{p}.mlp", d, s.inter)
        return
    yield f"{p}.mlp.gate.weight", (s.experts, d), "w32"
    yield f"{p}.mlp.gate.e_score_correction_bias", (s.experts,), "zero"
    yield from _mlp(f"{p}.mlp.shared_experts", d, s.moe_inter)
    for e in range(s.experts):
        yield from _mlp(f"{p}.mlp.experts.{e}", d, s.moe_inter)


def _outside(s: Shape) -> Iterator[Tensor]:
    yield "model.embed_tokens.weight", (s.vocab, s.hidden), "w"
    yield "lm_head.weight", (s.vocab, s.hidden), "w"
    yield "model.norm.weight", (s.hidden,), "one"


def write_hf(out: Path, s: Shape, seed: int = 0) -> None:
    """The model in Hugging Face's layout, one shard per layer (and one for the embeddings): weights
    N(0, 0.02) as transformers initialises them, norms 1, router biases 0."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for k, tensors in enumerate([_outside(s), *(_layer(s, i) for i in range(s.layers))]):
        shard = {}
        for name, shape, what in tensors:
            if what in ("one", "zero"):
                shard[name] = np.full(shape, 1.0 if what == "one" else 0.0, np.float32)
            else:
                w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
                shard[name] = w if what == "w32" else w.astype(np.float16)
        save_file(shard, str(out / f"model-{k:05d}.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(s.config(), indent=1))


def tokenizer(vocab: int) -> dict:
    """A byte-level BPE tokenizer.json with no merges (Colibrì's tok.h then ranks by the vocabulary,
    as tiktoken does): ids 0-255 are the bytes (GPT-2's byte-to-character map), the others plain
    words. No special tokens, so no stop token."""
    direct = {*range(33, 127), *range(161, 173), *range(174, 256)}
    chars, n = {}, 0
    for b in range(256):
        chars[b] = chr(b) if b in direct else chr(256 + n)
        n += b not in direct
    words = {chars[b]: b for b in range(256)} | {f"w{i}": i for i in range(256, vocab)}
    return {"version": "1.0", "added_tokens": [], "model": {"type": "BPE", "vocab": words, "merges": []}}


def converter(colibri: Path) -> Path:
    return colibri / "c" / "tools" / "convert_fp8_to_int4.py"


def default_model_dir(colibri: Path, s: Shape) -> Path:
    """.cache/colibri-glm-<digest of the shape and the converter>: another either makes another."""
    digest = hashlib.sha256(repr(s).encode() + converter(colibri).read_bytes()).hexdigest()[:10]
    return Path(__file__).parents[2] / ".cache" / f"colibri-glm-{digest}"


def make_model(colibri: Path, py: str, model_dir: Path, s: Shape) -> None:
    """The container in `model_dir`, unless it is there: the HF-layout model written beside it,
    converted to int8 (experts, attention, embeddings; norms and router F32) by the checkout's
    converter, the tokenizer added; renamed into place once whole."""
    if model_dir.is_dir():
        return
    hf, part = model_dir.with_name(model_dir.name + ".hf"), model_dir.with_name(model_dir.name + ".part")
    for d in (hf, part):
        shutil.rmtree(d, ignore_errors=True)
    gb = (s.layers - s.dense) * s.experts * s.expert_bytes() / 1e9
    print(f"making the model ({gb:.1f} GB of experts) into {model_dir} ...", file=sys.stderr)
    write_hf(hf, s)
    cmd = [py, str(converter(colibri)), "--indir", str(hf), "--outdir", str(part)]
    cmd += ["--ebits", "8", "--n-layers", str(s.layers)]
    out = subprocess.run(cmd, cwd=colibri / "c", capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    (part / ".out-progress.json").unlink(missing_ok=True)  # the converter's resume manifest
    (part / "tokenizer.json").write_text(json.dumps(tokenizer(s.vocab)))
    part.rename(model_dir)
    shutil.rmtree(hf)


def engine_env(root: Path, args: argparse.Namespace, mode: str, mirror: Path | None) -> dict[str, str]:
    """The engine's whole environment: the model at `root`, the read mode, Colibrì's own mirror of
    `mirror` with the drives' rates as weights, then --engine-env."""
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "SNAP": str(root),
        "PROMPT": PROMPT,
        "NGEN": str(args.tokens),
        "CHAT_TEMPLATE": "0",
        "COLI_TEMP": "1",
        "SEED": "1",
        "TOKENS": "1",
        "RAM_GB": "16",
        "CAP_RAISE": "0",
        "AUTOPIN": "0",
        "DIRECT": MODES[mode],
    }
    if mirror is not None:
        env |= {"COLI_MODEL_MIRROR": str(mirror), "COLI_DISK_WEIGHTS": f"{args.fast:g},{args.slow:g}"}
    return env | dict(x.split("=", 1) for x in args.engine_env)


# What a run prints (PROMPT mode, TOKENS=1) -> (field, pattern); decode_tok_s is worked out from
# the token count and seconds (the printed rate has 2 decimals).
FIGURES = {
    "load_s": r"loaded in ([\d.]+)s",
    "prefill_s": r"prefill \d+ tokens in ([\d.]+)s",
    "hit_pct": r"expert hit rate ([\d.]+)%",
    "loads_per_token": r"experts loaded/token: ([\d.]+)",
    "cap": r"cap=(\d+) ok|cap lowered \d+->(\d+)",
}


# The engine's profile: seconds its compute thread waited for expert reads.
PROFILE = r"PROFILE: expert-disk [\d.]+s service / ([\d.]+)s wait"


def parse(out: str, err: str) -> dict:
    """The figures of one run's stdout and stderr; RuntimeError if the decode line is missing."""
    decode = re.search(r"decode (\d+) tokens in ([\d.]+)s", out)
    tokens = re.search(r"\[TOKENS\] \d+ generated:([\d ]*)", err)
    if decode is None or tokens is None:
        raise RuntimeError(f"no decode figures in the engine's output:\n{out[-1500:]}{err[-1500:]}")
    r: dict = {"tokens": [int(x) for x in tokens.group(1).split()]}
    r["decode_tok_s"] = int(decode.group(1)) / float(decode.group(2))
    for field, pattern in FIGURES.items():
        m = re.search(pattern, out + err)
        r[field] = float(next(g for g in m.groups() if g is not None)) if m else None
    waits = re.findall(PROFILE, out)  # the prefill's profile, then the decode's
    r["ewait_s"] = float(waits[-1]) if waits else None
    return r


def run_engine(colibri: Path, env: dict[str, str], cap: int, cg: MemoryCgroup) -> dict:
    """One decode in the cgroup, its figures and its CPU (user + system) seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = run_command_in_cgroup([str(colibri / "c" / "colibri"), str(cap)], cg, env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {**parse(out.stdout, out.stderr), "engine_cpu_s": cpu}


def _one_run(
    colibri: Path, rig: Rig, cg: MemoryCgroup, mnt: Path, args: argparse.Namespace, mode: str, config: Config
) -> dict:
    """One engine run of one configuration, caches dropped, the fast drive's readahead set; with
    the bytes each drive read."""
    set_readahead(rig, config.readahead_kb)
    mirror = rig.dirs[1] if config.mirror else None
    before = rig.bytes_read()
    try:
        r = one_run(
            rig.dirs,
            mnt,
            config,
            cg,
            args.mem_mib,
            lambda root: run_engine(colibri, engine_env(root, args, mode, mirror), args.cap, cg),
        )
    finally:
        for d in rig.dirs:  # the engine's routing history, which the next run would load
            (d / ".coli_usage").unlink(missing_ok=True)
    fast, slow = (b - a for a, b in zip(before, rig.bytes_read(), strict=True))
    return {**r, "fast_gb": fast / 1e9, "slow_gb": slow / 1e9}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rig_arguments(p, "direct128,mirror,defaults,fastonly", (*CONFIGS, *MIRROR_CONFIGS))
    p.add_argument(
        "--colibri",
        type=Path,
        default=os.environ.get("COLIBRI"),
        help="a built Colibrì checkout (v1.6.2, see its README); default $COLIBRI",
    )
    p.add_argument("--tokens", type=int, default=16, help="tokens decoded per run (default 16)")
    p.add_argument("--modes", default="buffered,direct", help="read modes: buffered,direct (DIRECT=0/1)")
    p.add_argument("--cap", type=int, default=8, help="the engine's expert cache: slots per layer (8)")
    p.add_argument(
        "--engine-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more of the engine's environment, for every run (e.g. PIPE=1, COLI_MIR_STRIPE=0)",
    )
    p.add_argument("--model-dir", type=Path, help="where the model is made once (default .cache/...)")
    args = p.parse_args()
    if args.colibri is None or not (args.colibri / "c" / "colibri").is_file():
        p.error("--colibri (or $COLIBRI): a built Colibrì checkout, with c/colibri")
    if set(args.modes.split(",")) - set(MODES) or any("=" not in x for x in args.engine_env):
        p.error(f"--modes: {', '.join(MODES)}; --engine-env: KEY=VALUE")
    return args


def _print_results(args: argparse.Namespace, s: Shape, configs: list[Config], results: dict) -> None:
    sparse = s.layers - s.dense
    extra = "".join(f"; {x}" for x in args.engine_env)
    print(
        f"\nColibrì ({args.colibri}) decoding {args.tokens} tokens of a GLM-shaped model: {s.layers} "
        f"layers, {sparse} x {s.experts} routed experts of {s.expert_bytes() / 1e6:.2f} MB (top {s.topk}; "
        f"{sparse * s.experts * s.expert_bytes() / 1e9:.2f} GB of experts); drives {args.fast:g} + "
        f"{args.slow:g} MB/s{' (RAM-backed)' if args.ram else ''}{', with latency' if args.latency else ''}; "
        f"memory cgroup {args.mem_mib} MiB; expert cache {args.cap} per layer{extra}; {args.repeats} "
        f"runs each, interleaved"
    )
    ref = next(iter(next(iter(results.values())).values()))[0]["tokens"]
    for mode, by in results.items():
        _print_mode(mode, by, configs, ref)
    same = all(x["tokens"] == ref for by in results.values() for runs in by.values() for x in runs)
    print(
        f"\ntokens identical in every run: {'yes' if same else 'NO'} ({len(ref)} tokens, "
        f"{len(set(ref))} distinct: {' '.join(map(str, ref[:12]))} ...)"
    )


def _print_mode(mode: str, by: dict[str, list[dict]], configs: list[Config], ref: list[int]) -> None:
    """One read mode's table: each configuration against the fast drive read directly (the best
    direct* configuration of this mode) and colifs on the fast drive alone, where they ran."""
    median = {c.label: statistics.median(x["decode_tok_s"] for x in by[c.label]) for c in configs}
    direct = [median[c.label] for c in configs if c.baseline]
    best = max(direct) if direct else None
    alone = next((median[c.label] for c in configs if c.alone), None)
    print(f"\nreads {mode} (DIRECT={MODES[mode]}):")
    print(f"{'configuration':<44} {'decode tok/s':>13} {'(min-max)':>13} {'vs fast directly':>17} "
          f"{'vs colifs fast only':>20} {'tokens equal':>13} {'hit %':>6} {'loads/token':>12} "
          f"{'fast GB':>8} {'slow GB':>8} {'daemon GB':>10} {'CPU s/GB':>9} {'engine CPU s':>13} "
          f"{'load s':>7} {'read wait s':>12} {'host CPU s':>11} {'busy %':>7}")  # fmt: skip
    for c in configs:
        m = median[c.label]
        vs_best = "-" if best is None else f"{m / best:.2f}"
        vs_alone = "-" if alone is None else f"{m / alone:.2f}"
        print(f"{c.label:<44} {m:>13.3f} {_row(by[c.label], vs_best, vs_alone, ref)}")


def _row(runs: list[dict], vs_best: str, vs_alone: str, ref: list[int]) -> str:
    """A configuration's columns after its median rate."""
    d = [x["decode_tok_s"] for x in runs]
    return (
        f"{f'{min(d):.3f}-{max(d):.3f}':>13} {vs_best:>17} {vs_alone:>20} "
        f"{'yes' if all(x['tokens'] == ref for x in runs) else 'NO':>13}"
        f" {median_of(runs, 'hit_pct', '.1f'):>6} {median_of(runs, 'loads_per_token', '.1f'):>12}"
        f" {median_of(runs, 'fast_gb', '.2f'):>8} {median_of(runs, 'slow_gb', '.2f'):>8}"
        f" {median_of(runs, 'daemon_gb', '.2f'):>10} {median_of(runs, 'daemon_cpu_s_per_gb', '.2f'):>9}"
        f" {median_of(runs, 'engine_cpu_s', '.1f'):>13} {median_of(runs, 'load_s', '.2f'):>7}"
        f" {median_of(runs, 'ewait_s', '.2f'):>12}"
        f" {median_of(runs, 'host_cpu_s', '.1f'):>11} {median_of(runs, 'host_busy_pct', '.0f'):>7}"
    )


def main() -> int:
    args = _parse()
    py, shape = engine_python(), Shape()
    if not can_run("colibri-decode"):
        return 2
    model_dir = args.model_dir or default_model_dir(args.colibri, shape)
    make_model(args.colibri, py, model_dir, shape)

    def write(a: Path) -> None:
        print(f"copying the model from {model_dir} to both drives ...", file=sys.stderr)
        shutil.copytree(model_dir, a, dirs_exist_ok=True)

    def run(rig: Rig, cg: MemoryCgroup, mnt: Path, mode: str, config: Config) -> dict:
        return _one_run(args.colibri, rig, cg, mnt, args, mode, config)

    image_gb = sum(f.stat().st_size for f in model_dir.iterdir()) / 2**30 + 0.7  # ext4 needs room
    chosen, results = interleaved(args, "colibri", write, args.modes.split(","), run, None, image_gb)
    _print_results(args, shape, chosen, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
