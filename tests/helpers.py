"""What the test layers share: synthetic model directories, assembling a mount's object graph
without mounting (tests/ops), real mounts through the CLI (tests/mount), cache control."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from colifs.assemble import Assembly, assemble
from colifs.backing import BLOCK, BackingIO
from colifs.config import MountConfig
from colifs.formats import format_of
from colifs.formats.gguf import gguf_tensor_spans
from colifs.formats.layout import ExpertKey
from colifs.kernel import mount_type
from colifs.pyfuse3.fs import ColiFS
from colifs.synth import write_checkpoint, write_gguf

COLIFS = [sys.executable, "-m", "colifs"]
ROOT = Path(__file__).resolve().parents[1]  # the repository
# Weights given and no drive timed: the drives' depth stays unknown, so fills run. Timed, the test
# drives (the page cache behind them) need no reads in flight: fills would stay off.
UNTIMED = ("--weights", "1,1", "--probe-seconds", "0")


# -- the object graph without a mount (tests/ops) ---------------------------------------------------


def assembled(
    root: Path, primary: Path, mirrors: list[Path], weights: list[float], io: BackingIO | None = None,
    **cfg: Any,
) -> Assembly:  # fmt: skip
    """The pyfuse3 engine's graph, as `serve` builds it, over an empty mount point in `root` (never
    mounted): no probe, no usage file unless asked."""
    mnt = root / "unmounted"
    mnt.mkdir(exist_ok=True)
    config = MountConfig(
        str(primary), [str(m) for m in mirrors], str(mnt), list(weights), "test", engine="pyfuse3",
        **{"usage": False, "threads_per_drive": 2, **cfg},
    )  # fmt: skip
    return assemble(config, io)


def ops_of(asm: Assembly) -> ColiFS:
    return asm.engine.ops  # type: ignore[attr-defined]


def run_ops(asm: Assembly, fn: Callable[[], Awaitable[object]]) -> object:
    """Run `fn` on trio; the engine's threads are closed whatever happens."""
    try:
        return trio.run(fn)
    finally:
        asm.engine.close()


# -- real mounts through the CLI (tests/mount) --------------------------------------------------------


def run_colifs(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60, colifs: list[str] = COLIFS
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*colifs, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def is_mounted(path: Path) -> bool:
    return mount_type(str(path)) is not None


def force_unmount(path: Path) -> None:
    if is_mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Content hash and mtime of every file under root."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


@dataclass
class Mount:
    path: Path
    primary: Path
    mirrors: list[Path]
    stderr: str

    def stats(self) -> dict:
        return json.loads((self.path / ".colifs" / "stats.json").read_text())


_DAEMON_LOGS: list[str] = []


def daemon_logs() -> list[str]:
    """The log files of the daemons the running test mounted (conftest checks them for warnings)."""
    return _DAEMON_LOGS


@contextmanager
def mounted(
    primary: Path,
    mirrors: list[Path],
    mnt: Path,
    *extra: str,
    env=None,
    colifs: list[str] = COLIFS,
) -> Iterator[Mount]:
    """Mount with the real CLI (or `colifs`, a command that runs it); unmount (and check every
    mirror unchanged) whatever happens. The daemon logs to a file (its own --log-file, if given)."""
    before = {m: snapshot(m) for m in mirrors}
    mnt.mkdir(exist_ok=True)
    if "--log-file" in extra:
        log = extra[extra.index("--log-file") + 1]
    else:
        log = str(mnt.parent / f"{mnt.name}.daemon.log")
        extra = (*extra, "--log-file", log)
    _DAEMON_LOGS.append(log)
    done = run_colifs("mount", str(primary), *map(str, mirrors), str(mnt), *extra, env=env, colifs=colifs)
    try:
        assert done.returncode == 0, done.stderr
        assert is_mounted(mnt)
        yield Mount(mnt, primary, mirrors, done.stderr)
    finally:
        if is_mounted(mnt):
            out = run_colifs("umount", str(mnt))
            force_unmount(mnt)
            assert out.returncode == 0, out.stderr
        for m in mirrors:
            assert snapshot(m) == before[m], f"mirror {m} changed"


def calls_returned(m: Any, within: float = 10.0) -> None:
    """Wait until no removed mirror's drive has a call of the daemon inside it (stats.json
    `reload.calls_left_behind` empty); fails past `within` seconds, showing what is left."""
    deadline = time.monotonic() + within
    while m.stats()["reload"]["calls_left_behind"]:
        assert time.monotonic() < deadline, m.stats()["reload"]
        time.sleep(0.05)


def daemon_files(pid: int) -> dict[int, str]:
    """What each of a process's descriptors points at, those closed while listed left out (its
    threads open and close descriptors while a test looks)."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
    return out


def drop_file_cache(path: Path) -> None:
    """Evict a file from the page cache (so the next read through a mount reaches the daemon)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- model files ---------------------------------------------------------------------------------------


def shards(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def read_direct(path: Path, off: int, size: int) -> bytes:
    """pread through O_DIRECT: bypasses the mount's page cache, so the daemon serves every byte."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, max(size, 1))
        n = os.preadv(fd, [memoryview(buf)[:size]], off)
        return bytes(buf[:n])
    finally:
        os.close(fd)


def expert_spans(root: Path) -> dict[ExpertKey, list[tuple[str, int, int]]]:
    """Where each expert's bytes are: (file, start, end) per tensor, from the headers (any format)."""
    out: dict[ExpertKey, list[tuple[str, int, int]]] = {}
    for p in sorted(root.iterdir()):
        fmt = format_of(p.name)
        if fmt is None:
            continue
        _, _, layout = fmt.read(str(p))
        for s, e, k in layout.extents():
            if isinstance(k, ExpertKey):
                out.setdefault(k, []).append((p.name, s, e))
    return out


def read_experts(mnt: Path, spans: dict, keys: list[ExpertKey], times: int = 1) -> int:
    """Read the experts' bytes through the mount with O_DIRECT (every byte reaches the daemon)."""
    fds: dict[str, int] = {}
    buf = mmap.mmap(-1, 1 << 22)
    n = 0
    try:
        for _ in range(times):
            for k in keys:
                for name, s, e in spans[k]:
                    if name not in fds:
                        fds[name] = os.open(mnt / name, os.O_RDONLY | os.O_DIRECT)
                    got = os.preadv(fds[name], [memoryview(buf)[: e - s]], s)
                    assert got == e - s
                    n += got
    finally:
        for fd in fds.values():
            os.close(fd)
    return n


# -- a smaller mirror (plan, stage) -------------------------------------------------------------------

HOT = (  # the shards of skewed_model's hot experts
    "model-00003-of-00008.safetensors",
    "model-00006-of-00008.safetensors",
)


@contextmanager
def small_drive(path: Path, mib: int) -> Iterator[Path]:
    """A tmpfs of known size: the mirror drive whose free space the plan must respect."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}M", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def skewed_model(
    tmp_path: Path, hidden: int = 256, inter: int = 128, experts: int = 16
) -> tuple[Path, dict, list, list]:
    """8 shards; (primary, expert ranges, hot experts (all in HOT), cold experts)."""
    primary = tmp_path / "p"
    write_checkpoint(
        str(primary), "deepseek", layers=4, experts=experts, hidden=hidden, inter=inter, shards=8
    )
    ranges = expert_spans(primary)
    hot = [k for k, where in ranges.items() if all(name in HOT for name, _, _ in where)]
    cold = [k for k in ranges if k not in hot]
    assert hot and cold
    return primary, ranges, hot, cold


def learn_usage(primary: Path, ranges: dict, hot: list, cold: list, mnt: Path, *extra: str) -> dict:
    """A skewed workload through a real mount (hot experts 10x, cold ones once); its stats."""
    with mounted(primary, [], mnt, *extra) as m:
        read_experts(m.path, ranges, hot, times=10)
        read_experts(m.path, ranges, cold)
        return m.stats()


def plan_json(primary: Path, mirror: Path, *args: str) -> dict:
    out = run_colifs("plan", str(primary), str(mirror), "--weights", "1,1", "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extents_of(path: Path, key: ExpertKey) -> list[tuple[int, int]]:
    """Where a routed expert's bytes are in one model file, extent by extent."""
    fmt = format_of(path.name)
    assert fmt is not None
    return [(s, e) for s, e, k in fmt.read(str(path))[2].extents() if k == key]


def tensor_spans(path: Path) -> list[tuple[int, int, str]]:
    """Every tensor of a GGUF file: (start, end, name)."""
    data = path.read_bytes()
    return gguf_tensor_spans(data[: 64 << 20], len(data))


def fused_model(tmp_path: Path, layers: int, inter: int) -> tuple[Path, Path, Path]:
    """(primary, mirror, model): a GGUF of 4 fused experts per layer, each three extents of
    `inter` KiB x 2, one in each of three tensors."""
    primary, mirror = tmp_path / "p", tmp_path / "m"
    primary.mkdir()
    write_gguf(
        str(primary / "m.gguf"), "qwen3moe", layers=layers, experts=4, hidden=1024, inter=inter, qtype="F16"
    )
    shutil.copytree(primary, mirror)
    return primary, mirror, primary / "m.gguf"


def refuse(args: list[str], code: int, text: str, mnt: Path | None = None) -> None:
    out = run_colifs(*args)
    assert out.returncode == code, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colifs: error: ") and text in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    if mnt is not None:
        assert not is_mounted(mnt)


def drive_of_each_expert(m, ranges) -> dict:
    """Read each expert through the mount and see which drive's counter moved.

    Run boundaries are snapped to 4 KiB (O_DIRECT straight into one buffer), so up to one block
    at each edge of an expert may come from its neighbour's drive; everything else from its own.
    """
    where = {}
    for (name, key), spans in sorted(ranges.items()):
        before = [r["bytes_served"] for r in m.stats()["replicas"]]
        for start, end in spans:
            read_direct(m.path / name, start, end - start)
        after = [r["bytes_served"] for r in m.stats()["replicas"]]
        moved = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b - a > 2 * BLOCK]
        assert len(moved) == 1, (key, before, after)  # one expert, one drive
        assert sum(after) - sum(before) - (after[moved[0]] - before[moved[0]]) < 2 * BLOCK
        where[name, key] = moved[0]
    return where


def expert_ranges(root: Path) -> dict[tuple[str, ExpertKey], list[tuple[int, int]]]:
    """(file, key) → byte ranges of that expert in that file, from the headers (any model format)."""
    out: dict[tuple[str, ExpertKey], list[tuple[int, int]]] = {}
    for key, spans in expert_spans(root).items():
        for name, start, end in spans:
            out.setdefault((name, key), []).append((start, end))
    return out


@contextmanager
def streaming(mnt: Path, want: dict[str, bytes], n: int) -> Iterator[tuple[list, list]]:
    """`n` readers (O_DIRECT and mmap, alternately) read every file over and over, checking every
    byte, until the block ends: (errors, rounds per reader). The O_DIRECT readers keep each file
    open from start to end, as a server holds its model."""
    errors: list[BaseException] = []
    rounds = [0] * n
    stop = threading.Event()

    def reader(k: int) -> None:
        fds = {name: os.open(mnt / name, os.O_RDONLY | os.O_DIRECT) for name in want}
        buf = mmap.mmap(-1, max(map(len, want.values())))
        try:
            while not stop.is_set():
                for name, data in want.items():
                    if k % 2:
                        with open(mnt / name, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                            assert mm[:] == data, name
                    else:
                        n = os.preadv(fds[name], [memoryview(buf)[: len(data)]], 0)
                        assert buf[:n] == data, name
                rounds[k] += 1
        except BaseException as e:
            errors.append(e)
        finally:
            for fd in fds.values():
                os.close(fd)

    pool = [threading.Thread(target=reader, args=(k,)) for k in range(n)]
    for t in pool:
        t.start()
    try:
        yield errors, rounds
    finally:
        stop.set()
        for t in pool:
            t.join()
