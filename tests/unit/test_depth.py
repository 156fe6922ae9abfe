"""colifs.depth: fills run while some drive holds enough in flight at full speed (its wait before
bytes flow times its rate), with hysteresis once decided, and undecided (running) while a drive's
figure is not known."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from colifs.depth import DEPTH_BYTES, HYSTERESIS, in_flight, needs_depth

NVME = in_flight(80e-6, 7e9)  # ~560 KB: one 128 KiB request in flight gets a fifth of it
CAPPED = in_flight(19e-6, 150e6)  # a blkio-capped RAM drive: ~3 KB
RAM_FAST = in_flight(19e-6, 1.5e9)  # the fast RAM pair's drive at the rate it served: ~28 KB
SATA = in_flight(100e-6, 500e6)  # ~50 KB


def test_the_bytes_in_flight_are_the_wait_times_the_rate() -> None:
    assert NVME == 560e3 and in_flight(None, 1e9) is None and in_flight(1e-4, None) is None


def test_drives_with_latency_need_fills_and_capped_drives_do_not() -> None:
    for was in (None, True, False):
        assert needs_depth([NVME, CAPPED], was) is True
        assert needs_depth([CAPPED, CAPPED], was) is False
    assert needs_depth([SATA, CAPPED], None) is True  # one 128 KiB request gets ~72% of such a drive


def test_the_first_decision_ignores_fills_that_ran_while_undecided() -> None:
    """Run 71l: fills on from the start stayed on for a RAM drive by the hysteresis alone."""
    assert needs_depth([RAM_FAST, CAPPED], None) is False
    assert needs_depth([RAM_FAST, CAPPED], True) is True  # a decision made stays within the band


def test_unknown_drives_leave_fills_undecided_unless_one_drive_surely_needs_them() -> None:
    assert needs_depth([CAPPED, None], None) is None
    assert needs_depth([CAPPED, None], False) is None
    assert needs_depth([None, None], True) is None
    assert needs_depth([NVME, None], False) is True


def test_a_drive_near_the_line_does_not_turn_fills_on_and_off() -> None:
    near = [DEPTH_BYTES * 0.9]
    assert needs_depth(near, True) and not needs_depth(near, False)
    far = [DEPTH_BYTES / HYSTERESIS * 0.9]
    assert not needs_depth(far, True)


held = st.lists(st.one_of(st.none(), st.floats(0, 1e8)), min_size=1, max_size=8)
was = st.one_of(st.none(), st.booleans())


def _runs(decision: bool | None) -> bool:
    return decision is not False


@given(held, st.floats(1, 100), was)
def test_more_in_flight_never_turns_fills_off(hs: list, k: float, w: bool | None) -> None:
    more = [None if h is None else h * k for h in hs]
    assert _runs(needs_depth(more, w)) >= _runs(needs_depth(hs, w))


@given(held)
def test_once_on_fills_stay_on_at_least_as_long(hs: list) -> None:
    assert _runs(needs_depth(hs, True)) >= _runs(needs_depth(hs, None)) >= _runs(needs_depth(hs, False))


@given(held, was)
def test_undecided_only_while_a_figure_is_missing(hs: list, w: bool | None) -> None:
    if None not in hs:
        assert needs_depth(hs, w) is not None
