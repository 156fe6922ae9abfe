"""The mount's readahead, chosen from the drives' probed speed unless given, and following the speed
they deliver while serving."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from colifs import kernel
from colifs.cli import parser
from colifs.config import mount_config
from colifs.kernel import HOLD, MARGIN, Knobs, Tuning


def knobs(*flags: str) -> Knobs:
    return mount_config(parser().parse_args(["mount", "/p", "/m", "/mnt", *flags])).knobs


@pytest.mark.parametrize(
    ("mb_per_s", "kb"),
    [(None, 128), (0.0, 128), (200.0, 32), (599.9, 32), (600.0, 64), (999.0, 64), (1000.0, 128), (9e3, 128)],
)
def test_the_default_readahead_follows_the_drives_speed(mb_per_s: float | None, kb: int) -> None:
    """32 KiB below 600 MB/s (the drives added), 64 below 1000, else (or not measured) 128; each
    choice says why, with the figure it came from."""
    chosen = knobs().for_drives(mb_per_s)
    assert chosen.read_ahead_kb == kb and chosen.max_background == knobs().max_background
    assert ("below" in chosen.why) == (kb != 128)
    assert chosen.why.startswith("the default") == (kb == 128)
    if kb != 128:
        assert f"at {mb_per_s:.4g} MB/s together" in chosen.why  # 599.9 is not shown as 600


@given(st.floats(min_value=1e-3, max_value=1e5))
def test_faster_drives_never_get_a_smaller_readahead(mb_per_s: float) -> None:
    assert knobs().for_drives(mb_per_s).read_ahead_kb <= knobs().for_drives(mb_per_s * 2).read_ahead_kb


@given(st.one_of(st.none(), st.floats(min_value=0, max_value=1e5)))
def test_a_readahead_given_or_the_pyfuse3_default_never_moves(mb_per_s: float | None) -> None:
    given_ = knobs("--readahead-kb", "256")
    assert given_.for_drives(mb_per_s) == given_ and given_.read_ahead_kb == 256 and given_.why == "given"
    pyfuse3 = knobs("--engine", "pyfuse3")
    assert pyfuse3.for_drives(mb_per_s) == pyfuse3 and pyfuse3.read_ahead_kb == 512


def following(
    monkeypatch: pytest.MonkeyPatch, tmp: Path, *flags: str, mb_per_s: float | None = None, took: bool = True
) -> tuple[Tuning, Path]:
    """A Tuning applied to a stand-in for the mount's bdi file; `took`: the kernel took the value
    wanted (as root), else the readahead read back is the kernel's 128."""
    bdi = tmp / "read_ahead_kb"
    bdi.write_text("128\n")

    def tune(_: str, k: Knobs) -> dict[str, int | None]:
        if took and k.read_ahead_kb:
            bdi.write_text(f"{k.read_ahead_kb}\n")
        return {"read_ahead_kb": int(bdi.read_text()), "max_background": None, "congestion_threshold": None}

    monkeypatch.setattr(kernel, "tune", tune)
    monkeypatch.setattr(kernel, "bdi_read_ahead", lambda _: str(bdi))
    tuning = Tuning(knobs(*flags).for_drives(mb_per_s))
    tuning.apply("/mnt")
    return tuning, bdi


def feed(tuning: Tuning, speeds: list[float | None], first: int = 0) -> None:
    """Each speed as a new measurement."""
    for k, mb in enumerate(speeds):
        tuning.follow(mb, first + k)


def test_the_readahead_follows_the_speed_the_drives_deliver_saturated(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A mount that did not probe (weights given) keeps 128 KiB until the drives, measured saturated,
    ask for 32 KiB in HOLD measurements in a row (a figure looked at again is not another one); then
    the bdi says 32 for the files opened from then on, and stats say why. Faster drives later bring
    it back."""
    tuning, bdi = following(monkeypatch, tmp_path, "--weights", "3,1")
    feed(tuning, [200.0] * (HOLD - 1))
    for _ in range(5):
        tuning.follow(200.0, HOLD - 2)  # the same measurement, looked at again
    tuning.follow(None, HOLD - 1)  # not measured: does not break the run
    assert bdi.read_text() == "128\n"
    tuning.follow(200.0, HOLD)
    assert bdi.read_text() == "32\n" and tuning.knobs.read_ahead_kb == 32
    why = tuning.applied()["read_ahead_chosen"]
    assert why.startswith("the drives measured saturated at 200 MB/s together, below 600, for files opened")
    feed(tuning, [1500.0] * HOLD, first=HOLD + 1)
    assert bdi.read_text() == "128\n" and tuning.applied()["read_ahead_kb"] == 128


def test_a_speed_near_a_threshold_or_that_flips_moves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Within MARGIN of a threshold (600 MB/s) nothing moves, nor does a speed that asks for another
    readahead in fewer than HOLD measurements in a row."""
    tuning, bdi = following(monkeypatch, tmp_path, mb_per_s=700.0)  # probed: 64 KiB
    feed(tuning, [600.0 * (1 - MARGIN / 2)] * 3 * HOLD)  # below 600, but not by MARGIN
    feed(tuning, [200.0 if k % HOLD else 700.0 for k in range(3 * HOLD)], first=3 * HOLD)
    assert bdi.read_text() == "64\n" and tuning.knobs.read_ahead_kb == 64


def test_nothing_follows_where_the_readahead_could_not_be_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not root: the kernel kept its readahead at mount, and nothing is tried while serving (no
    warning every few seconds). A write that fails later warns once and stops following."""
    tuning, bdi = following(monkeypatch, tmp_path, mb_per_s=200.0, took=False)
    feed(tuning, [1500.0] * 3 * HOLD)
    assert bdi.read_text() == "128\n" and tuning.knobs.read_ahead_kb == 32  # wanted, not taken
    assert "not applied" in tuning.applied()["read_ahead_chosen"]
    tuning, bdi = following(monkeypatch, tmp_path, mb_per_s=200.0)

    def refused(*_: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(kernel, "_write", refused)
    feed(tuning, [1500.0] * 3 * HOLD)
    assert bdi.read_text() == "32\n" and len([r for r in caplog.records if "cannot set" in r.message]) == 1


@given(st.lists(st.floats(min_value=1, max_value=1e4), max_size=40))
def test_a_readahead_given_or_the_pyfuse3_default_never_follows(speeds: list[float]) -> None:
    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        for flags in (("--readahead-kb", "256"), ("--engine", "pyfuse3")):
            tuning, bdi = following(mp, Path(d), *flags)
            feed(tuning, list(speeds))
            assert tuning.knobs == knobs(*flags) and bdi.read_text() == f"{tuning.knobs.read_ahead_kb}\n"
