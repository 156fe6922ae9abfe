"""The mount's readahead, chosen from the drives' probed speed unless given."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from colifs.cli import parser
from colifs.config import mount_config
from colifs.kernel import Knobs


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
