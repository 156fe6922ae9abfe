"""llama.cpp decoding a synthetic MoE model streamed from two throttled drives: directly from the
fast drive (readahead 128 and 512 KiB) against through colifs, with llama.cpp (via xllamacpp) in a
memory cgroup well below the model's size, as on a workstation whose RAM is smaller than the model.

    contrib/bench/llama-decode.sh [--fast 150] [--slow 50] [--mem-mib 1200] [--tokens 24]
                                  [--repeats 3] [--modes mmap,none,direct] [--json FILE]
                                  [--sequential] [--configs direct128,defaults,...]
                                  [--ram] [--model spread|big]

The model: colifs.synth.write_runnable_gguf (qwen3moe, top 4, random F16 weights) with the tokenizer
of llama.cpp's ggml-vocab-qwen2.gguf ($COLIFS_GGUF_VOCAB_DIR, which `make test` fills): `spread`
(default) 12 layers x 64 experts of 3 MiB (1 MiB per tensor slice, 2.9 GB), `big` 12 layers x 16
experts of 12 MiB (4 MiB per tensor slice, as 200B+ MoE checkpoints have: 3.1 GB). `--ram` puts the
drive images in /dev/shm (fast drives, e.g. --fast 900 --slow 300). The engine runs under
$ENGINE_PYTHON (default .venv-engines/bin/python, made by `make bench-engines`). Caches are dropped
before every run; configurations are interleaved; medians and min-max over the repeats. For colifs
runs the daemon joins the engine's memory cgroup, whose limit grows by the daemon's own RSS plus 64
MiB of read buffers. Root only; cleans up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from dual_drive import Rig
from engines import (
    CONFIGS,
    Config,
    MemoryCgroup,
    can_run,
    engine_python,
    interleaved,
    measured_mount,
    median_of,
    one_run,
    rig_arguments,
    run_in_cgroup,
    set_readahead,
)

# Runs in the engine's interpreter: load, decode, print one JSON line.
ENGINE = """
import json, sys, time
import xllamacpp as x
path, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
p = x.CommonParams()
p.model.path = path
p.n_ctx = 512
p.n_predict = n
p.warmup = False
p.load_mode = getattr(x.llama_load_mode, {"mmap": "LLAMA_LOAD_MODE_MMAP", "none": "LLAMA_LOAD_MODE_NONE",
                                          "direct": "LLAMA_LOAD_MODE_DIRECT_IO"}[mode])
t = time.time()
s = x.Server(p)
load = time.time() - t
# Sampled (seeded: the same tokens every run): greedy decoding of random weights repeats one
# token, so every step would route to the same, cached, experts and nothing would stream.
ask = {"prompt": "The quick brown fox jumps over", "n_predict": n, "temperature": 1.0, "top_k": 0,
       "top_p": 1.0, "min_p": 0.0, "seed": 1}
r = s.handle_completions(ask)
t = r["timings"]
print(json.dumps({"load_s": load, "decode_tok_s": t["predicted_per_second"],
                  "prompt_tok_s": t["prompt_per_second"], "tokens": t["predicted_n"],
                  "text": r["choices"][0]["text"]}))
"""


# name -> (write_runnable_gguf's arguments, GB)
MODELS = {"spread": ({}, 2.9), "big": ({"experts": 16, "inter": 2048}, 3.1)}


def run_engine(py: str, model: Path, args: argparse.Namespace, mode: str, cg: MemoryCgroup) -> dict:
    return run_in_cgroup(py, ENGINE, [str(model), str(args.tokens), mode], cg)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rig_arguments(p, ",".join(CONFIGS))
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--model", choices=sorted(MODELS), default="spread", help="the model (default spread)")
    p.add_argument("--modes", default="mmap", help="llama.cpp load modes: mmap,none,direct (default mmap)")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="also read the model file whole with O_DIRECT (dd, 64 MiB and 1 MiB blocks), directly and "
        "through colifs: what a load could gain without the engine's own time between reads",
    )
    return p.parse_args()


def engine_memory(args: argparse.Namespace, mode: str, model: Path) -> int:
    """The engine's memory limit (MiB): --mem-mib for mmap, which streams; no-mmap and direct-I/O
    loads copy the whole model into the engine's own memory, so they get the model plus
    --mem-mib (what they measure is the load: the model read once, from the drives)."""
    if mode == "mmap":
        return args.mem_mib
    return (model.stat().st_size >> 20) + args.mem_mib


def _one_run(
    py: str, rig: Rig, cg: MemoryCgroup, mnt: Path, args: argparse.Namespace, mode: str, config: Config
) -> dict:
    """One engine run of one configuration, caches dropped, the drive's readahead set; with the
    bytes the drives read (what a configuration makes them carry for the same tokens)."""
    set_readahead(rig, config.readahead_kb)
    limit = engine_memory(args, mode, rig.dirs[0] / "model.gguf")
    before = rig.bytes_read()
    r = one_run(
        rig.dirs, mnt, config, cg, limit, lambda root: run_engine(py, root / "model.gguf", args, mode, cg)
    )
    return {**r, "drives_gb": sum(b - a for a, b in zip(before, rig.bytes_read(), strict=True)) / 1e9}


def sequential(rig: Rig, mnt: Path, args: argparse.Namespace) -> None:
    """The model file read whole with O_DIRECT by dd, from the fast drive and through colifs (the
    defaults), caches dropped: a load's upper bound on this rig."""
    a, b = rig.dirs
    model = a / "model.gguf"

    def dd(path: Path, bs: str) -> float:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        t = time.monotonic()
        subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", f"bs={bs}", "iflag=direct"], capture_output=True, check=True
        )
        return model.stat().st_size / (time.monotonic() - t) / 1e6

    print(f"\nthe model read whole with dd iflag=direct, MB/s (drives {args.fast:g} + {args.slow:g} MB/s):")
    for bs in ("64M", "1M"):
        direct = dd(model, bs)
        with measured_mount([a, b], mnt, ["--weights", f"{args.fast:g},{args.slow:g}"]) as (_, figures):
            through = dd(mnt / "model.gguf", bs)
        share = "/".join(f"{x:.2f}" for x in figures["byte_share"])
        print(f"  bs={bs:<4} directly {direct:6.1f}  colifs {through:6.1f} ({through / direct:.2f}x; "
              f"bytes {share}; {figures['daemon_cpu_s_per_gb']:.2f} CPU s/GB)")  # fmt: skip


def _print_results(
    args: argparse.Namespace, configs: list[Config], results: dict[str, dict[str, list[dict]]]
) -> None:
    print()
    print(
        f"llama.cpp (xllamacpp) decoding {args.tokens} tokens of the {args.model} model; drives "
        f"{args.fast:g} + {args.slow:g} MB/s{' (RAM-backed)' if args.ram else ''}"
        f"{', with latency (bandwidth-delay products 560 + 270 KB)' if args.latency else ''}; "
        f"engine memory cgroup "
        f"{args.mem_mib} MiB (no-mmap and direct I/O: the model + that); "
        f"{args.repeats} runs each, interleaved"
    )
    for mode, by in results.items():
        _print_mode(mode, by, configs)


def _print_mode(mode: str, by: dict[str, list[dict]], configs: list[Config]) -> None:
    """One load mode's table: each configuration against the best direct one and, where it ran,
    colifs on the fast drive alone."""
    ref_text = by[configs[0].label][0]["text"]
    median = {c.label: statistics.median(x["decode_tok_s"] for x in by[c.label]) for c in configs}
    best = max(median[c.label] for c in configs if c.baseline)
    alone = next((median[c.label] for c in configs if c.alone), None)
    fastest_load = min(statistics.median(x["load_s"] for x in by[c.label]) for c in configs if c.baseline)
    print(f"\nload mode {mode}:")
    print(f"{'configuration':<42} {'decode tok/s':>13} {'(min-max)':>13} {'vs best direct':>15} "
          f"{'vs colifs fast only':>20} {'prompt tok/s':>13} {'load s':>7} {'load speed-up':>14} "
          f"{'tokens equal':>13} {'drives GB':>10} {'daemon GB':>10} {'CPU s':>6} {'CPU s/GB':>9} "
          f"{'peak RSS MiB':>13} {'readahead KiB':>14} {'host CPU s':>11} {'busy %':>7}")  # fmt: skip
    for c in configs:
        vs_alone = "-" if alone is None else f"{median[c.label] / alone:.2f}"
        _print_row(c.label, by[c.label], median[c.label] / best, vs_alone, fastest_load, ref_text)


def _print_row(
    label: str, runs: list[dict], vs_best: float, vs_alone: str, fastest_load: float, ref: str
) -> None:
    d = [x["decode_tok_s"] for x in runs]
    same = all(x["text"] == ref for x in runs)
    load = statistics.median(x["load_s"] for x in runs)
    print(
        f"{label:<42} {statistics.median(d):>13.2f} {f'{min(d):.2f}-{max(d):.2f}':>13} "
        f"{vs_best:>15.2f} {vs_alone:>20} "
        f"{statistics.median(x['prompt_tok_s'] for x in runs):>13.2f} "
        f"{load:>7.2f} {fastest_load / load:>14.2f} {'yes' if same else 'NO':>13}"
        f" {median_of(runs, 'drives_gb', '.2f'):>10} {median_of(runs, 'daemon_gb', '.2f'):>10}"
        f" {median_of(runs, 'daemon_cpu_s', '.1f'):>6}"
        f" {median_of(runs, 'daemon_cpu_s_per_gb', '.2f'):>9}"
        f" {median_of(runs, 'daemon_peak_rss_mib', '.0f'):>13}"
        f" {median_of(runs, 'readahead_kb', '.0f'):>14}"
        f" {median_of(runs, 'host_cpu_s', '.1f'):>11} {median_of(runs, 'host_busy_pct', '.0f'):>7}"
    )


def main() -> int:
    args = _parse()
    py = engine_python()
    vocab = Path(os.environ.get("COLIFS_GGUF_VOCAB_DIR", Path(__file__).parents[2] / ".cache/gguf-vocab"))
    vocab /= "ggml-vocab-qwen2.gguf"
    if not can_run("llama-decode"):
        return 2
    if not vocab.is_file() or not Path(py).exists():
        print(f"llama-decode: needs {vocab} (make test) and {py} (make bench-engines)", file=sys.stderr)
        return 2

    def write(a: Path) -> None:
        from colifs.synth import write_runnable_gguf

        shape, gb = MODELS[args.model]
        print(f"writing the model ({gb} GB) to both drives ...", file=sys.stderr)
        write_runnable_gguf(str(a / "model.gguf"), str(vocab), **shape)

    def run(rig: Rig, cg: MemoryCgroup, mnt: Path, mode: str, config: Config) -> dict:
        return _one_run(py, rig, cg, mnt, args, mode, config)

    before = (lambda rig, mnt: sequential(rig, mnt, args)) if args.sequential else None
    image_gb = MODELS[args.model][1] + 0.7  # ext4 needs room
    chosen, results = interleaved(args, "llama", write, args.modes.split(","), run, before, image_gb)
    _print_results(args, chosen, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
