"""Placement search over a GPU's MIG placement table (pure).

A GPU offers profiles, each with the memory-slice starts where an instance may sit and the number of
slices it covers (``MigProfile.placement_starts`` / ``placement_size``, as NVML's possible-placements
call reports them). A layout fits when every instance gets a start from its profile's list and no two
instances share a memory slice; the compute slices of all instances must also fit, and at most one
media-extension (``+me``) instance exists per GPU (the media engines are not divisible).

Everything is decided here from the table: nothing is tried against NVML.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

from nodeagent.gpu.inventory import Gpu, MigDevice, MigProfile


@dataclass(frozen=True)
class Slot:
    """One instance at one placement."""

    profile: str
    start: int
    size: int

    @property
    def mask(self) -> int:
        return ((1 << self.size) - 1) << self.start

    def __str__(self) -> str:
        return f"{self.profile}@{self.start}"


@dataclass(frozen=True)
class Layout:
    """Result of a search: existing instances kept and new instances with their placements."""

    keep: tuple[MigDevice, ...]
    create: tuple[Slot, ...]


class NoFit(Exception):
    """A layout cannot fit; ``reason`` is one sentence naming the profiles and memory slices."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def memory_slices(gpu: Gpu) -> int:
    """Memory slices of the GPU: the end of the furthest placement in its table."""
    return max((s + p.placement_size for p in gpu.mig_profiles for s in p.placement_starts), default=0)


def compute_slices(gpu: Gpu) -> int:
    return max((p.slice_count for p in gpu.mig_profiles), default=0)


def _is_me(profile: str) -> bool:
    return "+me" in profile


def _describe(counts: Mapping[str, int]) -> str:
    return " + ".join(f"{n} x {p}" for p, n in counts.items() if n > 0)


def _mask_of(d: MigDevice) -> int:
    return ((1 << d.placement_size) - 1) << d.placement_start


def check_totals(gpu: Gpu, counts: Mapping[str, int]) -> None:
    """Raise ``NoFit`` when counts alone rule the layout out (before any placement search)."""
    profiles = {p.name: p for p in gpu.mig_profiles}
    for prof, n in counts.items():
        p = profiles.get(prof)
        if p is None:
            raise NoFit(f"{gpu.name} offers no MIG profile {prof}")
        if n > p.instance_count:
            raise NoFit(f"{n} x {prof} asked but {gpu.name} holds at most {p.instance_count} of them")
    mem_total = memory_slices(gpu)
    mem = sum(profiles[p].placement_size * n for p, n in counts.items())
    if mem > mem_total:
        parts = " + ".join(f"{n} x {p} ({profiles[p].placement_size} each)" for p, n in counts.items() if n)
        raise NoFit(f"{parts} need {mem} memory slices but {gpu.name} has {mem_total}")
    cmp_total = compute_slices(gpu)
    cmp_ = sum(profiles[p].slice_count * n for p, n in counts.items())
    if cmp_ > cmp_total:
        raise NoFit(f"{_describe(counts)} need {cmp_} compute slices but {gpu.name} has {cmp_total}")
    me = sum(n for p, n in counts.items() if _is_me(p))
    if me > 1:
        raise NoFit(f"{_describe({p: n for p, n in counts.items() if _is_me(p)})} asked but a GPU holds "
                    "one media-extension (+me) instance at most")


def _fill(items: Sequence[MigProfile], occupied: int) -> list[int] | None:
    """Starts for ``items`` (sorted, equal profiles adjacent) avoiding ``occupied``; None when impossible."""
    dead: set[tuple[int, int]] = set()
    chosen: list[int] = []

    def go(i: int, occ: int) -> bool:
        if i == len(items):
            return True
        key = (i, occ)
        if key in dead:
            return False
        p = items[i]
        # Same profile as the previous item: only later starts, so permutations are not searched twice.
        floor = chosen[-1] + 1 if i > 0 and items[i - 1].name == p.name else -1
        m0 = (1 << p.placement_size) - 1
        for s in sorted(p.placement_starts):
            if s < floor:
                continue
            m = m0 << s
            if occ & m:
                continue
            chosen.append(s)
            if go(i + 1, occ | m):
                return True
            chosen.pop()
        dead.add(key)
        return False

    return list(chosen) if go(0, occupied) else None


def _order(gpu: Gpu, counts: Mapping[str, int]) -> list[MigProfile]:
    """Instances to place, largest first (the fewest choices first keeps the search short)."""
    items: list[MigProfile] = []
    for prof, n in counts.items():
        p = gpu.profile(prof)
        assert p is not None
        items.extend([p] * n)
    items.sort(key=lambda p: (-p.placement_size, len(p.placement_starts), p.name))
    return items


def find_layout(gpu: Gpu, counts: Mapping[str, int], existing: Sequence[MigDevice] = ()) -> Layout:
    """Placements for ``counts`` keeping as many ``existing`` instances as possible.

    Raises ``NoFit`` with the reason when no placement exists even on an empty GPU.
    """
    counts = {p: n for p, n in counts.items() if n > 0}
    check_totals(gpu, counts)
    # Existing instances that could stay: their profile is wanted. Larger ones first so that, among
    # equally many kept, the larger (more disruptive to recreate) instances are preferred.
    candidates = sorted(
        (d for d in existing if counts.get(d.profile, 0) > 0),
        key=lambda d: (-d.placement_size, d.placement_start, d.gi_id),
    )
    for k in range(len(candidates), -1, -1):
        for keep in combinations(candidates, k):
            left = dict(counts)
            ok = True
            occ = 0
            for d in keep:
                left[d.profile] -= 1
                m = _mask_of(d)
                if left[d.profile] < 0 or occ & m:
                    ok = False
                    break
                occ |= m
            if not ok:
                continue
            items = _order(gpu, left)
            starts = _fill(items, occ)
            if starts is not None:
                slots = tuple(
                    sorted((Slot(p.name, s, p.placement_size) for p, s in zip(items, starts, strict=True)),
                           key=lambda x: x.start)
                )
                return Layout(tuple(sorted(keep, key=lambda d: d.placement_start)), slots)
    # Even an empty GPU (k == 0) gave nothing: explain with the table.
    table = {p.name: p for p in gpu.mig_profiles}
    starts_txt = "; ".join(
        f"{p} at {{{','.join(str(s) for s in sorted(table[p].placement_starts))}}}" for p in counts
    )
    used = sum(table[p].placement_size * n for p, n in counts.items())
    raise NoFit(
        f"{_describe(counts)} cover {used} of {memory_slices(gpu)} memory slices on {gpu.name} but no "
        f"placement lets them coexist (starts: {starts_txt})"
    )


def fits(gpu: Gpu, counts: Mapping[str, int]) -> bool:
    """Whether ``counts`` fit on an empty ``gpu``."""
    try:
        find_layout(gpu, counts)
    except NoFit:
        return False
    return True
