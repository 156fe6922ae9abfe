"""A request fuzzer against a live colifs mount: odd names, odd xattrs, odd reads, writes, from
several processes at once. It passes when the mount is still alive, every byte read equals the
primary's, every write was refused (EROFS/EACCES/EPERM), no request got EIO, and the daemon's
memory and descriptors stayed bounded.

    python contrib/fuzz_mount.py --mount MNT --primary PRIMARY [--seconds 60] [--procs 4] [--seed 1]
    python contrib/fuzz_mount.py --demo [--engine native|pyfuse3] [--seconds 60]

--demo builds a small synthetic checkpoint and its mirror in a temporary directory, mounts it and
fuzzes it (root or fuse access needed). It prints the request count and the errno histogram of
each kind of request; exit code 0 on a pass, 1 on a failure (each failure printed).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import ctypes.util
import errno
import json
import mmap
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
libc.getxattr.restype = ctypes.c_ssize_t
libc.listxattr.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
libc.listxattr.restype = ctypes.c_ssize_t
libc.opendir.argtypes = [ctypes.c_char_p]
libc.opendir.restype = ctypes.c_void_p
libc.seekdir.argtypes = [ctypes.c_void_p, ctypes.c_long]
libc.readdir.argtypes = [ctypes.c_void_p]
libc.readdir.restype = ctypes.c_void_p
libc.closedir.argtypes = [ctypes.c_void_p]

SPECIAL_NAMES = [b".", b"..", b"...", b".colifs", b".colifs/..", b".colifs/stats/x", b"\xff\xfe"]
DIR_OFFSETS = [0, 1, 2, 3, 1000, (1 << 31) - 1, -1, 1 << 62]
FATAL = {errno.EIO, errno.ENOTCONN, errno.ECONNABORTED, errno.ENXIO}  # a broken or dying daemon
REFUSED_WRITE = {errno.EROFS, errno.EACCES, errno.EPERM}
RSS_GROWTH_MB = 64  # allowed daemon RSS growth over the run (its buffers are allocated lazily)
FD_GROWTH = 4  # descriptors the daemon may hold more after the run than before


class Fuzzer:
    """One worker's random requests; outcomes counted as (kind, "ok" | errno name)."""

    def __init__(self, mnt: Path, primary: Path, seed: int) -> None:
        self.mnt, self.primary = mnt, primary
        self.rng = random.Random(seed)
        self.files = sorted(
            p.relative_to(primary) for p in primary.rglob("*") if p.is_file() and not p.is_symlink()
        )
        self.dirs = [Path("."), *sorted(p.relative_to(primary) for p in primary.rglob("*") if p.is_dir())]
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.failures: list[str] = []
        self.kinds: list[Callable[[], None]] = [
            self.lookup, self.getxattr, self.listxattr, self.read, self.read_direct, self.read_mmap,
            self.readdir, self.write, self.control,
        ]  # fmt: skip

    def run(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and len(self.failures) < 20:
            kind = self.rng.choice(self.kinds)
            try:
                kind()
                self.outcomes[kind.__name__, "ok"] += 1
            except OSError as e:
                name = errno.errorcode.get(e.errno or 0, str(e.errno))
                self.outcomes[kind.__name__, name] += 1
                if e.errno in FATAL:
                    self.failures.append(f"{kind.__name__}: {e}")
            except AssertionError as e:
                self.outcomes[kind.__name__, "WRONG"] += 1
                self.failures.append(f"{kind.__name__}: {e}")

    # -- names --------------------------------------------------------------------------------

    def odd_name(self) -> bytes:
        r = self.rng
        return r.choice([
            lambda: b"x" * r.choice([1, 254, 255, 256, 1024, 4000]),
            lambda: bytes(r.choice([i for i in range(1, 256) if i != 0x2F]) for _ in range(r.randint(1, 40))),
            lambda: r.choice(SPECIAL_NAMES),
            lambda: os.fsencode(str(r.choice(self.files))) + r.choice([b"", b"/", b"/x", b"~", b"\x80"]),
        ])()  # fmt: skip

    def lookup(self) -> None:
        os.lstat(os.fsencode(self.mnt) + b"/" + self.odd_name())

    def getxattr(self) -> None:
        path = self.path_bytes()
        r = self.rng
        name = r.choice([
            b"user.colifs.replicas",
            b"user.colifs.route." + str(r.choice([0, -1, 1 << 70, r.randrange(1 << 30)])).encode(),
            b"user.colifs.route." + r.choice([b"", b"x", b"1.5", b"0x10", b" 1", "٣".encode()]),
            b"user." + self.odd_name()[:250], b"trusted.x", b"security.selinux", b"system.posix_acl_access",
        ])  # fmt: skip
        size = r.choice([0, 1, 7, 64, 4096, 65536])
        buf = ctypes.create_string_buffer(max(size, 1))
        n = libc.getxattr(path, name, buf if size else None, size)
        if n < 0:
            raise OSError(ctypes.get_errno(), "getxattr")

    def listxattr(self) -> None:
        size = self.rng.choice([0, 1, 19, 21, 4096])
        buf = ctypes.create_string_buffer(max(size, 1))
        n = libc.listxattr(self.path_bytes(), buf if size else None, size)
        if n < 0:
            raise OSError(ctypes.get_errno(), "listxattr")

    def path_bytes(self) -> bytes:
        rel = self.rng.choice([*self.files, *self.dirs, Path(".colifs"), Path(".colifs/stats")])
        return os.fsencode(self.mnt / rel)

    # -- data ---------------------------------------------------------------------------------

    def extent(self, size: int, align: int = 1) -> tuple[int, int]:
        r = self.rng
        off = r.choice([0, size, size + 1, 1 << 40, (1 << 62), r.randrange(max(size, 1)), max(size - 1, 0)])
        n = r.choice([0, 1, 4095, 4096, 131072, 1 << 20, 4 << 20, r.randrange(1, 1 << 21)])
        return off // align * align, max(n // align * align, align if align > 1 else n)

    def want(self, rel: Path, off: int, n: int) -> bytes:
        with open(self.primary / rel, "rb") as f:
            f.seek(min(off, 1 << 62))
            return f.read(n)

    def read(self) -> None:
        self._pread(0, 1)

    def read_direct(self) -> None:
        self._pread(os.O_DIRECT, self.rng.choice([1, 512, 4096]))

    def _pread(self, flags: int, align: int) -> None:
        """A pread (into a page-aligned buffer, as O_DIRECT needs) compared with the primary's."""
        rel = self.rng.choice(self.files)
        off, n = self.extent((self.primary / rel).stat().st_size, align)
        n = min(n, 8 << 20)
        fd = os.open(self.mnt / rel, os.O_RDONLY | flags)
        try:
            buf = mmap.mmap(-1, max(n, 4096))
            got = bytes(buf[: os.preadv(fd, [memoryview(buf)[:n]], off)])
        finally:
            os.close(fd)
        assert got == self.want(rel, off, n), f"{rel} flags {flags:#o} [{off}, +{n}): not the primary bytes"

    def read_mmap(self) -> None:
        rel = self.rng.choice(self.files)
        size = (self.primary / rel).stat().st_size
        if size == 0:
            return
        off = self.rng.randrange(size) // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        n = self.rng.randint(1, size - off)
        with open(self.mnt / rel, "rb") as f, mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ, offset=off) as m:
            got = m[:]
        assert got == self.want(rel, off, n), f"{rel} mmap [{off}, +{n}): bytes differ from the primary"

    def readdir(self) -> None:
        rel = self.rng.choice([*self.dirs, Path(".colifs")])
        d = libc.opendir(os.fsencode(self.mnt / rel))
        if not d:
            raise OSError(ctypes.get_errno(), "opendir")
        try:
            libc.seekdir(
                d, self.rng.choice([0, 1, 2, 3, 1000, (1 << 31) - 1, -1, self.rng.randrange(1 << 62)])
            )
            for _ in range(10_000):
                if not libc.readdir(d):
                    break
        finally:
            libc.closedir(d)

    def control(self) -> None:
        name = self.rng.choice(["stats", "stats.json"])
        with open(self.mnt / ".colifs" / name, "rb") as f:
            data = f.read()
        if name == "stats.json":
            json.loads(data)
        else:
            assert data.endswith(b"\n") and data.count(b"\n") == 1, f"stats: {data[:80]!r}"

    # -- writes: every one refused --------------------------------------------------------------

    def write(self) -> None:
        r = self.rng
        target = self.mnt / r.choice([*self.files, *self.dirs, Path(".colifs/stats")])
        new = self.mnt / r.choice(self.dirs) / f"new-{r.randrange(1 << 30)}"
        attempt = r.choice([
            lambda: os.close(os.open(target, r.choice([os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC,
                                                        os.O_WRONLY | os.O_APPEND]))),
            lambda: os.close(os.open(new, os.O_CREAT | os.O_WRONLY, 0o644)),
            lambda: os.mkdir(new), lambda: os.unlink(target), lambda: os.rename(target, new),
            lambda: os.truncate(target, 0), lambda: os.chmod(target, 0o777), lambda: os.symlink("x", new),
            lambda: os.setxattr(target, "user.x", b"1"), lambda: os.utime(target, (0, 0)),
        ])  # fmt: skip
        try:
            attempt()
        except OSError as e:
            refusals = REFUSED_WRITE | {errno.EISDIR, errno.ENOTDIR}
            if target == self.mnt:  # the mount point itself: the kernel refuses to move it
                refusals |= {errno.EXDEV, errno.EBUSY, errno.EINVAL}
            if e.errno not in refusals:
                raise AssertionError(f"write to {target.name}: {e} (not a refusal)") from None
            raise
        raise AssertionError(f"a write to {target} succeeded")


def _worker(args: tuple[str, str, int, float]) -> tuple[collections.Counter, list[str]]:
    mnt, primary, seed, seconds = args
    f = Fuzzer(Path(mnt), Path(primary), seed)
    f.run(seconds)
    return f.outcomes, f.failures


def daemon_usage(pid: int) -> tuple[int, int]:
    """(RSS in MB, open descriptors other than /dev/fuse) of the daemon."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) // 1024
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds += os.readlink(f"/proc/{pid}/fd/{fd}") != "/dev/fuse"
        except OSError:
            continue
    return rss, fds


def _daemon_after(mnt: Path, pid: int, before: tuple[int, int], failures: list[str]) -> tuple[bool, tuple]:
    """(whether the mount still answers, the daemon's RSS and descriptors); growth is a failure."""
    alive = True
    try:
        json.loads((mnt / ".colifs" / "stats.json").read_bytes())
        after = daemon_usage(pid)
    except (OSError, ValueError, StopIteration) as e:
        alive, after = False, before
        failures.append(f"the mount is gone after the run: {e}")
    if after[0] - before[0] > RSS_GROWTH_MB:
        failures.append(f"daemon RSS grew from {before[0]} to {after[0]} MB")
    if after[1] - before[1] > FD_GROWTH:
        failures.append(f"daemon descriptors grew from {before[1]} to {after[1]}")
    return alive, after


def _print_outcomes(outcomes: collections.Counter, procs: int, seconds: float, seed: int) -> None:
    total = sum(outcomes.values())
    print(f"{total} requests from {procs} processes in {seconds:g} s ({total / seconds:.0f}/s), seed {seed}")
    for kind in sorted({k for k, _ in outcomes}):
        hist = sorted(((n, o) for (k, o), n in outcomes.items() if k == kind), reverse=True)
        print(f"  {kind:12} " + "  ".join(f"{o} {n}" for n, o in hist))


def fuzz(mnt: Path, primary: Path, seconds: float, procs: int, seed: int) -> int:
    """Run the fuzzer; print the report; 0 on a pass."""
    pid = json.loads((mnt / ".colifs" / "stats.json").read_bytes())["pid"]
    before = daemon_usage(pid)
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        results = pool.map(_worker, [(str(mnt), str(primary), seed + i, seconds) for i in range(procs)])
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
    failures: list[str] = []
    for o, f in results:
        outcomes.update(o)
        failures.extend(f)
    time.sleep(0.5)  # releases reach the daemon after the workers exit
    alive, after = _daemon_after(mnt, pid, before, failures)
    _print_outcomes(outcomes, procs, seconds, seed)
    print(f"daemon: RSS {before[0]} -> {after[0]} MB, descriptors {before[1]} -> {after[1]}; "
          f"mount {'alive' if alive else 'GONE'}")  # fmt: skip
    for f in failures[:40]:
        print(f"FAIL {f}")
    print("PASS" if not failures else f"FAILED ({len(failures)})")
    return 0 if not failures else 1


def demo(engine: str, seconds: float, procs: int, seed: int) -> int:
    """Fuzz a synthetic checkpoint with a mirror, mounted in a temporary directory."""
    from colifs.synth import write_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="colifs-fuzz-"))
    primary, mirror, mnt = tmp / "p", tmp / "m", tmp / "mnt"
    write_checkpoint(str(primary), "mixtral", layers=2, experts=8, hidden=256, inter=256, shards=2)
    (primary / "sub").mkdir()
    (primary / "sub" / "notes.txt").write_text("odd bytes: \x00\x01\n" * 100)
    shutil.copytree(primary, mirror)
    mnt.mkdir()
    colifs = [sys.executable, "-m", "colifs"]
    done = subprocess.run(
        [*colifs, "mount", str(primary), str(mirror), str(mnt), "--weights", "1,1", "--engine", engine],
        capture_output=True, text=True,
    )  # fmt: skip
    try:
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return 1
        return fuzz(mnt, primary, seconds, procs, seed)
    finally:
        subprocess.run([*colifs, "umount", str(mnt)], capture_output=True)
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mount", type=Path, help="a live colifs mount")
    p.add_argument("--primary", type=Path, help="its primary directory (the bytes to compare with)")
    p.add_argument("--demo", action="store_true", help="mount a synthetic checkpoint and fuzz it")
    p.add_argument("--engine", default="native", choices=["native", "pyfuse3"], help="with --demo")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    if a.demo:
        return demo(a.engine, a.seconds, a.procs, a.seed)
    if a.mount is None or a.primary is None:
        p.error("--mount and --primary, or --demo")
    return fuzz(a.mount, a.primary, a.seconds, a.procs, a.seed)


if __name__ == "__main__":
    sys.exit(main())
