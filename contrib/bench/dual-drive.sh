#!/usr/bin/env bash
# The two-drive benchmark: two loop-backed ext4 filesystems throttled by a blkio cgroup (default
# 150 and 50 MB/s), one synthetic MoE checkpoint on both, every phase with cold caches; prints a
# table and the ratios. Root only. Cleans up (mounts, loop devices, cgroup) on any exit.
#   contrib/bench/dual-drive.sh [--fast 150] [--slow 50] [--symmetric 100] [--threads 16]
#                               [--seconds 10] [--model-gb 2] [--json FILE]
# Fast drives (RAM-backed, default 900 + 300 MB/s: the daemon becomes the limit; both engines,
# mergerfs as the reference, daemon CPU per GB, a sweep of drive speeds):
#   contrib/bench/dual-drive.sh --fast-drives [--fast 900] [--slow 300] [--sweep 150,...,3000]
# Uses the checkout's venv (make test or make demo creates it); PYTHON=... to use another.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py="${PYTHON:-$here/../../.venv/bin/python}"
for arg in "$@"; do
  [ "$arg" = --fast-drives ] && exec "$py" "$here/fast_drives.py" "$@"
done
exec "$py" "$here/dual_drive.py" "$@"
