#!/usr/bin/env bash
# Colibrì decoding a GLM-shaped MoE model from two throttled drives: directly, with its own mirror and
# through colifs; buffered and O_DIRECT reads; in a memory cgroup below the model's size. Root only.
#   contrib/bench/colibri-decode.sh --colibri DIR [--fast 150] [--slow 50] [--tokens 16] [--repeats 3] ...
# DIR (or $COLIBRI): a built Colibrì checkout (v1.6.2, see its README). Needs `make bench-engines`
# (torch in .venv-engines, for Colibrì's converter; ENGINE_PYTHON=... for another).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py="${PYTHON:-$here/../../.venv/bin/python}"
exec "$py" "$here/colibri_decode.py" "$@"
