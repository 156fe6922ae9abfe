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


def test_an_engine_and_the_python_object_that_holds_it_are_collected(tmp_path) -> None:
    """The engine's callbacks are bound methods of the NativeEngine that holds it: a cycle the
    garbage collector must see through (the Engine type takes part in it), once it is closed."""
    done = run(
        f"""
import gc, weakref
from colifs.assemble import assemble
from colifs.config import MountConfig
from colifs.synth import write_checkpoint

import os
os.mkdir(f"{tmp_path}/mnt")
for d in ("p", "m"):
    write_checkpoint(f"{tmp_path}/{{d}}", "deepseek", layers=2, experts=4, hidden=64, inter=64, shards=2)
cfg = MountConfig(primary={str(tmp_path / "p")!r}, mirrors=[{str(tmp_path / "m")!r}],
                  mountpoint={str(tmp_path / "mnt")!r}, weights=[1.0, 1.0], probe_seconds=0, engine="native")
asm = assemble(cfg)
assert gc.is_tracked(asm.engine.engine)
asm.engine.close()
held = weakref.ref(asm.engine)
del asm
gc.collect()
print("collected" if held() is None else "kept")
"""
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "collected"
