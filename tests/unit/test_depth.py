"""colifs.depth: fills run while some drive holds enough in flight at full speed (its wait before
bytes flow times its rate), with hysteresis, and stay on while that is not known."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from colifs.depth import DEPTH_BYTES, in_flight, needs_depth

NVME = in_flight(80e-6, 7e9)  # ~560 KB: one 128 KiB request in flight gets a fifth of it
CAPPED = in_flight(19e-6, 150e6)  # a blkio-capped RAM drive: ~3 KB
SATA = in_flight(100e-6, 500e6)  # ~50 KB


def test_the_bytes_in_flight_are_the_wait_times_the_rate() -> None:
    assert NVME == 560e3 and in_flight(None, 1e9) is None and in_flight(1e-4, None) is None


def test_drives_with_latency_need_fills_and_capped_drives_do_not() -> None:
    assert needs_depth([NVME, CAPPED], on=True) and needs_depth([NVME, CAPPED], on=False)
    assert not needs_depth([CAPPED, CAPPED], on=True) and not needs_depth([CAPPED, CAPPED], on=False)
    assert needs_depth([SATA, CAPPED], on=True)  # one 128 KiB request gets ~70% of such a drive


def test_unknown_drives_leave_fills_as_they_are() -> None:
    assert needs_depth([CAPPED, None], on=True)
    assert not needs_depth([CAPPED, None], on=False)
    assert needs_depth([None, None], on=True)


def test_a_drive_near_the_line_does_not_turn_fills_on_and_off() -> None:
    near = [DEPTH_BYTES * 0.9]
    assert needs_depth(near, on=True) and not needs_depth(near, on=False)


held = st.lists(st.one_of(st.none(), st.floats(0, 1e8)), min_size=1, max_size=8)


@given(held, st.floats(1, 100))
def test_more_in_flight_never_turns_fills_off(hs: list, k: float) -> None:
    more = [None if h is None else h * k for h in hs]
    for on in (True, False):
        assert needs_depth(more, on) >= needs_depth(hs, on)


@given(held)
def test_once_on_fills_stay_on_at_least_as_long(hs: list) -> None:
    assert needs_depth(hs, on=True) >= needs_depth(hs, on=False)
