"""Mirror health as pure state, on a fake clock."""

from __future__ import annotations

import pytest

from colifs.health import FAILURES_TO_DOWN, FIRST_RETRY_S, MAX_RETRY_S, Health


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_down_only_after_failures_in_a_row() -> None:
    h = Health(Clock())
    for _ in range(10):  # a success between failures: one bad file must not take the drive out
        for _ in range(FAILURES_TO_DOWN - 1):
            assert not h.failed("eio")
        h.succeeded()
    assert h.up and h.errors == 10 * (FAILURES_TO_DOWN - 1)
    assert [h.failed("eio", timeout=True) for _ in range(FAILURES_TO_DOWN)][-1]
    assert not h.up and h.timeouts == FAILURES_TO_DOWN and h.downs == 1
    assert not h.failed("eio")  # already down: no second transition


def test_back_off_doubles_to_a_cap_and_resets_when_back() -> None:
    clock = Clock()
    h = Health(clock)
    for _ in range(FAILURES_TO_DOWN):
        h.failed("eio")
    waits = []
    for _ in range(8):
        assert not h.due()
        waits.append(h.wait())
        clock.t += h.wait()
        assert h.due()
        h.check_failed("eio")
    assert waits == [min(FIRST_RETRY_S * 2**i, MAX_RETRY_S) for i in range(8)]
    assert waits[-1] == MAX_RETRY_S  # a healed mirror is back within MAX_RETRY_S
    clock.t += h.wait()
    down_for = h.check_passed()
    assert h.up and h.in_a_row == 0 and down_for == sum(waits) + MAX_RETRY_S
    for _ in range(FAILURES_TO_DOWN):
        h.failed("eio")
    assert h.wait() == FIRST_RETRY_S and h.downs == 2


def test_as_dict_says_state_and_why() -> None:
    clock = Clock()
    h = Health(clock)
    assert h.as_dict()["state"] == "up" and h.as_dict()["next_check_in_s"] is None
    for _ in range(FAILURES_TO_DOWN):
        h.failed("read error at 4096: Input/output error")
    clock.t += 0.25
    d = h.as_dict()
    assert d["state"] == "down" and d["last_error"] == "read error at 4096: Input/output error"
    assert d["down_for_s"] == 0.2 or d["down_for_s"] == 0.3
    assert d["next_check_in_s"] == 0.8 and d["errors"] == FAILURES_TO_DOWN and d["last_error_at"]


@pytest.mark.parametrize(
    ("short", "share", "after"),
    [(False, 0.5, False), (False, 0.09, True), (True, 0.12, True), (True, 0.16, False), (False, 0.12, False)],
)
def test_the_extent_buffer_pauses_while_memory_is_short(short: bool, share: float, after: bool) -> None:
    from colifs.native import memory_available, memory_short

    assert memory_short(short, share) is after
    now = memory_available()
    assert now is not None and 0 < now <= 1


def test_a_removed_mirror_is_never_checked_until_restored() -> None:
    clock = Clock()
    h = Health(clock)
    for _ in range(FAILURES_TO_DOWN):
        h.failed("eio")
    h.remove()
    clock.t += 10 * MAX_RETRY_S
    assert not h.due() and h.as_dict()["state"] == "removed" and h.as_dict()["removed_at"]
    h.restore()
    assert h.due() and h.as_dict()["state"] == "down"  # checked at once: it was down when removed


def test_a_new_directory_in_a_down_slot_starts_its_own_counts_and_is_checked_first() -> None:
    clock = Clock()
    h = Health(clock)
    for _ in range(FAILURES_TO_DOWN):
        h.failed("no answer", timeout=True)
    h.remove()
    h.another_directory()
    h.restore()
    shown = h.as_dict()
    assert shown["state"] == "down" and h.due()  # checked before anything is routed to it
    assert (h.timeouts, h.errors, h.downs, h.checks, h.in_a_row, h.last_error) == (0, 0, 0, 0, 0, None)
    clock.t += 1.5
    assert h.check_passed() == 1.5 and h.as_dict()["state"] == "up"  # down for the new one's time only
