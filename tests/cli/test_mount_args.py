"""`colifs mount`'s numbers: a bad one is one line naming the flag, exit code 2, nothing mounted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_colifs


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--mirror-timeout", "inf"),
        ("--mirror-timeout", "nan"),
        ("--mirror-timeout", "1e12"),
        ("--mirror-timeout", "-1"),
        ("--fill-mib", "-1"),
        ("--fill-mib", "100000"),
    ],
)
def test_a_bad_number_is_one_line(tmp_path: Path, flag: str, value: str) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "mnt").mkdir()
    done = run_colifs("mount", str(tmp_path / "p"), str(tmp_path / "mnt"), flag, value)
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and flag in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("flags", [("--passthrough",), ("--routing", "queue")])
def test_native_only_flags_need_the_native_engine(tmp_path: Path, flags: tuple[str, ...]) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "mnt").mkdir()
    done = run_colifs("mount", str(tmp_path / "p"), str(tmp_path / "mnt"), "--engine", "pyfuse3", *flags)
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and " ".join(flags) in done.stderr, done.stderr


@pytest.mark.parametrize("flags", [("--adaptive-weights",)])
def test_fixed_weights_refuse_what_would_move_the_split(tmp_path: Path, flags: tuple[str, ...]) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "mnt").mkdir()
    done = run_colifs("mount", str(tmp_path / "p"), str(tmp_path / "mnt"), "--fixed-weights", *flags)
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and "--fixed-weights" in done.stderr and flags[0] in done.stderr
