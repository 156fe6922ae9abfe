#!/usr/bin/env bash
# transformers from_pretrained and safe_open loading a safetensors MoE checkpoint from two throttled
# drives, directly and through colifs, in a memory cgroup. Root only; cleans up on any exit.
#   contrib/bench/hf-load.sh [--fast 150] [--slow 50] [--mem-mib 1200] [--repeats 3]
#                            [--loaders safe_open,from_pretrained] [--configs ...] [--json FILE]
# Needs `make bench-engines` (torch and transformers in .venv-engines; ENGINE_PYTHON=... for another).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py="${PYTHON:-$here/../../.venv/bin/python}"
exec "$py" "$here/hf_load.py" "$@"
