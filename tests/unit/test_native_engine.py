"""The native engine's Python type when its construction fails: nothing it did not take is
released, and closing it is harmless (colifs._native.Engine, native/module.c). Each case runs in
a child process: on a regression it would end the interpreter, not fail an assertion."""

from __future__ import annotations

import subprocess
import sys

BAD_ENGINE = """
import gc, sys
from colifs import _native

def callback(): ...

def bad_engine():  # its arguments fail after they were parsed: one expert byte too many
    _native.Engine(
        mountpoint=b"/nonexistent", options=b"ro", roots=[b"/"], direct=False, fuse_threads=1,
        drive_threads=1, mirror_timeout=0.0, nodes=[], children=[], files=[], nkeys=1,
        counters=bytearray(8 * 64), control=callback, xattr=callback, listxattr=callback,
        event=callback, routes=b"", expert_keys=b"\\0\\0",
    )
"""


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_failed_construction_leaves_the_callbacks_references_as_they_were() -> None:
    done = run(
        BAD_ENGINE
        + """
before = sys.getrefcount(callback)
for _ in range(3):
    try:
        bad_engine()
    except ValueError as e:
        assert "expert_keys" in str(e)
gc.collect()
print(before, sys.getrefcount(callback))
"""
    )
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = done.stdout.split()
    assert before == after


def test_closing_an_engine_that_never_initialised_is_harmless() -> None:
    done = run(
        "from colifs import _native\n"
        "e = _native.Engine.__new__(_native.Engine)\n"
        "e.close(); e.close(); del e\n"
        "print('ok')\n"
    )
    assert done.returncode == 0 and done.stdout == "ok\n", done
