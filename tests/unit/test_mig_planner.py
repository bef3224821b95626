"""Planner and placement search on every MIG table of nodeagent/gpu/profiles.py."""

from __future__ import annotations

import time
from itertools import product as cartesian

import pytest

from nodeagent.errors import ConfigError
from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice
from nodeagent.gpu.profiles import PRODUCTS, gpu_instance_id
from nodeagent.mig.layout import NoFit, check_totals, compute_slices, find_layout, fits, memory_slices
from nodeagent.mig.planner import plan, plan_gpu
from nodeagent.mig.spec import Desired, Selection, parse_config, resolve


def _arch(key: str) -> str:
    if key.startswith(("A100", "A30")):
        return "ampere"
    if key.startswith(("B", "GB", "RTX-PRO")):
        return "blackwell"
    return "hopper"  # H100, H200, H20, GH200


ARCH = {key: _arch(key) for key in PRODUCTS}


def make_gpu(key: str, index: int = 0, layout: tuple[tuple[str, int], ...] = (), enabled: bool | None = None) -> Gpu:
    prod = PRODUCTS[key]
    devs = []
    for prof_name, start in layout:
        p = prod.profile(prof_name)
        assert p is not None
        gi = gpu_instance_id(prod, start, p.placement_size)
        devs.append(MigDevice(index, gi, 0, prof_name, start, p.placement_size, p.memory_mib, f"MIG-{index}-{gi}"))
    on = bool(layout) if enabled is None else enabled
    return Gpu(index=index, uuid=f"GPU-{index}", name=f"NVIDIA {key}", pci_bus_id=f"0000:{index:02x}:00.0",
               pci_device_id=prod.pci_device_ids[0], memory_mib=prod.profiles[-1].memory_mib, numa_node=0,
               compute_major={"ampere": 8, "hopper": 9}.get(ARCH[key], 10), compute_minor=0, minor_number=index,
               architecture=ARCH[key], mig_capable=True, mig_current=on, mig_pending=on,
               mig_profiles=prod.profiles, mig_devices=tuple(devs))


def occupied_ok(gpu: Gpu, slots: list[tuple[str, int]]) -> bool:
    """Independent check: every slot is a documented start and no memory slice is used twice."""
    used: set[int] = set()
    for name, start in slots:
        p = gpu.profile(name)
        assert p is not None
        if start not in p.placement_starts:
            return False
        cells = set(range(start, start + p.placement_size))
        if used & cells:
            return False
        used |= cells
    chosen = [gpu.profile(n) for n, _ in slots]
    return sum(p.slice_count for p in chosen if p is not None) <= compute_slices(gpu)


@pytest.mark.parametrize("key", sorted(PRODUCTS))
def test_every_single_profile_fills_to_its_count(key: str) -> None:
    gpu = make_gpu(key)
    for p in gpu.mig_profiles:
        lay = find_layout(gpu, {p.name: p.instance_count})
        assert len(lay.create) == p.instance_count
        assert occupied_ok(gpu, [(s.profile, s.start) for s in lay.create])
        with pytest.raises(NoFit, match=rf"{p.instance_count + 1} x {p.name.replace('+', '[+]')} asked"):
            find_layout(gpu, {p.name: p.instance_count + 1})


@pytest.mark.parametrize("key", ["A100-40GB", "A30-24GB"])
def test_search_agrees_with_brute_force(key: str) -> None:
    """Every count combination of the plain profiles: the search says fit exactly when brute force does.

    The A100-80GB, H100 and H200 tables have the A100-40GB geometry (checked below), so two keys suffice.
    """
    gpu = make_gpu(key)
    profs = [p for p in gpu.mig_profiles if "+" not in p.name]
    slices = memory_slices(gpu)

    def brute(counts: dict[str, int]) -> bool:
        items = [gpu.profile(n) for n, c in counts.items() for _ in range(c)]
        for starts in cartesian(*[p.placement_starts for p in items if p is not None]):
            slots = [(p.name, s) for p, s in zip(items, starts, strict=True) if p is not None]
            if occupied_ok(gpu, slots):
                return True
        return not items

    ranges = [range(min(p.instance_count, slices // p.placement_size) + 1) for p in profs]
    checked = 0
    for combo in cartesian(*ranges):
        counts = {p.name: n for p, n in zip(profs, combo, strict=True) if n}
        if sum(p.placement_size * counts[p.name] for p in profs if p.name in counts) > slices:
            assert not fits(gpu, counts)
            continue
        assert fits(gpu, counts) == brute(counts), counts
        checked += 1
    assert checked > 5


def test_eight_slice_tables_share_geometry() -> None:
    def geo(key: str) -> list[tuple[int, int, tuple[int, ...], int]]:
        return [(p.slice_count, p.instance_count, p.placement_starts, p.placement_size) for p in PRODUCTS[key].profiles]

    assert geo("A100-80GB") == geo("H100-80GB") == geo("H200-141GB") == geo("A100-40GB")


def test_a100_40_reasons() -> None:
    gpu = make_gpu("A100-40GB")
    with pytest.raises(NoFit) as e:
        find_layout(gpu, {"3g.20gb": 2, "1g.5gb": 1})
    assert e.value.reason == ("2 x 3g.20gb (4 each) + 1 x 1g.5gb (1 each) need 9 memory slices but "
                              "NVIDIA A100-40GB has 8")
    with pytest.raises(NoFit, match=r"4 x 1g.5gb \+ 1 x 4g.20gb need 8 compute slices but NVIDIA A100-40GB has 7"):
        check_totals(gpu, {"1g.5gb": 4, "4g.20gb": 1})
    with pytest.raises(NoFit, match=r"media-extension"):
        find_layout(make_gpu("A30-24GB"), {"1g.6gb+me": 1, "2g.12gb+me": 1})
    with pytest.raises(NoFit, match=r"offers no MIG profile 1g.10gb"):
        find_layout(make_gpu("A30-24GB"), {"1g.10gb": 1})


def test_a100_placement_only_failure_names_starts() -> None:
    """4g.20gb + 1g.5gb x 3 fits (0-3, 4, 5, 6); with a kept 1g at slice 0 it would not — the search
    must then give the instance up rather than fail."""
    gpu = make_gpu("A100-40GB", layout=(("1g.5gb", 0),))
    lay = find_layout(gpu, {"4g.20gb": 1, "1g.5gb": 3}, gpu.mig_devices)
    assert lay.keep == ()
    assert [(s.profile, s.start) for s in lay.create] == [("4g.20gb", 0), ("1g.5gb", 4), ("1g.5gb", 5), ("1g.5gb", 6)]


def test_mixed_layouts_fitting_on_each_table() -> None:
    cases = {
        "A100-40GB": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1},
        "A100-80GB": {"4g.40gb": 1, "2g.20gb": 1, "1g.10gb": 1},
        "H100-80GB": {"1g.20gb": 1, "1g.10gb": 5},
        "H200-141GB": {"3g.71gb": 1, "1g.35gb": 2},
        "A30-24GB": {"2g.12gb": 1, "1g.6gb": 1, "1g.6gb+me": 1},
    }
    for key, counts in cases.items():
        gpu = make_gpu(key)
        lay = find_layout(gpu, counts)
        assert occupied_ok(gpu, [(s.profile, s.start) for s in lay.create]), key
        assert sorted(s.profile for s in lay.create) == sorted(p for p, n in counts.items() for _ in range(n))


def test_keeps_existing_instances_that_fit() -> None:
    gpu = make_gpu("H100-80GB", layout=(("3g.40gb", 4), ("1g.10gb", 0), ("1g.10gb", 1), ("2g.20gb", 2)))
    p = plan_gpu(gpu, Desired(True, (("3g.40gb", 1), ("1g.10gb", 4))))
    assert p.mode is None
    assert {(d.profile, d.placement_start) for d in p.keep} == {("3g.40gb", 4), ("1g.10gb", 0), ("1g.10gb", 1)}
    assert [(d.profile, d.placement_start) for d in p.destroy] == [("2g.20gb", 2)]
    assert [(s.profile, s.start) for s in p.create] == [("1g.10gb", 2), ("1g.10gb", 3)]


def test_matching_gpu_untouched_and_plan_lists_only_changes() -> None:
    g0 = make_gpu("A100-80GB", 0, (("3g.40gb", 0), ("3g.40gb", 4)))
    g1 = make_gpu("A100-80GB", 1, (("7g.80gb", 0),))
    g2 = make_gpu("A100-80GB", 2, enabled=False)
    inv = Inventory("550.54.15", 12040, (g0, g1, g2))
    cfg = parse_config("version: v1\nmig-configs:\n  halves:\n    - devices: [0, 1]\n      mig-enabled: true\n"
                       "      mig-devices: {3g.40gb: 2}\n")
    name, entries = cfg.select("halves")
    pl = plan(inv, resolve(name, entries, inv))
    assert [g.index for g in pl.touched] == [1]
    assert not pl.gpus[0].changes and pl.gpus[0].keep == g0.mig_devices
    assert pl.skipped == (2,)
    text = pl.render()
    assert "GPU 0 (NVIDIA A100-80GB): unchanged (MIG on: 3g.40gb@0, 3g.40gb@4)" in text
    assert "GPU 1 (NVIDIA A100-80GB): destroy 7g.80gb@0 (GI 0); create 3g.40gb@0, 3g.40gb@4" in text
    assert not pl.applied


def test_mode_changes() -> None:
    off = make_gpu("A30-24GB", enabled=False)
    p = plan_gpu(off, Desired(True, (("2g.12gb", 2),)))
    assert p.mode is True and p.destroy == () and [s.start for s in p.create] == [0, 2]
    on = make_gpu("A30-24GB", layout=(("4g.24gb", 0),))
    p = plan_gpu(on, Desired(False))
    assert p.mode is False and [d.profile for d in p.destroy] == ["4g.24gb"]
    assert not plan_gpu(off, Desired(False)).changes
    # "all-enabled": MIG on with no instances destroys what exists, no mode change
    p = plan_gpu(on, Desired(True))
    assert p.mode is None and len(p.destroy) == 1 and p.create == ()
    # pending disable is cancelled by setting the mode on again
    pend = make_gpu("A30-24GB", layout=(("4g.24gb", 0),))
    pend = Gpu(**{**pend.__dict__, "mig_pending": False})
    assert plan_gpu(pend, Desired(True, (("4g.24gb", 1),))).mode is True


def test_plan_non_fit_is_config_error_naming_entry() -> None:
    inv = Inventory("550", 12040, (make_gpu("A100-40GB", 0),))
    sel = Selection("big", {0: Desired(True, (("3g.20gb", 2), ("2g.10gb", 1)), "config big entry 0")})
    with pytest.raises(ConfigError) as e:
        plan(inv, sel)
    assert str(e.value) == ("config big entry 0: GPU 0: 2 x 3g.20gb (4 each) + 1 x 2g.10gb (2 each) need 10 "
                            "memory slices but NVIDIA A100-40GB has 8")


def test_worst_mixed_layout_on_8_gpus_is_fast() -> None:
    """Seven 1g instances everywhere, replaced by a layout that keeps few: the search stays small."""
    gpus = tuple(make_gpu("A100-40GB", i, tuple(("1g.5gb", s) for s in range(7))) for i in range(8))
    inv = Inventory("550", 12040, gpus)
    sel = Selection("mixed", {i: Desired(True, (("1g.10gb", 1), ("2g.10gb", 1), ("1g.5gb", 3), ("1g.5gb+me", 1)))
                              for i in range(8)})
    t0 = time.perf_counter()
    pl = plan(inv, sel)
    elapsed = time.perf_counter() - t0
    for g in pl.gpus:
        assert len(g.keep) + len(g.create) == 6
        assert occupied_ok(inv.gpu(g.index), [(d.profile, d.placement_start) for d in g.keep]
                           + [(s.profile, s.start) for s in g.create])
        assert len(g.keep) == 3  # three 1g.5gb stay
    assert elapsed < 5  # sanity bound only; figures are in tests/bench/bench_mig.py


NON_FIT: list[tuple[str, dict[str, int], str]] = [
    ("A100-80GB", {"4g.40gb": 1, "3g.40gb": 1, "1g.10gb": 1},
     "1 x 4g.40gb (4 each) + 1 x 3g.40gb (4 each) + 1 x 1g.10gb (1 each) need 9 memory slices but NVIDIA "
     "A100-80GB has 8"),
    ("A100-80GB", {"1g.20gb": 4, "1g.10gb": 1},
     "4 x 1g.20gb (2 each) + 1 x 1g.10gb (1 each) need 9 memory slices but NVIDIA A100-80GB has 8"),
    ("A100-80GB", {"2g.20gb": 3, "1g.10gb": 2}, "3 x 2g.20gb + 2 x 1g.10gb need 8 compute slices but NVIDIA "
     "A100-80GB has 7"),
    ("A100-80GB", {"1g.10gb+me": 1, "1g.10gb": 7}, "1 x 1g.10gb+me + 7 x 1g.10gb need 8 compute slices but "
     "NVIDIA A100-80GB has 7"),
    ("H100-80GB", {"3g.40gb": 2, "1g.20gb": 1},
     "2 x 3g.40gb (4 each) + 1 x 1g.20gb (2 each) need 10 memory slices but NVIDIA H100-80GB has 8"),
    ("H100-80GB", {"7g.80gb": 1, "1g.10gb": 1},
     "1 x 7g.80gb (8 each) + 1 x 1g.10gb (1 each) need 9 memory slices but NVIDIA H100-80GB has 8"),
    ("H100-80GB", {"2g.20gb": 2, "1g.10gb": 4}, "2 x 2g.20gb + 4 x 1g.10gb need 8 compute slices but NVIDIA "
     "H100-80GB has 7"),
    ("H100-80GB", {"1g.10gb+me": 2}, "2 x 1g.10gb+me asked but NVIDIA H100-80GB holds at most 1 of them"),
    ("H200-141GB", {"3g.71gb": 1, "4g.71gb": 1, "1g.18gb": 1},
     "1 x 3g.71gb (4 each) + 1 x 4g.71gb (4 each) + 1 x 1g.18gb (1 each) need 9 memory slices but NVIDIA "
     "H200-141GB has 8"),
    ("H200-141GB", {"1g.35gb": 4, "1g.18gb": 1},
     "4 x 1g.35gb (2 each) + 1 x 1g.18gb (1 each) need 9 memory slices but NVIDIA H200-141GB has 8"),
    ("H200-141GB", {"2g.35gb": 3, "1g.18gb": 2}, "3 x 2g.35gb + 2 x 1g.18gb need 8 compute slices but NVIDIA "
     "H200-141GB has 7"),
    ("H200-141GB", {"1g.18gb": 8}, "8 x 1g.18gb asked but NVIDIA H200-141GB holds at most 7 of them"),
    ("A30-24GB", {"2g.12gb": 2, "1g.6gb": 1},
     "2 x 2g.12gb (2 each) + 1 x 1g.6gb (1 each) need 5 memory slices but NVIDIA A30-24GB has 4"),
    ("A30-24GB", {"4g.24gb": 1, "1g.6gb": 1},
     "1 x 4g.24gb (4 each) + 1 x 1g.6gb (1 each) need 5 memory slices but NVIDIA A30-24GB has 4"),
    ("A30-24GB", {"2g.12gb+me": 1, "1g.6gb+me": 1},
     "1 x 2g.12gb+me + 1 x 1g.6gb+me asked but a GPU holds one media-extension (+me) instance at most"),
    ("A30-24GB", {"1g.6gb": 5}, "5 x 1g.6gb asked but NVIDIA A30-24GB holds at most 4 of them"),
]


@pytest.mark.parametrize(("key", "counts", "reason"), NON_FIT, ids=[f"{k}-{'+'.join(c)}" for k, c, _ in NON_FIT])
def test_non_fitting_mixed_layouts_give_the_reason(key: str, counts: dict[str, int], reason: str) -> None:
    """On an empty GPU and on one whose current instances could partly stay: the same one-sentence reason."""
    with pytest.raises(NoFit) as e:
        find_layout(make_gpu(key), counts)
    assert e.value.reason == reason
    busy = make_gpu(key, layout=((next(p.name for p in PRODUCTS[key].profiles if p.placement_size == 1), 0),))
    with pytest.raises(NoFit) as e2:
        find_layout(busy, counts, busy.mig_devices)
    assert e2.value.reason == reason


FIT: dict[str, list[dict[str, int]]] = {
    "A100-40GB": [{"3g.20gb": 1, "2g.10gb": 1, "1g.10gb": 1}, {"4g.20gb": 1, "1g.5gb+me": 1, "1g.5gb": 2},
                  {"1g.10gb": 3, "1g.5gb": 1}],
    "A100-80GB": [{"3g.40gb": 1, "1g.20gb": 2}, {"2g.20gb": 2, "1g.10gb+me": 1, "1g.10gb": 2}],
    "H100-80GB": [{"4g.40gb": 1, "1g.20gb": 1, "1g.10gb": 1}, {"3g.40gb": 2}],
    "H200-141GB": [{"4g.71gb": 1, "2g.35gb": 1, "1g.18gb+me": 1}, {"1g.35gb": 2, "1g.18gb": 3}],
    "A30-24GB": [{"2g.12gb+me": 1, "1g.6gb": 2}, {"2g.12gb": 1, "1g.6gb+me": 1, "1g.6gb": 1}],
}


@pytest.mark.parametrize("key", sorted(FIT))
def test_fitting_mixed_layouts_on_every_table(key: str) -> None:
    for counts in FIT[key]:
        gpu = make_gpu(key)
        lay = find_layout(gpu, counts)
        slots = [(s.profile, s.start) for s in lay.create]
        assert occupied_ok(gpu, slots), (key, counts, slots)
        assert sorted(p for p, _ in slots) == sorted(p for p, n in counts.items() for _ in range(n))


def test_mixed_node_plan_touches_only_gpus_that_differ_and_non_fit_names_entry_and_gpu() -> None:
    """One node with every documented table: GPUs already in their target layout get no step at all."""
    g0 = make_gpu("A100-40GB", 0, (("3g.20gb", 0), ("3g.20gb", 4)))  # already as wanted
    g1 = make_gpu("A100-80GB", 1)  # MIG off: must be enabled and filled
    g2 = make_gpu("H100-80GB", 2, (("3g.40gb", 0), ("3g.40gb", 4)))  # already as wanted
    g3 = make_gpu("H200-141GB", 3, (("7g.141gb", 0),))  # must be reshaped
    g4 = make_gpu("A30-24GB", 4, (("2g.12gb", 0), ("2g.12gb", 2)))  # already as wanted
    inv = Inventory("550.54.15", 12040, (g0, g1, g2, g3, g4))
    text = """version: v1
mig-configs:
  halves:
    - {devices: [0], mig-enabled: true, mig-devices: {3g.20gb: 2}}
    - {devices: [1, 2], mig-enabled: true, mig-devices: {3g.40gb: 2}}
    - {devices: [3], mig-enabled: true, mig-devices: {3g.71gb: 2}}
    - {devices: [4], mig-enabled: true, mig-devices: {2g.12gb: 2}}
  too-much:
    - {devices: [0, 1, 2, 4], mig-enabled: false}
    - {devices: [3], mig-enabled: true, mig-devices: {3g.71gb: 2, 1g.18gb: 1}}
"""
    cfg = parse_config(text, "node.yaml")
    name, entries = cfg.select("halves")
    pl = plan(inv, resolve(name, entries, inv, cfg.source))
    assert [g.index for g in pl.touched] == [1, 3]
    for g in pl.gpus:
        if g.index in (0, 2, 4):
            assert not g.changes and g.destroy == () and g.create == () and g.mode is None
            assert g.keep == inv.gpu(g.index).mig_devices
    assert pl.gpus[1].mode is True and [(s.profile, s.start) for s in pl.gpus[1].create] == [("3g.40gb", 0),
                                                                                             ("3g.40gb", 4)]
    assert [(d.profile, d.placement_start) for d in pl.gpus[3].destroy] == [("7g.141gb", 0)]
    assert pl.gpus[3].mode is None
    name, entries = cfg.select("too-much")
    with pytest.raises(ConfigError) as e:
        plan(inv, resolve(name, entries, inv, cfg.source))
    assert str(e.value) == ("node.yaml: config too-much entry 1: GPU 3: 2 x 3g.71gb (4 each) + 1 x 1g.18gb (1 each) "
                            "need 9 memory slices but NVIDIA H200-141GB has 8")
