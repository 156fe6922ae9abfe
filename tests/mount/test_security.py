"""Who may use the mount, and a daemon that cannot read a file.

The daemon runs as root here; "another user" is `nobody` (setpriv), and a daemon "without root's
powers" is root with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped: it then meets file modes as
a plain user does, and can still mount.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from colifs.synth import write_checkpoint
from tests.helpers import COLIFS, ROOT, daemon_files, force_unmount, is_mounted, mounted, run_colifs

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv"),
    pytest.mark.mounts,  # every test here runs on both engines
]


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


NO_DAC = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]


def as_nobody(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run([*NOBODY, *cmd], capture_output=True, timeout=30)


def model_in(base: Path) -> tuple[Path, Path]:
    primary, mirror = base / "p", base / "m"
    write_checkpoint(str(primary), "deepseek", layers=1, experts=8, hidden=128, inter=64, shards=2)
    for p in primary.iterdir():
        p.chmod(0o644)  # (safetensors writes 0600)
    (primary / "private.json").write_text("{}")
    (primary / "private.json").chmod(0o600)
    shutil.copytree(primary, mirror)
    return primary, mirror


def test_only_the_mounting_user_unless_allow_other(open_dir: Path) -> None:
    primary, mirror = model_in(open_dir)
    shard = sorted(primary.glob("*.safetensors"))[0]
    with mounted(primary, [mirror], open_dir / "mnt", "--weights", "1,1") as m:
        out = as_nobody("cat", str(m.path / shard.name))
        assert out.returncode != 0 and b"Permission denied" in out.stderr
        assert as_nobody("ls", str(m.path)).returncode != 0
    with mounted(primary, [mirror], open_dir / "mnt", "--weights", "1,1", "--allow-other") as m:
        out = as_nobody("cat", str(m.path / shard.name))
        assert out.returncode == 0 and out.stdout == shard.read_bytes()
        # default_permissions: the kernel checks the primary's modes for other users
        out = as_nobody("cat", str(m.path / "private.json"))
        assert out.returncode != 0 and b"Permission denied" in out.stderr
        out = as_nobody("sh", "-c", f"echo x >> '{m.path / shard.name}'")
        assert out.returncode != 0
        assert (m.path / "private.json").read_text() == "{}"  # the owner (root) still reads it
        assert m.stats()["replicas"][1]["bytes_served"] > 0


def test_a_file_the_daemon_cannot_read(tmp_path: Path) -> None:
    """Mode 000 met by a daemon without root's DAC override: one warning, EACCES, the rest routed."""
    primary, mirror = model_in(tmp_path)
    (primary / "locked.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}      ")
    (primary / "locked.safetensors").chmod(0)
    (primary / "locked.txt").write_text("secret")
    (primary / "locked.txt").chmod(0)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        [*NO_DAC, *COLIFS, "mount", str(primary), str(mirror), str(mnt), "--weights", "1,1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        assert done.returncode == 0, done.stderr
        warned = [x for x in done.stderr.splitlines() if "locked" in x]
        assert warned == [
            "colifs: warning: locked.safetensors: cannot read its header (Permission denied); "
            "served from the primary as plain bytes"
        ]
        assert (mnt / "locked.safetensors").stat().st_mode & 0o777 == 0  # listed as it is
        for name in ("locked.safetensors", "locked.txt"):
            with pytest.raises(PermissionError):
                (mnt / name).read_bytes()  # the daemon's EACCES, passed on
        for p in sorted(primary.glob("model-*.safetensors")):
            assert (mnt / p.name).read_bytes() == p.read_bytes()
        st = run_colifs("stats", str(mnt), "--json")
        assert st.returncode == 0 and '"bytes_served": 0' not in st.stdout  # both drives served
    finally:
        if is_mounted(mnt):
            assert run_colifs("umount", str(mnt)).returncode == 0
        force_unmount(mnt)


def test_the_daemon_opens_nothing_for_writing(model) -> None:
    """Every descriptor the daemon holds on a replica is read-only, while files are open."""
    primary, mirror, mnt = model
    with mounted(primary, [mirror], mnt, "--weights", "1,1") as m:
        pid = m.stats()["pid"]
        held = [open(p, "rb") for p in sorted(mnt.glob("*.safetensors"))]  # noqa: SIM115
        try:
            for f in held:
                f.read(1 << 20)
            seen = 0
            for fd, target in daemon_files(pid).items():
                if target.startswith((str(primary), str(mirror))):
                    try:
                        info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
                    except FileNotFoundError:  # closed since the listing
                        continue
                    flags = int(info.split("flags:")[1].split()[0], 8)
                    assert flags & os.O_ACCMODE == os.O_RDONLY, target
                    seen += 1
            assert seen >= len(held)  # the primary's copies at least (mirrors too, when routed there)
        finally:
            for f in held:
                f.close()


@contextmanager
def fuse_open_to_all() -> Iterator[None]:
    """This container's /dev/fuse is 0600 (distributions ship 0666): opened up for the test only."""
    before = os.stat("/dev/fuse").st_mode & 0o777
    os.chmod("/dev/fuse", before | 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", before)


def nobody_python() -> list[str]:
    """An interpreter `nobody` can run, with colifs and the venv's packages on its path."""
    site = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
    python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if not os.access(python, os.X_OK):
        pytest.skip(f"no {python} for another user (the venv's interpreter may sit in a private home)")
    root = str(ROOT)
    return ["env", f"PYTHONPATH={root}:{site}", "HOME=/tmp", python, "-m", "colifs"]


def test_a_non_root_user_mounts_and_meets_modes(open_dir: Path) -> None:
    primary = open_dir / "p"
    write_checkpoint(str(primary), "deepseek", layers=1, experts=8, hidden=128, inter=64, shards=1)
    (primary / "locked.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}      ")
    (primary / "locked.safetensors").chmod(0)
    for p in [primary, *primary.iterdir()]:
        os.chown(p, 65534, 65534)
    mnt = open_dir / "mnt"
    mnt.mkdir()
    os.chown(mnt, 65534, 65534)
    colifs = [*NOBODY, *nobody_python()]
    shard = next(primary.glob("model-*.safetensors"))
    with fuse_open_to_all():
        out = subprocess.run(
            [*colifs, "mount", str(primary), str(mnt), "--allow-other"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        conf = Path("/etc/fuse.conf")
        if not conf.exists() or "\nuser_allow_other" not in "\n" + conf.read_text():
            assert out.returncode == 32 and "user_allow_other" in out.stderr and not is_mounted(mnt)
        out = subprocess.run(
            [*colifs, "mount", str(primary), str(mnt)], capture_output=True, text=True, timeout=60
        )
        try:
            assert out.returncode == 0, out.stderr
            assert "locked.safetensors: cannot read its header (Permission denied)" in out.stderr
            got = as_nobody("cat", str(mnt / shard.name))
            assert got.returncode == 0 and got.stdout == shard.read_bytes()
            got = as_nobody("cat", str(mnt / "locked.safetensors"))
            assert got.returncode != 0 and b"Permission denied" in got.stderr
            with pytest.raises(PermissionError):
                (mnt / shard.name).read_bytes()  # root is "another user" of nobody's mount
        finally:
            done = subprocess.run([*colifs, "umount", str(mnt)], capture_output=True, text=True, timeout=60)
            force_unmount(mnt)
        assert done.returncode == 0, done.stderr
