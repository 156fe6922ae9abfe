"""Which copies share a drive (colifs.devices), on a made-up sysfs, and the probed weights of the
copies on one drive."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from colifs.devices import _disks, as_one_drive, drive_of, shared


def block(
    sys: Path, majmin: str, *parts: str, partition: bool = False, slaves: dict[str, str] | None = None
) -> None:
    """/sys/devices/.../NAME (its last part), linked from /sys/dev/block/MAJ:MIN."""
    node = sys / "devices" / Path(*parts)
    node.mkdir(parents=True, exist_ok=True)
    (node / "dev").write_text(majmin + "\n")
    if partition:
        (node / "partition").write_text("1\n")
    if slaves is not None:
        (node / "slaves").mkdir()
        for name, target in slaves.items():
            (node / "slaves" / name).symlink_to(sys / "devices" / target)
    (sys / "dev" / "block").mkdir(parents=True, exist_ok=True)
    (sys / "dev" / "block" / majmin).symlink_to(node)


def test_a_partition_is_its_disk_and_lvm_is_the_disks_under_it(tmp_path: Path) -> None:
    block(tmp_path, "259:0", "nvme0n1")
    block(tmp_path, "259:1", "nvme0n1", "nvme0n1p1", partition=True)
    block(tmp_path, "259:2", "nvme0n1", "nvme0n1p2", partition=True)
    block(tmp_path, "8:0", "sda")
    block(tmp_path, "8:1", "sda", "sda1", partition=True)
    block(tmp_path, "253:0", "dm-0", slaves={"nvme0n1p2": "nvme0n1/nvme0n1p2", "sda1": "sda/sda1"})
    block(tmp_path, "253:1", "dm-1", slaves={"dm-0": "dm-0"})  # dm-crypt on the LVM volume
    block(tmp_path, "7:0", "loop0")
    assert _disks("259:1", tmp_path, 0) == {"nvme0n1"}
    assert _disks("253:1", tmp_path, 0) == {"nvme0n1", "sda"}
    assert _disks("7:0", tmp_path, 0) == {"loop0"}  # a loop device is a drive of its own
    assert _disks("9:9", tmp_path, 0) == frozenset()  # not in sysfs
    drives = [_disks(d, tmp_path, 0) for d in ("259:1", "8:0", "253:1", "7:0")]
    assert shared(drives) == [[0, 1, 2]]  # nvme0n1p1 and sda meet through the volume on both


def test_a_filesystem_without_a_block_device_is_known_by_its_number(tmp_path: Path) -> None:
    (tmp_path / "sys").mkdir()
    dev = os.stat(tmp_path).st_dev
    got = drive_of(str(tmp_path), tmp_path / "sys")  # nothing in this sysfs
    assert got == {f"dev {os.major(dev)}:{os.minor(dev)}"}
    assert drive_of(str(tmp_path / "sys"), tmp_path / "sys") == got  # the same filesystem


def test_groups_are_transitive_and_in_order() -> None:
    d = [frozenset(x) for x in ({"a"}, {"b"}, {"c", "a"}, {"d"}, {"b"}, {"e"})]
    assert shared(d) == [[0, 2], [1, 4]]
    assert shared([frozenset({"a"}), frozenset({"b"})]) == []


@given(
    st.lists(st.floats(min_value=1, max_value=1e4), min_size=2, max_size=6),
    st.data(),
)
def test_copies_on_one_drive_share_its_best_figure(weights: list[float], data: st.DataObject) -> None:
    n = len(weights)
    group = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=2, max_size=n)))
    out = as_one_drive(weights, [group])
    assert abs(sum(out[i] for i in group) - max(weights[i] for i in group)) < 1e-6 * max(weights)
    assert len({out[i] for i in group}) == 1
    assert [out[i] for i in range(n) if i not in group] == [weights[i] for i in range(n) if i not in group]
