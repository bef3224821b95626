"""GPU pair scores and best-set search for preferred allocations (pure, no I/O).

Scores follow the best-effort policy users know from NVIDIA's allocator: a pair scores by how the two
GPUs reach each other (cross-CPU 10 … same board 60, NVLink 100 per link) and a set scores the sum of
its pairs. The search is exact (every combination) while that is cheap, and greedy beyond.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

from nodeagent.gpu.inventory import Inventory, LinkKind

LINK_SCORES: dict[LinkKind, int] = {
    LinkKind.CROSS_CPU: 10,
    LinkKind.SAME_CPU: 20,
    LinkKind.HOST_BRIDGE: 30,
    LinkKind.MULTI_SWITCH: 40,
    LinkKind.SINGLE_SWITCH: 50,
    LinkKind.SAME_BOARD: 60,
}
NVLINK_SCORE_PER_LINK = 100
EXACT_SEARCH_LIMIT = 20_000  # combinations scored exhaustively before switching to greedy

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def pair_score(inventory: Inventory, a: int, b: int) -> int:
    """Score of GPUs ``a`` and ``b`` reaching each other (unknown link: judged by NUMA node)."""
    if a == b:
        return 0
    link = inventory.link(a, b)
    if link is not None:
        if link.kind is LinkKind.NVLINK:
            return NVLINK_SCORE_PER_LINK * max(1, link.nvlinks)
        return LINK_SCORES[link.kind]
    try:
        na, nb = inventory.gpu(a).numa_node, inventory.gpu(b).numa_node
    except KeyError:
        return 0
    if na is not None and na == nb:
        return LINK_SCORES[LinkKind.SAME_CPU]
    return LINK_SCORES[LinkKind.CROSS_CPU]


def score_matrix(inventory: Inventory) -> dict[tuple[int, int], int]:
    indices = [g.index for g in inventory.gpus]
    return {(a, b): pair_score(inventory, a, b) for a in indices for b in indices}


def set_score(scores: dict[tuple[int, int], int], members: Iterable[int]) -> int:
    m = list(members)
    return sum(scores.get((a, b), 0) for a, b in itertools.combinations(m, 2))


def best_gpu_set(
    scores: dict[tuple[int, int], int], available: Sequence[int], must_include: Sequence[int], size: int
) -> list[int]:
    """The ``size`` GPUs (``must_include`` plus picks from ``available``) with the highest set score.

    ``must_include`` is always in the answer (truncated if it alone exceeds ``size``). Ties go to
    the lowest indices, so answers are stable.
    """
    required = list(dict.fromkeys(must_include))
    if size <= len(required):
        return sorted(required[:size])
    pool = sorted(i for i in dict.fromkeys(available) if i not in required)
    need = size - len(required)
    if need >= len(pool):
        return sorted(required + pool)

    base = set_score(scores, required)

    def gain(member: int, chosen: Iterable[int]) -> int:
        return sum(scores.get((member, c), 0) for c in chosen)

    if math.comb(len(pool), need) <= EXACT_SEARCH_LIMIT:
        best: tuple[int, ...] = ()
        best_score = -1
        for combo in itertools.combinations(pool, need):  # lexicographic: first best has lowest indices
            s = base + sum(gain(m, required) for m in combo) + set_score(scores, combo)
            if s > best_score:
                best, best_score = combo, s
        return sorted(required + list(best))

    chosen = list(required)
    rest = list(pool)
    if not chosen and need >= 2:  # seed with the best pair, not just the lowest index
        a, b = max(itertools.combinations(rest, 2), key=lambda p: (scores.get(p, 0), -p[0], -p[1]))
        chosen += [a, b]
        rest = [r for r in rest if r not in (a, b)]
    while len(chosen) < size:
        pick = max(rest, key=lambda m: (gain(m, chosen), -m))
        chosen.append(pick)
        rest.remove(pick)
    return sorted(chosen)


def spread_pick(
    available: Sequence[T],
    must_include: Sequence[T],
    size: int,
    group_of: Callable[[T], K],
    used: dict[K, int],
    policy: str = "distributed",
) -> list[T]:
    """Pick ``size`` items where each belongs to a group (a physical GPU or MIG device).

    ``distributed`` takes each next item from the group with the fewest used members (spreading
    load); ``packed`` from the group with the most (filling one before the next). ``used`` counts
    members of each group already taken by others; picks made here count too. Ties: input order.
    """
    chosen = list(dict.fromkeys(must_include))[:size]
    load = dict(used)
    for item in chosen:
        g = group_of(item)
        load[g] = load.get(g, 0) + 1
    remaining = [a for a in dict.fromkeys(available) if a not in chosen]
    order = {a: n for n, a in enumerate(remaining)}
    sign = 1 if policy == "distributed" else -1
    while len(chosen) < size and remaining:
        pick = min(remaining, key=lambda a: (sign * load.get(group_of(a), 0), order[a]))
        chosen.append(pick)
        remaining.remove(pick)
        g = group_of(pick)
        load[g] = load.get(g, 0) + 1
    return chosen
