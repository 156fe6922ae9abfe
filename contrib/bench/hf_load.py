"""Loading a safetensors MoE checkpoint with transformers (`from_pretrained`) and with `safe_open`,
from two throttled drives: directly from the fast drive (readahead 128 and 512 KiB) against through
colifs, the loader in a memory cgroup (the colifs daemon joins it).

    contrib/bench/hf-load.sh [--fast 150] [--slow 50] [--mem-mib 1200] [--repeats 3]
                             [--loaders safe_open,from_pretrained] [--configs direct128,defaults,...]
                             [--json FILE]

The checkpoint: a Qwen3-MoE made by transformers itself (12 layers x 64 experts of 3 MiB, F16:
numpy has no bf16; random weights, 2.6 GB in shards of 400 MB; the experts are one tensor per
projection, as transformers 4.x saves them). `safe_open` reads every tensor once into numpy and drops it: it
streams, in a cgroup of --mem-mib (smaller than the checkpoint). `from_pretrained` keeps the model,
so its cgroup is the checkpoint + --mem-mib; its time is the call plus one pass over every weight
(whatever the call left unread in the page cache is read then). A CRC of every tensor's bytes
checks each run's weights against the first run's. The loaders run under $ENGINE_PYTHON (default
.venv-engines/bin/python, made by `make bench-engines`: torch (CPU) and transformers). Caches
dropped before every run; configurations interleaved; medians and min-max. Root only; cleans up.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from dual_drive import Rig
from engines import (
    Config,
    MemoryCgroup,
    can_run,
    engine_python,
    interleaved,
    median_of,
    one_run,
    rig_arguments,
    run_in_cgroup,
    set_readahead,
)

# Runs in the engine's interpreter: writes the checkpoint into argv[1].
WRITE = """
import sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
cfg = Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                     num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                     num_experts=64, num_experts_per_tok=4, max_position_embeddings=4096,
                     tie_word_embeddings=False, torch_dtype="float16")
torch.manual_seed(0)
torch.set_default_dtype(torch.float16)
Qwen3MoeForCausalLM(cfg).save_pretrained(sys.argv[1], max_shard_size="400MB")
"""

# Both loaders: one JSON line with the load time and a CRC of every tensor's bytes (in name order).
LOAD = """
import json, sys, time, zlib
root, loader = sys.argv[1], sys.argv[2]
crc, crc_s, t0 = 0, 0.0, time.time()
if loader == "safe_open":
    import numpy as np
    from safetensors import safe_open
    index = json.load(open(f"{root}/model.safetensors.index.json"))["weight_map"]
    for shard in sorted(set(index.values())):
        with safe_open(f"{root}/{shard}", framework="np") as f:
            for name in sorted(f.keys()):
                a = f.get_tensor(name)
                t = time.time()
                crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8), crc)
                crc_s += time.time() - t
    print(json.dumps({"load_s": time.time() - t0 - crc_s, "crc": crc}))
else:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(root, torch_dtype=torch.float16)
    call = time.time() - t0
    def check():
        out = 0
        for _, p in sorted(model.state_dict().items()):
            out = zlib.crc32(p.contiguous().view(torch.uint8).numpy(), out)
        return out
    crc = check()  # reads whatever the call left unread
    first = time.time() - t0
    t = time.time()
    check()  # the same pass from memory: its CPU time, taken off
    print(json.dumps({"load_s": first - (time.time() - t), "call_s": call, "crc": crc}))
"""

LOADERS = ("safe_open", "from_pretrained")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rig_arguments(p, "direct128,direct512,defaults,expert")
    p.add_argument("--loaders", default=",".join(LOADERS), help=f"default {','.join(LOADERS)}")
    args = p.parse_args()
    if set(args.loaders.split(",")) - set(LOADERS):
        p.error(f"--loaders: known are {', '.join(LOADERS)}")
    return args


def _limit(args: argparse.Namespace, loader: str, model: Path) -> int:
    """safe_open streams (--mem-mib); from_pretrained keeps the model: the checkpoint + --mem-mib."""
    if loader == "safe_open":
        return args.mem_mib
    return (sum(f.stat().st_size for f in model.glob("*.safetensors")) >> 20) + args.mem_mib


def _one_run(
    py: str, rig: Rig, cg: MemoryCgroup, mnt: Path, args: argparse.Namespace, loader: str, config: Config
) -> dict:
    set_readahead(rig, config.readahead_kb)
    limit = _limit(args, loader, rig.dirs[0])
    return one_run(
        rig.dirs, mnt, config, cg, limit, lambda root: run_in_cgroup(py, LOAD, [str(root), loader], cg)
    )


def _print_results(
    args: argparse.Namespace, chosen: list[Config], results: dict[str, dict[str, list[dict]]]
) -> None:
    print(
        f"\nloading a 2.6 GB Qwen3-MoE safetensors checkpoint; drives {args.fast:g} + {args.slow:g} MB/s; "
        f"memory cgroup {args.mem_mib} MiB (from_pretrained: the checkpoint + that); {args.repeats} runs each"
    )
    for loader, by in results.items():
        ref = by[chosen[0][0]][0]["crc"]
        fastest = min(statistics.median(x["load_s"] for x in by[c[0]]) for c in chosen if c.baseline)
        print(f"\n{loader}:")
        print(f"{'configuration':<42} {'load s':>7} {'(min-max)':>13} {'speed-up':>9} {'weights equal':>14} "
              f"{'daemon GB':>10} {'CPU s':>6} {'CPU s/GB':>9} {'slow share':>11} "
              f"{'readahead KiB':>14} {'host CPU s':>11} {'busy %':>7}")  # fmt: skip
        for label, *_ in chosen:
            runs = by[label]
            t = [x["load_s"] for x in runs]
            same = "yes" if all(x["crc"] == ref for x in runs) else "NO"
            share = [x["byte_share"][1] for x in runs if "byte_share" in x]
            print(
                f"{label:<42} {statistics.median(t):>7.2f} {f'{min(t):.1f}-{max(t):.1f}':>13} "
                f"{fastest / statistics.median(t):>9.2f} {same:>14} "
                f"{median_of(runs, 'daemon_gb', '.2f'):>10} "
                f"{median_of(runs, 'daemon_cpu_s', '.1f'):>6} "
                f"{median_of(runs, 'daemon_cpu_s_per_gb', '.2f'):>9} "
                f"{format(statistics.median(share), '.3f') if share else '-':>11} "
                f"{median_of(runs, 'readahead_kb', '.0f'):>14} "
                f"{median_of(runs, 'host_cpu_s', '.1f'):>11} {median_of(runs, 'host_busy_pct', '.0f'):>7}"
            )


def main() -> int:
    args = _parse()
    py = engine_python()
    if not can_run("hf-load"):
        return 2
    check = subprocess.run([py, "-c", "import torch, transformers, safetensors"], capture_output=True)
    if check.returncode:
        print(
            f"hf-load: needs torch, transformers and safetensors in {py} (make bench-engines)",
            file=sys.stderr,
        )
        return 2

    def write(a: Path) -> None:
        print("writing the checkpoint (2.6 GB) to both drives ...", file=sys.stderr)
        subprocess.run([py, "-c", WRITE, str(a)], check=True, capture_output=True)

    def run(rig: Rig, cg: MemoryCgroup, mnt: Path, loader: str, config: Config) -> dict:
        return _one_run(py, rig, cg, mnt, args, loader, config)

    chosen, results = interleaved(args, "hf", write, args.loaders.split(","), run)
    _print_results(args, chosen, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
