#!/usr/bin/env bash
# The two-drive benchmark: two loop-backed ext4 filesystems throttled by a blkio cgroup (default
# 150 and 50 MB/s), one synthetic MoE checkpoint on both, every phase with cold caches; prints a
# table and the ratios. Root only. Cleans up (mounts, loop devices, cgroup) on any exit.
#   contrib/bench/dual-drive.sh [--fast 150] [--slow 50] [--symmetric 100] [--threads 16]
#                               [--seconds 10] [--model-gb 2] [--json FILE]
# Uses the checkout's venv (make test or make demo creates it); PYTHON=... to use another.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py="${PYTHON:-$here/../../.venv/bin/python}"
exec "$py" "$here/dual_drive.py" "$@"
