"""A copy joining while the mount serves proves its bytes (colifs.proof); a directory to add is
judged as at mount (colifs.checks.judge_mirror); nothing a reload does waits on the daemon's loop
(colifs.offload, a change of copy waiting on its file's lock). Without a mount."""

from __future__ import annotations

import itertools
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import trio

from colifs.backing import OsIO, TimedOut
from colifs.catalogue import build_files
from colifs.checks import check_roots, judge_mirror
from colifs.errors import UsageError
from colifs.health import Health
from colifs.offload import Offload
from colifs.proof import SAMPLE, SAMPLES, Claim, Proving, Stopped, prove, ranges
from colifs.reload import Reloader, Reloads
from colifs.replicas import identity
from colifs.synth import write_checkpoint
from colifs.tree import Tree
from tests.helpers import shards


def corrupt(path: Path, at: int) -> None:
    """One byte of the data changed, the header (and size) as they were: a new file (inode)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    new = path.with_name(path.name + ".new")
    new.write_bytes(bytes(data))
    new.replace(path)


def data_byte(path: Path) -> int:
    """An offset past the header (safetensors: its 8-byte length, then the JSON)."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little") + 100


def claim(primary: Path, mirror: Path) -> Claim:
    st = primary.stat()
    return Claim(
        primary.name,
        str(primary),
        str(mirror),
        (st.st_ino, st.st_size, st.st_mtime_ns),
        identity(mirror.stat()),
    )


# -- the proof itself --------------------------------------------------------------------------------


def test_ranges_cover_every_byte_deep_and_sample_at_random_otherwise() -> None:
    size = 50 * SAMPLE + 12345
    deep = ranges(size, True)
    assert deep[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(deep))
    assert deep[-1][0] + deep[-1][1] >= size
    picks = [ranges(size, False) for _ in range(3)]
    for p in picks:
        assert len(p) <= SAMPLES + 1 and all(off % 4096 == 0 and n >= SAMPLE for off, n in p)
        assert p[-1][0] + p[-1][1] >= size  # the file's end is always compared
    assert len({tuple(p) for p in picks}) > 1  # drawn anew each time: nobody knows them in advance
    assert ranges(3 * SAMPLE, False) == ranges(3 * SAMPLE, True)  # a small file: every byte


def test_a_copy_with_the_primarys_header_but_other_bytes_is_refused(tmp_path: Path) -> None:
    write_checkpoint(str(tmp_path / "p"), "deepseek", layers=2, experts=8, hidden=64, inter=32, shards=2)
    shutil.copytree(tmp_path / "p", tmp_path / "m")
    good, bad = (shards(tmp_path / "m")[i] for i in (0, 1))
    corrupt(bad, data_byte(bad))
    shown = Proving("m", "sampled", 2, 0)
    claims = [claim(tmp_path / "p" / p.name, p) for p in (good, bad)]
    prove(OsIO(direct=False), claims, False, threading.Event(), shown)
    assert list(shown.refused) == [str(bad)] and "data differs" in shown.refused[str(bad)]
    assert shown.files_done == 2

    replaced = claims[0]
    shutil.copy2(tmp_path / "p" / good.name, tmp_path / "new")
    (tmp_path / "new").replace(good)  # the same bytes, another file than the one judged
    shown = Proving("m", "deep", 1, 0)
    prove(OsIO(direct=False), [replaced], True, threading.Event(), shown)
    assert shown.refused == {str(good): "changed while it was compared"}


def test_a_proof_stops_at_its_next_range_once_told(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(64 * SAMPLE))
    copy = tmp_path / "copy.bin"
    shutil.copy(big, copy)
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        prove(OsIO(direct=False), [claim(big, copy)], True, stop, Proving("x", "deep", 1, 0))


# -- off the loop, bounded ------------------------------------------------------------------------------


def test_offload_gives_up_in_time_and_refuses_past_its_count_of_stuck_calls() -> None:
    release = threading.Event()
    work = Offload("test calls", most=2)

    async def main() -> None:
        for _ in range(2):
            with pytest.raises(TimedOut, match=r"no answer within 0\.1 s"):
                await work.run(release.wait, within=0.1)
        t0 = time.monotonic()
        with pytest.raises(TimedOut, match="2 earlier test calls still wait"):
            await work.run(time.sleep, 5, within=10)
        assert time.monotonic() - t0 < 1
        release.set()
        await trio.sleep(0.2)
        assert work.running == 0 and await work.run(lambda: 7, within=1) == 7

    trio.run(main)


# -- judged as at mount ----------------------------------------------------------------------------------


def test_a_directory_to_add_is_judged_as_at_mount(tmp_path: Path) -> None:
    primary, mirror, other, mnt = (tmp_path / n for n in ("p", "m", "o", "mnt"))
    for d in (primary, mirror, other, mnt / "sub"):
        d.mkdir(parents=True)
    known = [(str(primary), "primary"), (str(mirror), "up")]
    judge = lambda p: judge_mirror(str(p), str(mnt), None, known, "main")  # noqa: E731
    for path, text in (
        (mnt, "would read its own files"),
        (mnt / "sub", "would read its own files"),
        (tmp_path, f"mountpoint {mnt} is inside"),
        (primary, "is the primary"),
        (mirror, "a mirror of this mount already"),
        (tmp_path / "missing", "does not exist"),
    ):
        with pytest.raises(UsageError, match=text):
            judge(path)
    (tmp_path / "to-mnt").symlink_to(mnt)
    (tmp_path / "to-primary").symlink_to(primary)
    with pytest.raises(UsageError, match="would read its own files"):
        judge(tmp_path / "to-mnt")  # resolved: the mount point
    with pytest.raises(UsageError, match="is the primary"):
        judge(tmp_path / "to-primary")
    assert judge(other) == (str(other), None)
    assert judge_mirror(str(mirror), str(mnt), None, [known[0], (str(mirror), "removed")], "main") == (
        str(mirror), 1,
    )  # fmt: skip
    with pytest.raises(UsageError, match="on the mount"):
        judge_mirror(str(other), str(mnt), other.stat().st_dev, known, "main")


def test_a_hugging_face_repository_is_judged_as_its_snapshot(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--moe"
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    assert judge_mirror(str(repo), str(tmp_path / "mnt"), None, [], "main") == (str(snap), None)
    with pytest.raises(UsageError, match="no snapshot for revision 'v2'"):
        judge_mirror(str(repo), str(tmp_path / "mnt"), None, [], "v2")


# -- reloads and mirror adds prove ---------------------------------------------------------------------------


def catalogue(tmp_path: Path) -> tuple:
    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "deepseek", layers=3, experts=8, hidden=64, inter=32, shards=3)
    shutil.copytree(primary, mirror)
    replicas = check_roots([str(primary), str(mirror)], [1.0, 1.0])
    tree = Tree(str(primary))
    return tree, build_files(tree, replicas), replicas, primary, mirror


def test_a_reload_refuses_a_copy_whose_bytes_differ_and_drops_one_that_became_so(tmp_path: Path) -> None:
    tree, files, replicas, _, mirror = catalogue(tmp_path)
    names = [p.name for p in shards(mirror)]
    corrupt(mirror / names[0], data_byte(mirror / names[0]))  # held: replaced by other bytes
    set_to: dict = {}
    reloader = Reloader(tree, files, replicas, [Health(), Health()],
                        lambda f, d, ident: set_to.update({f.relpath: ident}) or True,
                        lambda _: None, print, Reloads(), io=OsIO(direct=False))  # fmt: skip
    last = trio.run(reloader.reload)["last"]["mirrors"][0]
    assert last["refused"] == [names[0]] and last["dropped"] == [names[0]] and last["added"] == []
    assert set_to == {names[0]: None}
    f = next(f for f in files.values() if f.relpath == names[0])
    assert f.copies == (0,) and "not proven: data differs" in f.note


def test_a_mirror_add_serves_only_the_copies_that_prove_their_bytes(tmp_path: Path) -> None:
    tree, files, replicas, primary, mirror = catalogue(tmp_path)
    health = [Health(), Health()]
    reloader = Reloader(tree, files, replicas, health, lambda *_: True, lambda _: None, print, Reloads(),
                        io=OsIO(direct=False))  # fmt: skip
    trio.run(reloader.remove_mirror, str(mirror), 1.0)
    names = [p.name for p in shards(mirror)]
    for name in names:
        corrupt(mirror / name, data_byte(mirror / name))
    with pytest.raises(UsageError, match="none of its 3 copies holds the primary's bytes"):
        trio.run(reloader.add_mirror, str(mirror), None, 10.0)
    assert health[1].removed_at is not None  # nothing changed
    for name in names[1:]:
        (mirror / name).unlink()
        shutil.copy2(primary / name, mirror / name)
    change = trio.run(reloader.add_mirror, str(mirror), 1.0, 10.0)
    assert change["files"] == 2 and list(change["proof"]["refused"]) == [names[0]]
    assert change["proof"]["mode"] == "sampled"
    assert sorted(f.relpath for f in files.values() if 1 in f.copies) == names[1:]
    assert reloader.record.as_dict()["proof"]["outcome"] == "1 of 3 refused"


def test_a_change_of_copy_waiting_on_its_files_lock_leaves_the_loop_and_lands_later(tmp_path: Path) -> None:
    """The native engine's set_copy waits for the file's lock, which a slow primary open holds:
    the reload returns, the loop ticks on, and the change lands once the lock is free."""
    tree, files, replicas, _, mirror = catalogue(tmp_path)
    names = [p.name for p in shards(mirror)]
    (mirror / names[1]).unlink()  # a copy gone: dropped by the reload
    free = threading.Event()

    def set_copy(f, drive, ident) -> bool:
        free.wait(20)  # the file's lock, held by a hung open of the primary
        return True

    reloader = Reloader(
        tree, files, replicas, [Health(), Health()], set_copy, lambda _: None, print, Reloads(),
        io=OsIO(direct=False), set_copy_blocks=True,
    )  # fmt: skip
    held = next(f for f in files.values() if f.relpath == names[1])

    async def main() -> None:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await trio.sleep(0.05)
                ticks += 1

        async with trio.open_nursery() as n:
            n.start_soon(tick)
            t0 = time.monotonic()
            last = (await reloader.reload())["last"]["mirrors"][0]
            took = time.monotonic() - t0
            assert took < 3 and ticks >= 10 * took, (took, ticks)  # the loop ran all along
            assert last["busy"] == [names[1]] and 1 in held.copies  # not yet in force
            assert (await reloader.reload())["last"]["mirrors"][0]["busy"] == [names[1]]  # still waiting
            free.set()
            with trio.fail_after(5):
                while 1 in held.copies:
                    await trio.sleep(0.02)
            n.cancel_scope.cancel()

    trio.run(main)
    assert held.copies == (0,) and "missing" in held.note
