"""The simulator against every MIG table row of REFERENCE §3: counts, memory, placements, profile ids."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml
import pytest

from nodeagent.gpu import profiles
from nodeagent.gpu.sim import SimStore, SimulatedNvml, inject, load_machine

# (product, profile, count, memory MiB, placement starts, size) — transcribed from REFERENCE §3
_EIGHT = {"1": (0, 1, 2, 3, 4, 5, 6), "1d": (0, 2, 4, 6), "2": (0, 2, 4), "3": (0, 4), "4": (0,), "7": (0,)}
TABLE: list[tuple[str, str, int, int, tuple[int, ...], int]] = []
for product, names, mems in (
    ("A100-40GB", ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"), (4864, 9856, 9856, 19968, 19968, 40192)),
    ("A100-80GB", ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"), (9856, 19968, 19968, 40192, 40192, 80384)),
    ("H100-80GB", ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"), (9856, 19968, 19968, 40192, 40192, 80384)),
    ("H200-141GB", ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"), (18432, 35840, 35840, 72704, 72704, 144384)),
):
    one, double, two, three, four, seven = names
    TABLE += [
        (product, one, 7, mems[0], _EIGHT["1"], 1),
        (product, one + "+me", 1, mems[0], _EIGHT["1"], 1),
        (product, double, 4, mems[1], _EIGHT["1d"], 2),
        (product, two, 3, mems[2], _EIGHT["2"], 2),
        (product, three, 2, mems[3], _EIGHT["3"], 4),
        (product, four, 1, mems[4], _EIGHT["4"], 4),
        (product, seven, 1, mems[5], _EIGHT["7"], 8),
    ]
TABLE += [
    ("A30-24GB", "1g.6gb", 4, 5836, (0, 1, 2, 3), 1),
    ("A30-24GB", "1g.6gb+me", 1, 5836, (0, 1, 2, 3), 1),
    ("A30-24GB", "2g.12gb", 2, 11672, (0, 2), 2),
    ("A30-24GB", "2g.12gb+me", 1, 11672, (0, 2), 2),
    ("A30-24GB", "4g.24gb", 1, 23344, (0,), 4),
]
A100_IDS = {"1g.5gb": 19, "1g.5gb+me": 20, "1g.10gb": 15, "2g.10gb": 14, "3g.20gb": 9, "4g.20gb": 5, "7g.40gb": 0}
MACHINE_FOR = {
    "A100-40GB": "dgx-a100-40gb",
    "A100-80GB": "dgx-a100-80gb",
    "H100-80GB": "dgx-h100",
    "H200-141GB": "hgx-h200",
    "A30-24GB": "a30x4",
}
PCI_IDS = {
    "A100-40GB": {0x20B010DE, 0x20B110DE, 0x20F110DE, 0x20F610DE},
    "A100-80GB": {0x20B210DE, 0x20B510DE, 0x20F310DE, 0x20F510DE},
    "H100-80GB": {0x233010DE, 0x233110DE, 0x232210DE, 0x232410DE},
    "H200-141GB": {0x233510DE, 0x233B10DE},
    "A30-24GB": {0x20B710DE},
}


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
        rows = {r[1] for r in TABLE if r[0] == key}
        assert {p.name for p in product.profiles} == rows
        assert set(product.pci_device_ids) == PCI_IDS[key]
        for pci_id in PCI_IDS[key]:
            assert profiles.product_for_pci_device_id(pci_id) is product


@pytest.mark.parametrize("product,name,count,mib,starts,size", TABLE, ids=[f"{r[0]}:{r[1]}" for r in TABLE])
def test_simulator_profile_row(product: str, name: str, count: int, mib: int, starts: tuple[int, ...], size: int) -> None:
    nvml = _nvml(MACHINE_FOR[product])
    h, info = _info(nvml, name)
    assert info.instanceCount == count
    assert info.memorySizeMB == mib
    assert info.sliceCount == int(name[0])
    if product == "A100-40GB":
        assert info.id == A100_IDS[name]
    # possible placements (_v2): count query first, then the array
    n = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, None, ctypes.byref(n))
    assert n.value == len(starts)
    arr = (pynvml.c_nvmlGpuInstancePlacement_t * n.value)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, arr, ctypes.byref(n))
    assert [(p.start, p.size) for p in arr] == [(s, size) for s in starts]
    # an empty GPU takes exactly `count` of them, then reports no capacity and refuses more
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, info.id) == count
    for _ in range(count):
        nvml.nvmlDeviceCreateGpuInstance(h, info.id)
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, info.id) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstance(h, info.id)
    # every instance sits on one of the listed placements, all distinct
    gis = (pynvml.c_nvmlGpuInstance_t * 8)()
    c = ctypes.c_uint(8)
    nvml.nvmlDeviceGetGpuInstances(h, info.id, gis, ctypes.byref(c))
    placed = sorted(nvml.nvmlGpuInstanceGetInfo(gis[i]).placement.start for i in range(c.value))
    assert c.value == count and len(set(placed)) == count and set(placed) <= set(starts)


def test_a100_nvidia_smi_ids() -> None:
    nvml = _nvml("dgx-a100-40gb")
    for name, pid in A100_IDS.items():
        assert _info(nvml, name)[1].id == pid
