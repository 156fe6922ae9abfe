"""Commands about two directories (`colifs plan`, `stage`) never wait on another mount (issue 40):
they ask the other colifs daemons what they serve on their control sockets, with a bound, and
compare the paths each daemon resolved at mount as strings. No path under another mount is
stat-ed: a mirror whose every call hangs (faultfs `hang-all`) held `colifs plan` for good, as
`os.path.realpath` of that mirror's mount point never returned, not even to SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from colifs.synth import write_checkpoint
from tests.helpers import COLIFS, force_unmount, mounted, run_colifs
from tests.mount.test_faults import faulty_mirror

PLAN_WITHIN = 20.0  # s: a plan of a small model takes ~1 s; the other daemons get 5 s in all


def pair(root: Path, name: str) -> tuple[Path, Path]:
    """A small model and a full copy of it: (primary, mirror)."""
    primary, mirror = root / f"{name}-p", root / f"{name}-m"
    write_checkpoint(str(primary), "deepseek", layers=2, experts=8, hidden=128, inter=64, shards=2)
    shutil.copytree(primary, mirror)
    return primary, mirror


@contextlib.contextmanager
def hung_mount(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """Another colifs mount whose mirror (faultfs) hangs every call, its mount point's getattr
    included, for the block (every file read through it first, so it holds descriptors there):
    (its mount point, the mirror's)."""
    primary, source = pair(tmp_path, "other")
    control, hung = tmp_path / "control", tmp_path / "hung"
    with (
        faulty_mirror(source, hung, control),
        mounted(primary, [hung], tmp_path / "other-mnt", "--weights", "1,1") as m,
    ):
        files = [open(m.path / p.name, "rb") for p in sorted(primary.glob("*.safetensors"))]  # noqa: SIM115
        for f in files:
            f.read()
        assert m.stats()["replicas"][1]["bytes_served"] > 0
        control.write_text("hang-all")
        try:
            yield m.path, hung
        finally:
            control.write_text("ok")  # the unmount closes its descriptors there
            for f in files:
                f.close()


@contextlib.contextmanager
def our_mount(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """The plan's pair, mounted with an empty mirror that `colifs stage` fills (so not through
    tests.helpers.mounted, which checks mirrors unchanged): (primary, mirror, mount point)."""
    primary, _ = pair(tmp_path, "ours")
    mirror, mnt = tmp_path / "ours-empty", tmp_path / "ours-mnt"
    mirror.mkdir()
    mnt.mkdir()
    out = run_colifs("mount", str(primary), str(mirror), str(mnt), "--weights", "1,1")
    assert out.returncode == 0, out.stderr
    try:
        yield primary, mirror, mnt
    finally:
        run_colifs("umount", str(mnt))
        force_unmount(mnt)


def plan(primary: Path, mirror: Path, *more: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*COLIFS, "plan", str(primary), str(mirror), "--weights", "1,1", "--budget", "1G", "--json", *more],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen, within: float) -> tuple[str, str]:
    """(stdout, stderr) of `proc` once it ended, within `within` s (killed and failed after)."""
    try:
        out, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()  # SIGKILL may not end it either (a thread in an uninterruptible wait)
        raise AssertionError(f"still running after {within:g} s") from None
    return out, err


def test_plan_and_stage_return_while_another_mounts_mirror_hangs(tmp_path: Path) -> None:
    with hung_mount(tmp_path), our_mount(tmp_path) as (primary, mirror, mnt):
        t0 = time.monotonic()
        out, err = finished(plan(primary, mirror), PLAN_WITHIN)
        took = time.monotonic() - t0
        assert json.loads(out)["mounts_using_mirror"] == [str(mnt)], err
        assert took < 10, took  # every daemon answered: no wait on a timeout either
        assert str(tmp_path) not in err, err  # both mounts checked (other tests' mounts may not be)
        staged = run_colifs("stage", str(primary), str(mirror), "--budget", "1G", "-q", timeout=PLAN_WITHIN)
        assert staged.returncode == 0, staged.stderr
        assert f"{mnt} reloaded, mirror {mirror}: 2 files added" in staged.stdout, staged.stdout


def test_a_mirror_whose_every_call_hangs_is_removed_at_once(tmp_path: Path) -> None:
    """`colifs mirror remove` is how a hung drive is taken away: the daemon finds it by the path it
    mounted (it resolved every mirror's root again, on its loop, and hung there with it)."""
    with hung_mount(tmp_path) as (mnt, hung):
        t0 = time.monotonic()
        out = run_colifs("mirror", "remove", str(mnt), str(hung), "--timeout", "10", timeout=PLAN_WITHIN)
        assert out.returncode == 0 and out.stdout.startswith(f"mirror {hung} removed"), out
        assert time.monotonic() - t0 < 5
        health = json.loads((mnt / ".colifs" / "stats.json").read_text())["replicas"][1]["health"]
        assert health["state"] == "removed"


def test_sigterm_ends_a_plan_that_waits_on_a_daemon(tmp_path: Path) -> None:
    """A daemon that does not answer (stopped) costs the plan its bound (one line says so), and a
    SIGTERM ends the plan at once meanwhile: it waits on sockets, never on a file system."""
    with hung_mount(tmp_path), our_mount(tmp_path) as (primary, mirror, mnt):
        pid = json.loads((mnt / ".colifs" / "stats.json").read_text())["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            out, err = finished(plan(primary, mirror), PLAN_WITHIN)
            assert 4 < time.monotonic() - t0 < PLAN_WITHIN
            assert json.loads(out)["mounts_using_mirror"] == []
            said = [line for line in err.splitlines() if str(mnt) in line]
            assert said == [f"colifs: {mnt}: its daemon does not answer; not checked"]
            proc = plan(primary, mirror)
            time.sleep(1.5)  # asking the daemons by now
            assert proc.poll() is None
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            finished(proc, 3)
            assert proc.returncode == -signal.SIGTERM and time.monotonic() - t0 < 1
        finally:
            os.kill(pid, signal.SIGCONT)
