#!/usr/bin/env bash
# llama.cpp (xllamacpp) decoding a synthetic MoE GGUF from two throttled drives, directly and
# through colifs, in a memory cgroup below the model's size. Root only; cleans up on any exit.
#   contrib/bench/llama-decode.sh [--fast 150] [--slow 50] [--mem-mib 1200] [--tokens 24] [--repeats 3]
#                                 [--modes mmap,none,direct] [--json FILE]
# Needs `make bench-engines` (xllamacpp in .venv-engines; ENGINE_PYTHON=... for another) and the
# vocabulary files `make test` fetches (COLIFS_GGUF_VOCAB_DIR=... for another place).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py="${PYTHON:-$here/../../.venv/bin/python}"
exec "$py" "$here/llama_decode.py" "$@"
