"""The error boundary's rate limit (pure)."""

from __future__ import annotations

from colifs.boundary import RateLimit


def test_rate_limit_passes_a_burst_per_period_and_counts_the_rest() -> None:
    now = [0.0]
    limit = RateLimit(3, 60.0, clock=lambda: now[0])
    assert [limit.take() for _ in range(5)] == [0, 0, 0, None, None]
    now[0] = 59.9
    assert limit.take() is None
    now[0] = 60.0
    assert limit.take() == 3  # the three held back are reported with the next that passes
    assert limit.take() == 0
