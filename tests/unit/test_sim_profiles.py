"""The simulator against every MIG table row of nodeagent/gpu/FACTS.md: counts, memory, placements, profile ids."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml
import pytest

from nodeagent.gpu import profiles
from nodeagent.simulator import inject
from nodeagent.simulator.machine import load_machine
from nodeagent.simulator.nvml import SimulatedNvml
from nodeagent.simulator.state import SimStore

# Transcribed from nodeagent/gpu/FACTS.md: (product, profile, count, MiB, starts, size, SM, CE,
# decoders, JPEG, OFA). Memory is NVML's MiB figure (nvidia-smi -lgip GiB x 1024).
_EIGHT = {"1": (0, 1, 2, 3, 4, 5, 6), "1d": (0, 2, 4, 6), "2": (0, 2, 4), "3": (0, 4), "4": (0,), "7": (0,)}
Row = tuple[str, str, int, int, tuple[int, ...], int, int, int, int, int, int]
TABLE: list[Row] = []


def _eighths(product: str, names: tuple[str, ...], mems: tuple[int, ...], sm: tuple[int, ...],
             ce: tuple[int, ...], dec: tuple[int, ...], jpeg: tuple[int, ...]) -> list[Row]:
    one, double, two, three, four, seven = names
    return [
        (product, one, 7, mems[0], _EIGHT["1"], 1, sm[0], ce[0], dec[0], jpeg[0], 0),
        (product, one + "+me", 1, mems[0], _EIGHT["1"], 1, sm[0], ce[0], dec[1], jpeg[1], 1),
        (product, double, 4, mems[1], _EIGHT["1d"], 2, sm[1], ce[1], dec[2], jpeg[2], 0),
        (product, two, 3, mems[2], _EIGHT["2"], 2, sm[2], ce[2], dec[3], jpeg[3], 0),
        (product, three, 2, mems[3], _EIGHT["3"], 4, sm[3], ce[3], dec[4], jpeg[4], 0),
        (product, four, 1, mems[4], _EIGHT["4"], 4, sm[4], ce[4], dec[5], jpeg[5], 0),
        (product, seven, 1, mems[5], _EIGHT["7"], 8, sm[5], ce[5], dec[6], jpeg[6], 1),
    ]


_A_SM, _A_CE, _A_DEC, _A_JPEG = (14, 14, 28, 42, 56, 98), (1, 1, 2, 3, 4, 7), (0, 1, 1, 1, 2, 2, 5), (0, 1, 0, 0, 0, 0, 1)
_H_SM, _H_CE, _H_DEC = (16, 26, 32, 60, 64, 132), (1, 1, 2, 3, 4, 8), (1, 1, 1, 2, 3, 4, 7)
TABLE += _eighths("A100-40GB", ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
                  (4864, 9856, 9856, 19968, 19968, 40192), _A_SM, _A_CE, _A_DEC, _A_JPEG)
TABLE += _eighths("A100-80GB", ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
                  (9728, 19968, 19968, 40192, 40192, 80896), _A_SM, _A_CE, _A_DEC, _A_JPEG)
TABLE += _eighths("H100-80GB", ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
                  (9984, 20096, 20096, 40448, 40448, 81152), _H_SM, _H_CE, _H_DEC, _H_DEC)
TABLE += _eighths("H200-141GB", ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
                  (16384, 33024, 33024, 71168, 71168, 143104), _H_SM, _H_CE, _H_DEC, _H_DEC)
TABLE += _eighths("H100-NVL", ("1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"),
                  (11008, 22144, 22144, 47488, 47488, 95360), _H_SM, _H_CE, _H_DEC, _H_DEC)
TABLE += [
    ("A30-24GB", "1g.6gb", 4, 5952, (0, 1, 2, 3), 1, 14, 1, 1, 0, 0),
    ("A30-24GB", "1g.6gb+me", 1, 5952, (0, 1, 2, 3), 1, 14, 1, 1, 1, 1),
    ("A30-24GB", "2g.12gb", 2, 11968, (0, 2), 2, 28, 2, 2, 0, 0),
    ("A30-24GB", "2g.12gb+me", 1, 11968, (0, 2), 2, 28, 2, 2, 1, 1),
    ("A30-24GB", "4g.24gb", 1, 24064, (0,), 4, 56, 4, 4, 1, 1),
]
A100_IDS = {"1g.5gb": 19, "1g.5gb+me": 20, "1g.10gb": 15, "2g.10gb": 14, "3g.20gb": 9, "4g.20gb": 5, "7g.40gb": 0}
A30_IDS = {"1g.6gb": 14, "1g.6gb+me": 21, "2g.12gb": 5, "4g.24gb": 0}
MACHINE_FOR = {
    "A100-40GB": "dgx-a100-40gb",
    "A100-80GB": "dgx-a100-80gb",
    "H100-80GB": "dgx-h100",
    "H200-141GB": "hgx-h200",
    "A30-24GB": "a30x4",
    "H100-NVL": "h100-nvl",
    "H100-96GB": "gh200",
    "H20": "hgx-h20",
    "GH200-144GB": "gh200-144gb",
    "B200": "dgx-b200",
    "GB200": "gb200-nvl",
    "B300": "hgx-b300",
    "GB300": "gb300-nvl",
    "RTX-PRO-6000": "rtx-pro-6000",
}
PCI_IDS = {
    "A100-40GB": {0x20B010DE, 0x20B110DE, 0x20F110DE, 0x20F610DE},
    "A100-80GB": {0x20B210DE, 0x20B510DE, 0x20F310DE, 0x20F510DE},
    "H100-80GB": {0x233010DE, 0x233110DE, 0x232210DE, 0x232410DE},
    "H200-141GB": {0x233510DE, 0x233B10DE},
    "A30-24GB": {0x20B710DE},
    "H100-NVL": {0x232110DE, 0x233A10DE},
    "H100-96GB": {0x233D10DE, 0x234210DE},
    "H20": {0x232910DE},
    "GH200-144GB": {0x234810DE},
    "B200": {0x290110DE},
    "GB200": {0x294110DE},
    "B300": {0x318210DE},
    "GB300": {0x31C210DE},
    "RTX-PRO-6000": {0x2BB510DE},
}
# names nodeagent/gpu/FACTS.md gives for the products whose figures it does not list in full
NAMES = {
    "H100-96GB": ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"),
    "H20": ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"),
    "GH200-144GB": ("1g.18gb", "1g.18gb+me", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"),
    "B200": ("1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"),
    "GB200": ("1g.23gb", "1g.23gb+me", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb"),
    "B300": ("1g.34gb", "1g.34gb+me", "1g.67gb", "2g.67gb", "3g.135gb", "4g.135gb", "7g.269gb"),
    "GB300": ("1g.35gb", "1g.35gb+me", "1g.70gb", "2g.70gb", "3g.139gb", "4g.139gb", "7g.278gb"),
    "RTX-PRO-6000": ("1g.24gb", "1g.24gb+me", "1g.24gb+gfx", "1g.24gb-me", "1g.24gb+me.all", "2g.48gb",
                     "2g.48gb+gfx", "2g.48gb-me", "2g.48gb+me.all", "4g.96gb", "4g.96gb+gfx"),
}
SOURCED = {"GH200-144GB": {"1g.18gb": 17920, "1g.36gb": 36096}, "B200": {"1g.45gb": 45312}}


def _nvml(machine: str) -> SimulatedNvml:
    store = SimStore(load_machine(machine))
    inject.set_mig_mode(store, 0, True)
    nvml = SimulatedNvml(store)
    nvml.nvmlInit()
    return nvml


def _info(nvml: SimulatedNvml, name: str) -> tuple[Any, Any]:
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    for idx in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, idx)
        except pynvml.NVMLError_NotSupported:
            continue
        label = info.name.decode() if isinstance(info.name, bytes) else info.name
        if label == "MIG " + name:
            return h, info
    raise AssertionError(f"profile {name} not offered")


def test_profile_constants_match_pynvml() -> None:
    assert profiles.GI_PROFILE_1_SLICE == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE
    assert profiles.GI_PROFILE_1_SLICE_REV1 == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1
    assert profiles.GI_PROFILE_1_SLICE_REV2 == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2
    assert profiles.GI_PROFILE_2_SLICE_REV1 == pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1
    assert profiles.GI_PROFILE_7_SLICE == pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE
    assert profiles.GI_PROFILE_COUNT == pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
    assert profiles.CI_PROFILE_FOR_SLICES[7] == pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE
    assert profiles.CI_PROFILE_FOR_SLICES[3] == pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE


def test_table_is_complete() -> None:
    for key, product in profiles.PRODUCTS.items():
        rows = {r[1] for r in TABLE if r[0] == key} or set(NAMES[key])
        assert {p.name for p in product.profiles} == rows
        assert set(product.pci_device_ids) == PCI_IDS[key]
        for pci_id in PCI_IDS[key]:
            assert profiles.product_for_pci_device_id(pci_id) is product
    assert set(profiles.PRODUCTS) == set(MACHINE_FOR) == set(PCI_IDS)


def test_tables_against_reference_figures() -> None:
    """Every row nodeagent/gpu/FACTS.md gives in full: memory, instance count, placements, SM, CE, DEC, JPEG, OFA."""
    for key, name, count, mib, starts, size, sm, ce, dec, jpeg, ofa in TABLE:
        spec = profiles.PRODUCTS[key].spec(name)
        assert spec is not None, (key, name)
        p = spec.profile
        got = (p.instance_count, p.memory_mib, p.placement_starts, p.placement_size, spec.multiprocessors,
               spec.copy_engines, spec.decoders, spec.jpeg, spec.ofa)
        assert got == (count, mib, starts, size, sm, ce, dec, jpeg, ofa), (key, name)
        assert spec.measured
    for key, rows in SOURCED.items():
        for name, mib in rows.items():
            assert profiles.PRODUCTS[key].profile(name).memory_mib == mib  # type: ignore[union-attr]
    b200 = profiles.PRODUCTS["B200"].spec("1g.23gb")
    assert b200 is not None and (b200.multiprocessors, b200.copy_engines) == (18, 2)
    rtx = profiles.PRODUCTS["RTX-PRO-6000"]
    assert all(s.multiprocessors == 46 * s.profile.slice_count for s in rtx.specs)


def test_no_instance_is_larger_than_its_gpu() -> None:
    for key, product in profiles.PRODUCTS.items():
        machine = load_machine(MACHINE_FOR[key])
        gpu_mib = {g.memory_mib for g in machine.gpus if g.mig_product is product}
        assert gpu_mib == {product.total_memory_mib}, key
        for s in product.specs:
            assert s.profile.memory_mib * s.profile.instance_count <= product.total_memory_mib, (key, s.name)
            # and a full-slice instance's device memory (which may exceed its profile) still fits
            assert s.profile.memory_mib + 256 <= product.total_memory_mib


def test_memory_tolerance_by_driver_is_in_the_table() -> None:
    """B200 1g.23gb is 22.00 GiB on one driver release and 20.50 GiB on a later one; a figure within
    0.01 GiB of the driver's is accepted, another driver's is not."""
    b200 = profiles.PRODUCTS["B200"]
    assert b200.memory_mib("1g.23gb", "570.124.06") == 22528
    assert b200.memory_mib("1g.23gb", "575.57.08") == 20992
    assert b200.memory_matches("1g.23gb", 22528 + 10, "570.124.06")
    assert not b200.memory_matches("1g.23gb", 22528, "575.57.08")
    assert [s.profile.memory_mib for s in b200.specs_for_driver("575.57.08")][:2] == [20992, 20992]
    a100 = profiles.PRODUCTS["A100-80GB"]  # 1g.20gb exists on newer drivers only
    assert "1g.20gb" not in {s.name for s in a100.specs_for_driver("515.65.01")}
    assert "1g.20gb" in {s.name for s in a100.specs_for_driver("535.161.08")}


def test_rtx_pro_6000_variants_and_resource_names() -> None:
    rtx = profiles.PRODUCTS["RTX-PRO-6000"]
    assert (rtx.memory_slices, rtx.compute_slices) == (4, 4)
    want = {
        "1g.24gb": (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 14, 4),
        "1g.24gb+me": (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 21, 1),
        "1g.24gb+gfx": (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX, 47, 4),
        "1g.24gb+me.all": (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, 65, 1),
        "1g.24gb-me": (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, None, 4),
        "2g.48gb+gfx": (pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX, None, 2),
        "2g.48gb-me": (pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME, None, 2),
        "2g.48gb+me.all": (pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME, None, 1),
        "4g.96gb+gfx": (pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX, None, 1),
    }
    for name, (index, pid, count) in want.items():
        p = rtx.profile(name)
        assert p is not None and p.gi_profile_id == index and p.instance_count == count, name
        if pid is not None:
            assert p.id == pid
    assert profiles.resource_name("1g.24gb+gfx") == "nvidia.com/mig-1g.24gb.gfx"
    assert profiles.resource_name("1g.24gb+me.all") == "nvidia.com/mig-1g.24gb.me.all"
    assert profiles.resource_name("1g.24gb-me") == "nvidia.com/mig-1g.24gb-me"


def _all_rows() -> list[tuple[str, str]]:
    return [(k, s.name) for k, p in profiles.PRODUCTS.items() for s in p.specs_for_driver(
        load_machine(MACHINE_FOR[k]).driver_version)]


@pytest.mark.parametrize("product,name", _all_rows(), ids=[f"{k}:{n}" for k, n in _all_rows()])
def test_simulator_profile_row(product: str, name: str) -> None:
    """The simulator serves each row as NVML would: profile info, placements, capacity, ids."""
    machine = load_machine(MACHINE_FOR[product])
    spec = profiles.PRODUCTS[product].specs_for_driver(machine.driver_version)
    row = next(s for s in spec if s.name == name)
    nvml = _nvml(MACHINE_FOR[product])
    h, info = _info(nvml, name)
    prof = row.profile
    assert (info.instanceCount, info.memorySizeMB, info.sliceCount, info.id) == (
        prof.instance_count, prof.memory_mib, prof.slice_count, prof.id)
    assert (info.multiprocessorCount, info.copyEngineCount, info.decoderCount, info.jpegCount, info.ofaCount) == (
        row.multiprocessors, row.copy_engines, row.decoders, row.jpeg, row.ofa)
    if product == "A100-40GB":
        assert info.id == A100_IDS[name]
    if product == "A30-24GB" and name in A30_IDS:
        assert info.id == A30_IDS[name]
    starts, size = prof.placement_starts, prof.placement_size
    # possible placements (_v2): count query first, then the array
    n = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, None, ctypes.byref(n))
    assert n.value == len(starts)
    arr = (pynvml.c_nvmlGpuInstancePlacement_t * n.value)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, arr, ctypes.byref(n))
    assert [(p.start, p.size) for p in arr] == [(s, size) for s in starts]
    # an empty GPU takes exactly `count` of them, then reports no capacity and refuses more
    count = prof.instance_count
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, info.id) == count
    for _ in range(count):
        nvml.nvmlDeviceCreateGpuInstance(h, info.id)
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, info.id) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstance(h, info.id)
    # every instance sits on one of the listed placements, all distinct, with distinct ids
    gis = (pynvml.c_nvmlGpuInstance_t * 8)()
    c = ctypes.c_uint(8)
    nvml.nvmlDeviceGetGpuInstances(h, info.id, gis, ctypes.byref(c))
    infos = [nvml.nvmlGpuInstanceGetInfo(gis[i]) for i in range(c.value)]
    placed = sorted(i.placement.start for i in infos)
    assert c.value == count and len(set(placed)) == count and set(placed) <= set(starts)
    assert len({i.id for i in infos}) == count


def test_a100_nvidia_smi_ids() -> None:
    nvml = _nvml("dgx-a100-40gb")
    for name, pid in A100_IDS.items():
        assert _info(nvml, name)[1].id == pid


def _gi_layout(nvml: SimulatedNvml, h: Any) -> list[tuple[int, int]]:
    out = []
    for pid in (19, 15, 14, 9, 5, 0):
        gis = (pynvml.c_nvmlGpuInstance_t * 8)()
        c = ctypes.c_uint(8)
        nvml.nvmlDeviceGetGpuInstances(h, pid, gis, ctypes.byref(c))
        out += [(int(nvml.nvmlGpuInstanceGetInfo(gis[i]).placement.start),
                 int(nvml.nvmlGpuInstanceGetInfo(gis[i]).id)) for i in range(c.value)]
    return sorted(out)


def test_driver_chosen_ids_and_placements_as_in_the_user_guide() -> None:
    """A100-40GB: ``-cgi 9,19,14,19`` gives 3g at 4 (id 2), 1g at 0 (id 7), 2g at 2 (id 4), 1g at 1
    (id 8); seven 1g.5gb give ids 7,8,9,11,12,13,14 at starts 4,5,6,0,1,2,3."""
    nvml = _nvml("dgx-a100-40gb")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    for pid in (9, 19, 14, 19):
        nvml.nvmlDeviceCreateGpuInstance(h, pid)
    assert _gi_layout(nvml, h) == [(0, 7), (1, 8), (2, 4), (4, 2)]
    h1 = nvml.nvmlDeviceGetHandleByIndex(1)
    inject.set_mig_mode(nvml.store, 1, True)
    for _ in range(7):
        nvml.nvmlDeviceCreateGpuInstance(h1, 19)
    assert _gi_layout(nvml, h1) == [(0, 11), (1, 12), (2, 13), (3, 14), (4, 7), (5, 8), (6, 9)]
