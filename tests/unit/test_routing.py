"""Routing: deterministic, weighted, per-layer exact quotas, few keys move when weights change."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from colifs.formats.layout import ExpertKey
from colifs.routing import digest, parse_weights, pick, positions, stripe_rotation, stripe_sequence


def experts(layers: int, n: int, stack: str = "model.layers") -> list[ExpertKey]:
    return [ExpertKey(stack, L, e) for L in range(layers) for e in range(n)]


def test_digest_is_fixed_across_runs_machines_and_versions() -> None:
    # Golden values: if these change, every existing mount would re-route its keys.
    assert digest(ExpertKey("model.layers", 3, 7)) == 0x115FE5BC90B4DFF0
    assert digest("model.embed_tokens.weight") == 0x652945DF61B83A88


def test_same_routing_in_a_fresh_interpreter_with_another_hash_seed() -> None:
    keys = [*experts(2, 8), "a", "b", "lm_head.weight"]
    here = [pick(u, [3, 1]) for u in (positions(keys)[k] for k in keys)]
    code = (
        "from colifs.routing import positions, pick; from colifs.formats.layout import ExpertKey;"
        "keys=[ExpertKey('model.layers', L, e) for L in range(2) for e in range(8)]"
        "+['a','b','lm_head.weight'];"
        "p=positions(keys); print([pick(p[k],[3,1]) for k in keys])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": "12345"}
    )
    assert out.stdout.strip() == str(here)


@pytest.mark.parametrize("weights", [[1, 1], [3, 1], [9, 3], [1, 1, 2], [5, 1]])
def test_each_layer_gets_its_exact_quota(weights: list[float]) -> None:
    n = 64
    keys = experts(10, n)
    where = positions(keys)
    total = sum(weights)
    for L in range(10):
        counts = Counter(pick(where[ExpertKey("model.layers", L, e)], weights) for e in range(n))
        for drive, w in enumerate(weights):
            assert abs(counts[drive] - n * w / total) <= 1, (L, counts)


@pytest.mark.parametrize("weights", [[1, 1], [3, 1]])
def test_name_keys_follow_the_weights(weights: list[float]) -> None:
    names = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(4000)]
    where = positions(names)
    share = sum(pick(where[k], weights) == 1 for k in names) / len(names)
    assert share == pytest.approx(weights[1] / sum(weights), abs=0.03)


def test_one_decode_step_does_not_cluster() -> None:
    # 8 experts of one layer read together: on a 3:1 pair, never all on the slow drive, and on
    # average 2 of them there.
    keys = experts(60, 256)
    where = positions(keys)
    on_mirror = []
    for L in range(60):
        for start in range(0, 256, 8):
            on_mirror.append(
                sum(pick(where[ExpertKey("model.layers", L, e)], [3, 1]) for e in range(start, start + 8))
            )
    assert max(on_mirror) < 8
    assert sum(on_mirror) / len(on_mirror) == pytest.approx(2.0, abs=0.05)


def test_changing_weights_moves_only_the_keys_between_the_boundaries() -> None:
    keys = experts(20, 128) + [f"n{i}" for i in range(2000)]
    where = positions(keys)
    before = {k: pick(where[k], [3, 1]) for k in keys}
    after = {k: pick(where[k], [2, 1]) for k in keys}
    moved = sum(before[k] != after[k] for k in keys) / len(keys)
    assert moved == pytest.approx(1 / 3 - 1 / 4, abs=0.02)  # the minimum possible
    assert all(after[k] == 1 for k in keys if before[k] == 1)  # moves go one way only


def test_mtp_stack_does_not_collide_with_main_stack() -> None:
    where = positions([ExpertKey("model.layers", 0, e) for e in range(4)] + [ExpertKey("mtp.layers", 0, 0)])
    assert where[ExpertKey("mtp.layers", 0, 0)] == 0.5  # its own layer of one expert


@given(
    st.floats(0, 1, exclude_max=True),
    st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0, 9.0]), min_size=1, max_size=5),
)
def test_pick_never_chooses_a_zero_weight(u: float, rest: list[float]) -> None:
    weights = [1.0, *rest]
    assert weights[pick(u, weights)] > 0


def test_parse_weights() -> None:
    assert parse_weights("9,3", 2) == [9.0, 3.0]
    assert parse_weights("9:3:1", 3) == [9.0, 3.0, 1.0]
    for bad in ("9", "9,0", "a,b", "9,-1", "9,inf", "9,nan"):
        with pytest.raises(ValueError):
            parse_weights(bad, 2)


# -- striping --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "bound"),
    # A key of k chunks gets a window of k consecutive entries: each drive's count is within one
    # chunk of k x its weight share for two drives; with three or more drives, or ratios that
    # 64 slots can only approximate (7:2, 10:1), within 4/3 of a chunk.
    [
        ([3, 1], 1),
        ([1, 1], 1),
        ([9, 3], 1),
        ([156, 50.9], 1),
        ([1, 1, 2], 4 / 3),
        ([5, 0, 1], 4 / 3),
        ([7, 2], 4 / 3),
    ],
)
def test_stripe_sequence_follows_the_weights_in_every_window(weights: list[float], bound: float) -> None:
    seq = stripe_sequence(weights)
    total = sum(weights)
    for drive, w in enumerate(weights):
        assert abs(seq.count(drive) - len(seq) * w / total) <= 1
        if w == 0:
            assert drive not in seq  # never a drive without a valid copy
    doubled = seq + seq  # windows wrap around: a key's chunks start at any rotation
    for k in range(1, len(seq) + 1):
        for start in range(len(seq)):
            window = doubled[start : start + k]
            for drive, w in enumerate(weights):
                assert abs(window.count(drive) - k * w / total) <= bound + 1e-9, (k, start, window)


def test_stripe_sequence_and_rotation_are_deterministic() -> None:
    assert stripe_sequence([3, 1]) == stripe_sequence([3.0, 1.0])
    assert stripe_rotation("model-00003-of-00160.safetensors") == stripe_rotation(
        "model-00003-of-00160.safetensors"
    )
    rotations = {stripe_rotation(f"model-{k:05d}-of-00160.safetensors") for k in range(1, 161)}
    assert len(rotations) > 50  # shards laid out alike start their stripes at different places


# -- partial mirrors ---------------------------------------------------------------------------------


def test_balanced_weights_for_one_partial_mirror_match_the_closed_form() -> None:
    from colifs.routing import balanced_weights, expected_shares

    for w0, w1, held in [(1, 1, 0.8), (3, 1, 0.5), (9, 3, 0.3), (1, 1, 0.3), (2, 1, 0.9)]:
        traffic = {(0, 1): held, (0,): 1 - held}
        v = balanced_weights([w0, w1], traffic)
        share = w1 / (w0 + w1)
        among_held = min(1.0, share / held)  # the mirror's share of the keys it holds
        assert v[1] / (v[0] + v[1]) == pytest.approx(among_held, abs=1e-4)
        assert expected_shares(v, traffic)[1] == pytest.approx(min(share, held), abs=1e-4)


def test_balanced_weights_leave_full_copies_alone_and_handle_several_partial_mirrors() -> None:
    from colifs.routing import balanced_weights, expected_shares

    v = balanced_weights([5, 3, 2], {(0, 1, 2): 1.0})
    assert [x / sum(v) for x in v] == pytest.approx([0.5, 0.3, 0.2], abs=1e-6)
    # two mirrors holding different, overlapping parts: the targets are reachable, so reached
    traffic = {(0, 1, 2): 0.3, (0, 1): 0.3, (0, 2): 0.2, (0,): 0.2}
    v = balanced_weights([2, 1, 1], traffic)
    assert expected_shares(v, traffic) == pytest.approx([0.5, 0.25, 0.25], abs=1e-4)
    # deterministic
    assert balanced_weights([2, 1, 1], traffic) == v
