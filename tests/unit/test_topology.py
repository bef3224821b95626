"""Pair scores and the best-set search behind GetPreferredAllocation for whole GPUs."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.gpu.inventory import Inventory, Link, LinkKind
from nodeagent.gpu.topology import best_gpu_set, pair_score, score_matrix, set_score, spread_pick
from tests.unit._dp_inventories import nvswitch_box, paired_box


def test_pair_scores() -> None:
    inv = paired_box()
    assert pair_score(inv, 0, 1) == 400  # 4 NVLinks
    assert pair_score(inv, 1, 2) == 50  # single switch
    assert pair_score(inv, 0, 2) == 30  # host bridge
    assert pair_score(inv, 0, 4) == 10  # cross CPU
    assert pair_score(inv, 3, 3) == 0
    assert pair_score(nvswitch_box(2), 0, 1) == 1800
    inv2 = Inventory("550", 12040, gpus=paired_box().gpus, links=(Link(0, 1, LinkKind.SAME_BOARD),))
    assert pair_score(inv2, 0, 1) == 60
    assert pair_score(inv2, 0, 2) == 20  # unknown link, same NUMA
    assert pair_score(inv2, 0, 5) == 10  # unknown link, other NUMA


def test_best_set_picks_nvlink_pairs() -> None:
    scores = score_matrix(paired_box())
    all8 = list(range(8))
    assert best_gpu_set(scores, all8, [], 2) == [0, 1]
    assert best_gpu_set(scores, all8, [5], 2) == [4, 5]
    assert best_gpu_set(scores, [1, 2, 3, 5, 6, 7], [], 2) == [2, 3]
    assert best_gpu_set(scores, all8, [], 4) == [0, 1, 2, 3]
    assert best_gpu_set(scores, all8, [6], 4) == [4, 5, 6, 7]
    assert best_gpu_set(scores, all8, [0, 7], 3) in ([0, 1, 7], [0, 6, 7])


def test_must_include_always_and_exact_size() -> None:
    scores = score_matrix(paired_box())
    assert best_gpu_set(scores, [2, 3], [0, 4], 2) == [0, 4]
    assert best_gpu_set(scores, [], [1, 2, 3], 2) == [1, 2]
    assert best_gpu_set(scores, [0, 1], [], 5) == [0, 1]  # cannot exceed what exists


@settings(max_examples=40, deadline=None)
@given(st.sets(st.integers(0, 7), min_size=1), st.data())
def test_best_set_is_optimal(available: set[int], data: st.DataObject) -> None:
    scores = score_matrix(paired_box())
    avail = sorted(available)
    must = data.draw(st.lists(st.sampled_from(avail), unique=True, max_size=len(avail)))
    size = data.draw(st.integers(len(must), len(avail)))
    got = best_gpu_set(scores, avail, must, size)
    assert len(got) == size and set(must) <= set(got) <= set(avail)
    rest = [a for a in avail if a not in must]
    best = max(set_score(scores, [*must, *c]) for c in itertools.combinations(rest, size - len(must)))
    assert set_score(scores, got) == best


def test_greedy_beyond_exact_limit() -> None:
    import nodeagent.gpu.topology as topo

    scores = score_matrix(paired_box())
    old = topo.EXACT_SEARCH_LIMIT
    topo.EXACT_SEARCH_LIMIT = 1
    try:
        got = best_gpu_set(scores, list(range(8)), [2], 2)
    finally:
        topo.EXACT_SEARCH_LIMIT = old
    assert got == [2, 3]


def test_spread_pick_distributed_and_packed() -> None:
    items = [f"{g}::{r}" for g in "AB" for r in range(3)]

    def group(i: str) -> str:
        return i[0]

    assert spread_pick(items, [], 2, group, {}) == ["A::0", "B::0"]
    assert spread_pick(items, [], 2, group, {"A": 1}) == ["B::0", "A::0"]
    assert spread_pick(items, [], 3, group, {}, "packed") == ["A::0", "A::1", "A::2"]
    assert spread_pick(items[1:], [], 2, group, {"A": 1}, "packed") == ["A::1", "A::2"]
    assert spread_pick(items, ["B::2"], 2, group, {}) == ["B::2", "A::0"]


def test_greedy_seeds_with_best_pair() -> None:
    import nodeagent.gpu.topology as topo

    scores = score_matrix(paired_box())
    old = topo.EXACT_SEARCH_LIMIT
    topo.EXACT_SEARCH_LIMIT = 1
    try:
        got = best_gpu_set(scores, [1, 2, 4, 5, 7], [], 2)
    finally:
        topo.EXACT_SEARCH_LIMIT = old
    assert got == [4, 5]
