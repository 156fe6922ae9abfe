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
        ("--extent-buffer-mib", "-1"),
        ("--extent-buffer-mib", "100000"),
    ],
)
def test_a_bad_number_is_one_line(tmp_path: Path, flag: str, value: str) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "mnt").mkdir()
    done = run_colifs("mount", str(tmp_path / "p"), str(tmp_path / "mnt"), flag, value)
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and flag in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_passthrough_needs_the_native_engine(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "mnt").mkdir()
    args = ("--engine", "pyfuse3", "--passthrough")
    done = run_colifs("mount", str(tmp_path / "p"), str(tmp_path / "mnt"), *args)
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and "--passthrough" in done.stderr, done.stderr
