"""Packaging and the command line as installed: --version, help, completion, the wheel."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
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
    assert sorted(complete("colifs mount --routing ")) == ["expert", "queue", "stripe"]
    assert complete("colifs stats --pro") == ["--prometheus"]
    assert "README.md" in complete("colifs route READ")
    assert complete("colifs mirror re") == ["remove"] and complete("colifs mirror a") == ["add"]
    assert complete("colifs mirror add /mnt /m --we") == ["--weight"]
    script = run_colifs("completion", "bash").stdout
    for sub in _subparsers(parser()).values():
        for action in sub._actions:
            for opt in action.option_strings:
                assert f" {opt} " in script or f' {opt}"' in script or f'"{opt} ' in script, opt


# A Python warning (BuildBackendWarning, SetuptoolsDeprecationWarning, ...), a deprecation in any
# words, or a compiler warning: each a build that may stop working with the next setuptools or gcc.
WARNING = re.compile(r"\w*Warning\b|deprecat|: warning:", re.IGNORECASE)


def test_sdist_then_wheel_build_without_a_warning(tmp_path: Path) -> None:
    """The way `pip install .` builds (isolated environments, the newest setuptools), and the way a
    user's build from the sdist does: the sdist holds what the build needs, the wheel the native
    engine and both commands, and nothing the build printed is a warning."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # a user's default
    out = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    warned = [line for line in (out.stdout + out.stderr).splitlines() if WARNING.search(line)]
    # pip's notes about its own index configuration are not the build's
    warned = [line for line in warned if "Location 'file:" not in line]
    assert not warned, "\n".join(warned)
    (sdist,) = tmp_path.glob("colifs-*.tar.gz")
    with tarfile.open(sdist) as t:
        inside = {Path(*Path(n).parts[1:]).as_posix() for n in t.getnames()}
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "native").iterdir()}
    assert {"LICENSE", "setup.py", "pyproject.toml", "README.md"} | sources <= inside
    (wheel,) = tmp_path.glob("colifs-*.whl")
    assert wheel.name.startswith(f"colifs-{__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "colifs").rglob("*.py")}
        inside = {n for n in names if n.startswith("colifs/")}
        native = {n for n in inside if n.startswith("colifs/_native.") and n.endswith(".so")}
        assert len(native) == 1, inside  # the native engine, compiled by the wheel build
        assert inside - native == modules
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        scripts = z.read(entry).decode()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert "colifs = colifs.cli:main" in scripts and "mount.fuse.colifs = colifs.fstab:main" in scripts
    assert "License-Expression: Apache-2.0" in metadata


def build_native(tmp_path: Path, **env: str) -> tuple[int, list[str]]:
    """`pip wheel` of a copy of the sources with `env` added: its exit code and output lines."""
    src = tmp_path / "src"
    if not src.exists():
        shutil.copytree(
            ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "tests", "docs")
        )
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "w"), str(src)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **env},
    )  # fmt: skip
    return out.returncode, [line.strip() for line in (out.stdout + out.stderr).splitlines()]


def test_a_missing_build_dependency_is_one_line_naming_its_package(tmp_path: Path) -> None:
    code, lines = build_native(tmp_path, CC="/nonexistent/cc")
    assert code != 0
    assert (
        "colifs: building the native engine needs a C compiler (/nonexistent/cc not found) "
        "(Debian/Ubuntu: apt-get install gcc)"
    ) in lines
    old = tmp_path / "pc"
    old.mkdir()
    (old / "fuse3.pc").write_text("Name: fuse3\nDescription: old\nVersion: 3.10.5\nCflags:\nLibs: -lfuse3\n")
    code, lines = build_native(tmp_path, PKG_CONFIG_PATH=str(old), PKG_CONFIG_LIBDIR=str(old))
    assert code != 0
    assert (
        "colifs: building the native engine needs libfuse 3.12 or newer (found 3.10.5) "
        "(Debian/Ubuntu: apt-get install libfuse3-dev)"
    ) in lines
