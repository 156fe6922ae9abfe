"""What a reload finds (colifs.reload.recheck) and how the catalogue takes it, without a mount."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import trio

from colifs.catalogue import build_files
from colifs.checks import check_roots
from colifs.errors import BusyError, UsageError
from colifs.health import Health
from colifs.reload import Reloader, Reloads, Weight, recheck
from colifs.replicas import Replica
from colifs.synth import write_checkpoint
from colifs.tree import Tree


def catalogue(tmp_path: Path, mirrored: int) -> tuple[Tree, dict, list, Path, Path]:
    """A 3-shard checkpoint and a mirror holding the first `mirrored` shards."""
    primary, mirror = tmp_path / "p", tmp_path / "m"
    write_checkpoint(str(primary), "deepseek", layers=3, experts=8, hidden=64, inter=32, shards=3)
    shutil.copytree(primary, mirror)
    for p in sorted(mirror.glob("*.safetensors"))[mirrored:]:
        p.unlink()
    replicas = check_roots([str(primary), str(mirror)], [1.0, 1.0])
    tree = Tree(str(primary))
    return tree, build_files(tree, replicas), replicas, primary, mirror


def by_name(files: dict) -> dict:
    return {f.relpath: f for f in files.values() if f.is_model}


def test_nothing_changed_nothing_found(tmp_path: Path) -> None:
    tree, files, replicas, _, _ = catalogue(tmp_path, 3)
    assert recheck(tree, files, replicas) == ([], [])


def test_a_copy_added_changed_and_gone(tmp_path: Path) -> None:
    tree, files, replicas, primary, mirror = catalogue(tmp_path, 2)
    names = sorted(by_name(files))
    shutil.copy2(primary / names[2], mirror / names[2])  # staged: added
    (mirror / names[0]).unlink()  # gone: dropped
    fresh = mirror / "fresh"  # the same bytes in a new file (a new inode): a new identity, valid
    fresh.write_bytes((mirror / names[1]).read_bytes())
    fresh.replace(mirror / names[1])
    verdicts, primary_changed = recheck(tree, files, replicas)
    got = {files[v.ino].relpath: (v.identity is not None, v.why) for v in verdicts}
    assert got == {names[0]: (False, "missing"), names[1]: (True, "changed"), names[2]: (True, "added")}
    assert primary_changed == [] and all(v.drive == 1 for v in verdicts)


def test_a_primary_that_changed_is_said_and_only_its_changed_copies_dropped(tmp_path: Path) -> None:
    """The engines refuse a changed primary's new opens; its mirror copy is dropped if it changed
    too, kept if not (it holds the bytes mounted, which files open before read on), never added."""
    tree, files, replicas, primary, mirror = catalogue(tmp_path, 3)
    first, second = sorted(by_name(files))[:2]
    (mirror / first).write_bytes((primary / first).read_bytes())  # rewritten: valid, but not the copy mounted
    for name in (first, second):
        os.utime(primary / name, ns=(0, 1))
    verdicts, primary_changed = recheck(tree, files, replicas)
    assert primary_changed == [first, second]
    assert [(files[v.ino].relpath, v.drive, v.identity) for v in verdicts] == [(first, 1, None)]


def test_the_reloader_puts_the_verdicts_in_force_and_counts(tmp_path: Path) -> None:
    tree, files, replicas, primary, mirror = catalogue(tmp_path, 2)
    names = sorted(by_name(files))
    shutil.copy2(primary / names[2], mirror / names[2])
    calls, busy, reweighed = [], [True], []

    def set_copy(f, drive, identity) -> bool:
        if busy[0]:  # the first try finds the file busy: asked again
            busy[0] = False
            return False
        calls.append((f.relpath, drive, identity is not None))
        return True

    record = Reloads()
    health = [Health() for _ in replicas]
    reloader = Reloader(tree, files, replicas, health, set_copy, reweighed.append, print, record)
    shown = trio.run(reloader.reload)
    assert calls == [(names[2], 1, True)] and reweighed == [None]
    assert by_name(files)[names[2]].copies == (0, 1) and 1 in by_name(files)[names[2]].identities
    assert shown["count"] == 1 and shown["last"]["mirrors"] == [
        {
            "path": str(mirror),
            "checked": True,
            "removed": False,
            "added": [names[2]],
            "dropped": [],
            "busy": [],
            "refused": [],
            "model_files": 3,
        }
    ]
    assert trio.run(reloader.reload)["last"]["mirrors"][0]["added"] == []  # in force: nothing new
    assert reweighed == [None] and record.count == 2


def test_a_mirror_removed_and_added_back(tmp_path: Path) -> None:
    """remove_mirror drops every copy and waits for the descriptors there; add_mirror validates
    again; the primary, a live mirror, a stranger and a non-replica are refused, nothing changed."""
    tree, files, replicas, primary, mirror = catalogue(tmp_path, 3)
    copies: dict = {}
    weights: list = []

    def set_copy(f, drive, identity) -> bool:
        copies[f.relpath] = identity is not None
        return True

    health = [Health() for _ in replicas]
    record = Reloads()
    reloader = Reloader(tree, files, replicas, health, set_copy, weights.append, print, record)
    held = open(mirror / sorted(by_name(files))[0], "rb")  # noqa: SIM115 (an engine's descriptor, closed below)

    async def remove() -> dict:
        async with trio.open_nursery() as n:
            n.start_soon(reloader.remove_mirror, str(mirror), 5.0)
            await trio.sleep(0.2)
            assert health[1].removed_at is not None and all(not c for c in copies.values())
            held.close()  # the remove returns only after this
        return record.mirror_change

    change = trio.run(remove)
    assert change["command"] == "remove" and change["files"] == 3 and change["descriptors_left"] == 0
    assert change["seconds"] >= 0.2 and all(f.copies == (0,) for f in by_name(files).values())
    assert health[1].removed_at is not None and not health[1].due()
    refusals = [(primary, "is the primary"), (tmp_path, "is not a mirror"), (mirror, "removed already")]
    for path, text in refusals:
        with pytest.raises(UsageError, match=text):
            trio.run(reloader.remove_mirror, str(path), 1.0)
    aside = tmp_path / "aside"
    mirror.rename(aside)
    mirror.mkdir()
    with pytest.raises(UsageError, match="not a replica"):
        trio.run(reloader.add_mirror, str(mirror), None, 1.0)
    mirror.rmdir()
    aside.rename(mirror)
    assert health[1].removed_at is not None  # refused: nothing changed
    change = trio.run(reloader.add_mirror, str(mirror), 2.5, 1.0)
    assert change["files"] == 3 and all(copies.values()) and weights[-1] == Weight(1, 2.5)
    assert all(f.copies == (0, 1) for f in by_name(files).values()) and health[1].removed_at is None
    with pytest.raises(UsageError, match="a mirror of this mount already"):
        trio.run(reloader.add_mirror, str(mirror), None, 1.0)
    with pytest.raises(UsageError, match="not a replica"):  # it would have joined as a new mirror
        trio.run(reloader.add_mirror, str(tmp_path), None, 1.0)


def test_a_removal_whose_descriptors_stay_open_says_so_and_stays_removed(tmp_path: Path) -> None:
    tree, files, replicas, _, mirror = catalogue(tmp_path, 3)
    health = [Health() for _ in replicas]
    reloader = Reloader(tree, files, replicas, health, lambda *_: True, print, print, Reloads())
    with open(mirror / sorted(by_name(files))[1], "rb"):  # a read stuck in the drive, say
        with pytest.raises(BusyError, match="1 descriptors are open there"):
            trio.run(reloader.remove_mirror, str(mirror), 0.3)
        assert health[1].removed_at is not None
        assert all(f.copies == (0,) for f in by_name(files).values())
    assert trio.run(reloader.remove_mirror, str(mirror), 1.0)["descriptors_left"] == 0  # again: done


def test_new_directories_join_in_a_removed_mirrors_slot_then_in_new_ones(tmp_path: Path) -> None:
    tree, files, replicas, _, mirror = catalogue(tmp_path, 3)
    other, third = tmp_path / "other", tmp_path / "third"
    shutil.copytree(mirror, other)
    shutil.copytree(mirror, third)
    weights, placed = [], []
    health = [Health() for _ in replicas]

    def place(root: str, weight: float | None, index: int | None) -> int:
        placed.append((root, weight, index))
        if index is None:
            health.append(Health())
            replicas.append(Replica(len(replicas), root, weight or 1.0))
            return len(replicas) - 1
        replicas[index] = Replica(index, root, replicas[index].weight)
        return index

    reloader = Reloader(tree, files, replicas, health, lambda *_: True, weights.append, place, Reloads())
    trio.run(reloader.remove_mirror, str(mirror), 1.0)
    change = trio.run(reloader.add_mirror, str(other), None, 1.0)
    assert placed == [(str(other), None, 1)] and change["path"] == str(other) and change["files"] == 3
    assert weights[-1].drive == 1 and weights[-1].of_primary and weights[-1].value > 0  # measured
    assert all(f.copies == (0, 1) for f in by_name(files).values())
    with pytest.raises(UsageError, match="is a mirror of this mount already"):
        trio.run(reloader.add_mirror, str(other), None, 1.0)
    change = trio.run(reloader.add_mirror, str(third), 2.0, 1.0)  # no slot free: a new one
    assert placed[-1] == (str(third), 2.0, None) and weights[-1] == Weight(2, 2.0)
    assert all(f.copies == (0, 1, 2) for f in by_name(files).values())
    assert trio.run(reloader.reload)["last"]["mirrors"][1]["model_files"] == 3  # reloads see it
