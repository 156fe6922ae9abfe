"""The systemd unit and the fstab example shipped are valid."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from colifs.fstab import mount_args
from tests.helpers import ROOT


def test_the_systemd_unit_and_the_fstab_example_are_valid(tmp_path: Path) -> None:
    import shlex

    from colifs.cli import parser

    contrib = ROOT / "contrib" / "systemd"
    unit = (contrib / "colifs-model.service").read_text()
    commands = [
        line.split("=", 1)[1]
        for line in unit.splitlines()
        if line.startswith(("ExecStart=", "ExecStop=", "ExecReload="))
    ]
    assert len(commands) == 3
    for cmd in commands:  # every flag the example uses is a real colifs flag
        words = shlex.split(cmd)
        assert words[0] == "/opt/colifs/bin/colifs"
        parser().parse_args(words[1:])
    if shutil.which("systemd-analyze"):
        local = tmp_path / "colifs-model.service"
        local.write_text(
            unit.replace("/opt/colifs/bin/colifs", str(Path(sys.executable).with_name("colifs")))
        )
        out = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", str(local)], capture_output=True, text=True
        )
        assert out.returncode == 0 and out.stderr == "", out.stderr
    lines = [x for x in (contrib / "fstab.example").read_text().splitlines() if x and not x.startswith("#")]
    assert lines
    for line in lines:
        source, mountpoint, kind, options = line.split()[:4]
        assert kind == "fuse.colifs"
        assert "--weights" in mount_args(source, mountpoint, options)
