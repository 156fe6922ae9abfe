"""Packaging and the command line as installed: --version, help, completion, the wheel."""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

from colifs import __version__
from colifs.cli import parser
from colifs.completion import _subparsers
from tests.helpers import ROOT, run_colifs


def test_version_and_every_subcommand_and_option_documented() -> None:
    out = run_colifs("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"colifs {__version__}"
    subs = _subparsers(parser())
    assert {"mount", "umount", "stats", "top", "route", "plan", "stage", "verify", "probe", "bench"} <= set(
        subs
    )
    for name, sub in subs.items():
        assert sub.description, name
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, (name, action.dest)  # nothing undocumented in --help
        assert run_colifs(name, "--help").returncode == 0


def complete(words: str) -> list[str]:
    script = run_colifs("completion", "bash").stdout
    line = words.split(" ")
    prog = f"""{script}
COMP_WORDS=({" ".join(repr(w) for w in line)})
COMP_CWORD={len(line) - 1}
_colifs
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    out = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_bash_completion_knows_every_command_option_and_choice() -> None:
    assert complete("colifs mo") == ["mount"]
    assert complete("colifs st") == ["stage", "stats"]
    assert complete("colifs mount --rou") == ["--routing"]
    assert sorted(complete("colifs mount --routing ")) == ["expert", "stripe"]
    assert complete("colifs stats --pro") == ["--prometheus"]
    assert "README.md" in complete("colifs route READ")
    script = run_colifs("completion", "bash").stdout
    for sub in _subparsers(parser()).values():
        for action in sub._actions:
            for opt in action.option_strings:
                assert f" {opt} " in script or f' {opt}"' in script or f'"{opt} ' in script, opt


def test_pip_builds_a_wheel_with_both_commands(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("colifs-*.whl")
    assert wheel.name.startswith(f"colifs-{__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        modules = {p.name for p in (ROOT / "colifs").glob("*.py")}
        inside = {Path(n).name for n in names if n.startswith("colifs/")}
        native = {n for n in inside if n.startswith("_native.") and n.endswith(".so")}
        assert len(native) == 1, inside  # the native engine, compiled by the wheel build
        assert inside - native == modules
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        scripts = z.read(entry).decode()
    assert "colifs = colifs.cli:main" in scripts and "mount.fuse.colifs = colifs.fstab:main" in scripts
