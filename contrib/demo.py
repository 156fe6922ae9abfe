"""`make demo`: a synthetic MoE model on two directories, mounted, read with a real loader, unmounted.

The mirror lacks one shard on purpose (a partial second drive is normal): that shard is served from
the primary only, with one warning at mount. The mount learns the usage; `colifs plan` and
`colifs stage` then put the missing shard on the mirror, `colifs verify --deep` checks every byte,
and a second mount serves all shards from both drives; `colifs route` shows where one byte goes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors import safe_open

from colifs.synth import write_checkpoint

COLIFS = [sys.executable, "-m", "colifs"]


def step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="colifs-demo-"))
    fast, second, mnt = work / "fast", work / "second", work / "mnt"
    mnt.mkdir()
    try:
        step(f"writing a synthetic DeepSeek-style MoE checkpoint to {fast}")
        paths = write_checkpoint(str(fast), "deepseek", layers=6, experts=32, hidden=256, inter=128, shards=6)
        size = sum(Path(p).stat().st_size for p in paths)
        print(f"{len(paths)} shards, {size / 1e6:.1f} MB")
        step(f"copying it to {second}, all but the last shard (a partial mirror)")
        shutil.copytree(fast, second, ignore=shutil.ignore_patterns(Path(paths[-1]).name))
        step(f"colifs mount {fast} {second} {mnt} --weights 3,1")
        subprocess.run([*COLIFS, "mount", str(fast), str(second), str(mnt), "--weights", "3,1"], check=True)
        step("reading every tensor through the mount with safetensors.safe_open, checking each")
        t0 = time.monotonic()
        count = nbytes = 0
        for p in sorted(mnt.glob("*.safetensors")):
            with safe_open(p, "numpy") as via, safe_open(fast / p.name, "numpy") as ref:
                for k in via.keys():  # noqa: SIM118 (safe_open is not iterable)
                    a = via.get_tensor(k)
                    if a.tobytes() != ref.get_tensor(k).tobytes():
                        print(f"MISMATCH in {p.name}: {k}")
                        return 1
                    count += 1
                    nbytes += a.nbytes
        print(
            f"{count} tensors, {nbytes / 1e6:.1f} MB, identical to the primary, {time.monotonic() - t0:.2f} s"
        )
        step(f"cat {mnt}/.colifs/stats")
        print((mnt / ".colifs" / "stats").read_text(), end="")
        step(f"colifs stats {mnt}")
        subprocess.run([*COLIFS, "stats", str(mnt)], check=True)
        step(f"colifs umount {mnt}   (the usage it learned goes to {fast}/.colifs-usage.json)")
        subprocess.run([*COLIFS, "umount", str(mnt)], check=True)
        budget = str(size * 2)
        step(f"colifs plan {fast} {second} --budget {budget} --weights 3,1")
        subprocess.run(
            [*COLIFS, "plan", str(fast), str(second), "--budget", budget, "--weights", "3,1"], check=True
        )
        step(f"colifs stage {fast} {second} --budget {budget}")
        subprocess.run([*COLIFS, "stage", str(fast), str(second), "--budget", budget], check=True)
        step(f"colifs verify {fast} {second} --deep")
        subprocess.run([*COLIFS, "verify", str(fast), str(second), "--deep", "-q"], check=True)
        step(f"colifs mount {fast} {second} {mnt} --weights 3,1   (now every shard on both)")
        subprocess.run([*COLIFS, "mount", str(fast), str(second), str(mnt), "--weights", "3,1"], check=True)
        shard = mnt / Path(paths[2]).name
        step(f"colifs route {shard.name} 1048576")
        subprocess.run([*COLIFS, "route", str(shard), "1048576"], check=True)
    finally:
        step(f"colifs umount {mnt}")
        if mnt.is_mount():
            subprocess.run([*COLIFS, "umount", str(mnt)])
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
