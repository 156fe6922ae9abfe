"""The native engine's Python type (colifs._native.Engine, native/module.c): its contract with
Python checked field by field (the counters' layout, node kinds, routing constants); a failed
construction releases nothing it did not take and closing it is harmless; it is collected with the
object that holds it. Cases that could end the interpreter run in a child process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from colifs import _native
from colifs.native import FILLS, PASSTHROUGH

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
    garbage collector must see through (the Engine type takes part in it). Once closed, or never
    mounted (no thread of its own yet), both go; none is left behind, not even an emptied one."""
    done = run(
        f"""
import gc, os
from colifs.assemble import assemble
from colifs.config import MountConfig
from colifs.native import NativeEngine
from colifs.synth import write_checkpoint

os.mkdir(f"{tmp_path}/mnt")
for d in ("p", "m"):
    write_checkpoint(f"{tmp_path}/{{d}}", "deepseek", layers=2, experts=4, hidden=64, inter=64, shards=2)
cfg = MountConfig(primary={str(tmp_path / "p")!r}, mirrors=[{str(tmp_path / "m")!r}],
                  mountpoint={str(tmp_path / "mnt")!r}, weights=[1.0, 1.0], probe_seconds=0, engine="native")
closed, unmounted = assemble(cfg), assemble(cfg)
assert gc.is_tracked(closed.engine.engine)
closed.engine.close()
del closed, unmounted
gc.collect()
print(sum(1 for o in gc.get_objects() if type(o) is NativeEngine))
"""
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0"


# What Python reads of the counters' memory: each field's words for (drive slots, nkeys, nfiles).
# Per drive: MAX_REPLICAS slots from the start, so that a mirror added while serving moves nothing.
COUNTER_FIELDS = {
    "drive_bytes": lambda r, k, f: r,
    "drive_reads": lambda r, k, f: r,
    "drive_errors": lambda r, k, f: r,
    "drive_busy": lambda r, k, f: r,
    "drive_ok": lambda r, k, f: r,
    "drive_busy_ns": lambda r, k, f: r,
    "drive_alone_ns": lambda r, k, f: r,
    "drive_spilled": lambda r, k, f: r,
    "fallbacks": lambda r, k, f: 2,  # fallbacks, late reads skipped
    "fill": lambda r, k, f: len(FILLS),
    "passthrough": lambda r, k, f: len(PASSTHROUGH),
    "key_bytes": lambda r, k, f: k * r,
    "key_reads": lambda r, k, f: k,
    "file_bytes": lambda r, k, f: f,
    "file_reads": lambda r, k, f: f,
}


@pytest.mark.parametrize(("nkeys", "nfiles"), [(0, 0), (5, 3), (1000, 163)])
def test_the_counter_layout_is_what_python_reads_field_by_field(nkeys: int, nfiles: int) -> None:
    layout = _native.counter_layout(nkeys, nfiles)
    assert [name for name, _ in layout] == list(COUNTER_FIELDS)  # every field, in the engine's order
    for name, words in layout:
        assert words == COUNTER_FIELDS[name](_native.MAX_REPLICAS, nkeys, nfiles), name


def test_the_constants_python_uses_are_the_engines() -> None:
    from colifs.routing import CHUNK, NOT_STRIPED, STRIPE_SLOTS

    assert (_native.STRIPE_SLOTS, _native.NOT_STRIPED, _native.CHUNK) == (STRIPE_SLOTS, NOT_STRIPED, CHUNK)
    kinds = set(_native.NODE_KINDS)
    assert kinds == {"dir", "reg", "lnk", "control_dir", "control_file"}  # what _namespace_tables sends
    assert len(set(_native.NODE_KINDS.values())) == len(kinds)
