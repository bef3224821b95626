"""Simulator behaviour: error paths, MIG mode timing per architecture, reboot, shared state, faults."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

import pynvml
import pytest

from nodeagent.errors import InputError
from nodeagent.simulator import inject
from nodeagent.simulator.machine import load_machine, machine_names
from nodeagent.simulator.nvml import SimulatedNvml
from nodeagent.simulator.state import SimStore


def _sim(machine: str, path: Path | None = None) -> SimulatedNvml:
    nvml = SimulatedNvml(SimStore.open(machine, path))
    nvml.nvmlInit()
    return nvml


def _profile_id(nvml: SimulatedNvml, h: object, index: int) -> int:
    return int(nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index).id)


def test_machines_load() -> None:
    assert machine_names() == [
        "a10-x2", "a30x4", "dgx-a100-40gb", "dgx-a100-80gb", "dgx-b200", "dgx-h100", "gb200-nvl", "gb300-nvl",
        "gh200", "gh200-144gb", "h100-nvl", "hgx-b300", "hgx-h20", "hgx-h200", "l40-x2", "l40s-x4", "l4x2",
        "mixed", "rtx-pro-6000", "t4x1", "vm-a100-passthrough",
    ]  # fmt: skip
    for name in machine_names():
        m = load_machine(name)
        assert m.gpus and len({g.uuid for g in m.gpus}) == len(m.gpus)
        assert len({g.bus_id for g in m.gpus}) == len(m.gpus)
    with pytest.raises(InputError, match="unknown simulated machine"):
        load_machine("dgx-z900")


def test_uninitialised_and_unknown_functions() -> None:
    nvml = SimulatedNvml(SimStore.open("t4x1", None))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    assert nvml.NVML_ERROR_IN_USE == 19 and nvml.NVMLError is pynvml.NVMLError
    with pytest.raises(AttributeError, match="does not implement"):
        nvml.nvmlDeviceGetVbiosVersion  # noqa: B018


def test_non_mig_gpu_is_not_supported() -> None:
    nvml = _sim("l4x2")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMigMode(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceSetMigMode(h, 1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetNvLinkState(h, 0)


def test_create_needs_mig_enabled_and_overlap_is_insufficient_resources() -> None:
    nvml = _sim("dgx-h100")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    seven = 0  # the 7g.80gb profile id
    # MIG disabled: GPU-instance calls and profile info are NOT_SUPPORTED, no MIG devices, placements answer
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceCreateGpuInstance(h, seven)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, seven)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, seven, None, ctypes.byref(count))
    assert count.value == 1
    assert nvml.nvmlDeviceSetMigMode(h, 1) == pynvml.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    assert _profile_id(nvml, h, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE) == seven
    three = _profile_id(nvml, h, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    p = pynvml.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = 4, 4
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, three, ctypes.byref(p))
    assert nvml.nvmlGpuInstanceGetInfo(gi).id == 2
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, three, ctypes.byref(p))
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstance(h, seven)
    one = _profile_id(nvml, h, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, one) == 4
    p.start = 5  # inside the 3g instance
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, one, ctypes.byref(p))
    p.start = 7  # not a placement of 1g at all
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, one, ctypes.byref(p))
    # compute instance covering the GI, then a MIG device handle with a UUID
    info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert nvml.nvmlDeviceGetUUID(mig).startswith("MIG-")
    assert (nvml.nvmlDeviceGetGpuInstanceId(mig), nvml.nvmlDeviceGetComputeInstanceId(mig)) == (2, 0)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 1)
    # destroy order: GI with a CI is in use; processes block the CI destroy
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.nvmlGpuInstanceDestroy(gi)
    inject.inject_process(nvml.store, 0, 777, "train", gi_id=2)
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.nvmlComputeInstanceDestroy(ci)
    inject.kill_process(nvml.store, 0)
    nvml.nvmlComputeInstanceDestroy(ci)
    nvml.nvmlGpuInstanceDestroy(gi)
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, seven) == 1


def test_ampere_mode_pending_until_reset_hopper_immediate() -> None:
    a100 = _sim("dgx-a100-80gb")
    h = a100.nvmlDeviceGetHandleByIndex(0)
    assert a100.nvmlDeviceSetMigMode(h, 1) == 0  # idle, bare metal: the driver resets it, current at once
    assert a100.nvmlDeviceGetMigMode(h) == [1, 1]
    h1 = a100.nvmlDeviceGetHandleByIndex(1)
    inject.hold_device(a100.store, 1, "nvidia-persistenced")  # another client has the device open
    assert a100.nvmlDeviceSetMigMode(h1, 1) == pynvml.NVML_ERROR_IN_USE
    assert a100.nvmlDeviceGetMigMode(h1) == [0, 1]  # pending until a reset
    a100.simResetGpu(h1)
    assert a100.nvmlDeviceGetMigMode(h1) == [1, 1]
    h100 = _sim("dgx-h100")
    h2 = h100.nvmlDeviceGetHandleByIndex(0)
    h100.nvmlDeviceSetMigMode(h2, 1)
    assert h100.nvmlDeviceGetMigMode(h2) == [1, 1]
    h100.simResetGpu(h2)  # Hopper: MIG mode does not survive a reset
    assert h100.nvmlDeviceGetMigMode(h2) == [0, 0]


def test_processes_block_mode_change_and_reset() -> None:
    nvml = _sim("dgx-a100-40gb")
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    inject.inject_process(nvml.store, 1, 4242, "python3", used_mib=2048)
    assert nvml.nvmlDeviceSetMigMode(h, 1) == pynvml.NVML_ERROR_IN_USE
    assert nvml.nvmlDeviceGetMigMode(h) == [0, 1]  # the pending mode IS set; it waits for a reset/reboot
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.simResetGpu(h)
    procs = nvml.nvmlDeviceGetComputeRunningProcesses(h)
    assert [(p.pid, p.usedGpuMemory >> 20) for p in procs] == [(4242, 2048)]
    assert nvml.nvmlDeviceGetUtilizationRates(h).gpu >= 40
    assert nvml.nvmlDeviceGetMemoryInfo(h).used >> 20 >= 2048
    assert nvml.nvmlDeviceSetMigMode(h, 0) == pynvml.NVML_SUCCESS  # withdrawn while still pending
    assert nvml.nvmlDeviceGetMigMode(h) == [0, 0]


def test_reboot_drops_instances_applies_ampere_pending(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    nvml = _sim("a30x4", path)
    inject.write_mig_layout(nvml.store, 0, ["2g.12gb", "1g.6gb", "1g.6gb"])
    h1 = nvml.nvmlDeviceGetHandleByIndex(1)
    inject.inject_process(nvml.store, 1, 4242, "python3")
    assert nvml.nvmlDeviceSetMigMode(h1, 1) == pynvml.NVML_ERROR_IN_USE
    assert nvml.nvmlDeviceGetMigMode(h1) == [0, 1]
    inject.reboot(nvml.store)
    h0 = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(h0) == [1, 1]  # Ampere: MIG mode persists
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h0, 0)  # instances never survive
    assert nvml.nvmlDeviceGetMigMode(h1) == [1, 1]  # the pending mode took effect
    assert json.loads(path.read_text())["boot"] == 2


def test_lost_gpu_and_recovery(tmp_path: Path) -> None:
    nvml = _sim("dgx-h100", tmp_path / "s.json")
    h = nvml.nvmlDeviceGetHandleByIndex(5)
    inject.inject_lost(nvml.store, 5)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetUUID(h)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetMemoryInfo(h)
    nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(4))  # others unaffected
    inject.recover(nvml.store, 5)
    assert nvml.nvmlDeviceGetUUID(h).startswith("GPU-")


def test_fail_next_after_and_count(tmp_path: Path) -> None:
    nvml = _sim("dgx-h100", tmp_path / "s.json")
    inject.fail_next(nvml.store, "nvmlDeviceGetUUID", pynvml.NVML_ERROR_UNKNOWN, count=2, after=1)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceGetUUID(h)
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_Unknown):
            nvml.nvmlDeviceGetUUID(h)
    nvml.nvmlDeviceGetUUID(h)
    with pytest.raises(InputError, match="no function"):
        inject.fail_next(nvml.store, "nvmlNoSuchThing", 3)
    with pytest.raises(InputError, match="error code"):
        inject.fail_next(nvml.store, "nvmlDeviceGetUUID", 4711)


def test_events_reach_a_waiting_set_from_another_process(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    nvml = _sim("dgx-h100", path)
    es = nvml.nvmlEventSetCreate()
    for i in range(8):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlDeviceGetSupportedEventTypes(h), es)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(es, 0)
    # a separate process (the CLI) writes the fault into the shared file
    subprocess.run(
        [sys.executable, "-m", "nodeagent", "sim", "inject", "xid", "--sim-state", str(path), "--gpu", "3", "--code", "48"],
        check=True,
        capture_output=True,
    )
    start = time.monotonic()
    data = nvml.nvmlEventSetWait_v2(es, 5000)
    assert time.monotonic() - start < 5
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError and data.eventData == 48
    assert nvml.nvmlDeviceGetIndex(data.device) == 3
    nvml.nvmlEventSetFree(es)


def test_state_file_shared_between_stores(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    a = _sim("dgx-a100-40gb", path)
    b = _sim("dgx-a100-40gb", path)
    inject.write_mig_layout(a.store, 2, ["3g.20gb", "3g.20gb"])
    hb = b.nvmlDeviceGetHandleByIndex(2)
    assert b.nvmlDeviceGetMigMode(hb) == [1, 1]
    assert b.nvmlDeviceGetMaxMigDeviceCount(hb) == 7
    uuids = {b.nvmlDeviceGetUUID(b.nvmlDeviceGetMigDeviceHandleByIndex(hb, i)) for i in range(2)}
    assert len(uuids) == 2
    with pytest.raises(InputError, match="belongs to machine"):
        SimStore.open("dgx-h100", path)
    assert SimStore.open(None, path).machine.name == "dgx-a100-40gb"
    with pytest.raises(InputError, match="does not fit"):
        inject.write_mig_layout(a.store, 2, ["7g.40gb", "1g.5gb"])


def test_mig_device_handles_by_index_and_by_mig_uuid() -> None:
    """MIG off: no MIG device at any index (NOT_FOUND, as NVML); no MIG at all: NOT_SUPPORTED. A MIG UUID
    gives the MIG device's handle through nvmlDeviceGetHandleByUUID, as on hardware."""
    nvml = _sim("mixed")
    a100, l4 = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(2)
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(a100) == 0
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(a100, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(l4, 0)
    inject.write_mig_layout(nvml.store, 0, ["3g.40gb", "1g.10gb"])
    migs = [nvml.nvmlDeviceGetMigDeviceHandleByIndex(a100, i) for i in range(2)]
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(a100, 2)
    for mig in migs:
        by_uuid = nvml.nvmlDeviceGetHandleByUUID(nvml.nvmlDeviceGetUUID(mig))
        assert ctypes.cast(by_uuid, ctypes.c_void_p).value == ctypes.cast(mig, ctypes.c_void_p).value
        assert nvml.nvmlDeviceIsMigDeviceHandle(by_uuid).value == 1
    gpu_uuid = nvml.nvmlDeviceGetUUID(a100)
    assert nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(gpu_uuid.encode())) == 0
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID("MIG-00000000-0000-0000-0000-000000000000")
    gone = nvml.nvmlDeviceGetUUID(migs[1])
    inject.write_mig_layout(nvml.store, 0, [])
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID(gone)
