"""The real NvmlAdapter running on the simulator: discovery, MIG changes, errors, events, metrics."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from nodeagent.errors import GpuBusyError, GpuLostError, InputError, InsufficientResourcesError, NvmlError
from nodeagent.gpu.inventory import LinkKind
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import open_nvml
from nodeagent.simulator import inject
from nodeagent.simulator.machine import machine_names


@pytest.fixture
def h100(tmp_path: Path) -> NvmlAdapter:
    return open_nvml("dgx-h100", tmp_path / "state.json", HostPaths(tmp_path))


@pytest.mark.parametrize("machine", machine_names())
def test_discover_every_machine(machine: str, tmp_path: Path) -> None:
    with open_nvml(machine, None, HostPaths(tmp_path)) as nvml:
        inv = nvml.discover()
    assert inv.gpus and inv.driver_version and inv.cuda_driver_version >= 11000
    n = len(inv.gpus)
    assert len(inv.links) == n * (n - 1) // 2
    for g in inv.gpus:
        assert g.uuid.startswith("GPU-") and len(g.pci_bus_id) == 16 and g.pci_bus_id[8] == ":"
        assert g.pci_device_id & 0xFFFF == 0x10DE and g.memory_mib > 10000
        assert g.architecture in ("turing", "ampere", "ada", "hopper", "blackwell")
        assert g.mig_capable == bool(g.mig_profiles)


def test_discover_dgx_h100(h100: NvmlAdapter) -> None:
    inv = h100.discover()
    assert len(inv.gpus) == 8 and inv.cuda_version == (12, 4)
    g = inv.gpu(4)
    assert (g.name, g.pci_device_id_str, g.numa_node, g.compute_major, g.compute_minor) == (
        "NVIDIA H100 80GB HBM3", "0x233010DE", 1, 9, 0,
    )  # fmt: skip
    assert g.mig_capable and not g.mig_current and [p.name for p in g.mig_profiles] == [
        "1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1g.10gb+me", "1g.20gb",
    ]  # fmt: skip
    assert g.profile("3g.40gb").placement_starts == (0, 4)  # type: ignore[union-attr]
    assert all(link.kind is LinkKind.NVLINK and link.nvlinks == 18 for link in inv.links)


def test_numa_from_sysfs_under_root(tmp_path: Path) -> None:
    dev = tmp_path / "sys/bus/pci/devices/0000:18:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("6\n")
    inv = open_nvml("dgx-h100", None, HostPaths(tmp_path)).discover()
    assert inv.gpu(0).numa_node == 6 and inv.gpu(1).numa_node == 0


def test_pcie_topology_kinds() -> None:
    inv = open_nvml("mixed", None).discover()
    assert inv.link(0, 1).nvlinks == 12  # type: ignore[union-attr]
    assert inv.link(0, 2).kind is LinkKind.CROSS_CPU  # type: ignore[union-attr]
    assert inv.link(2, 3).kind is LinkKind.SAME_CPU  # type: ignore[union-attr]
    a30 = open_nvml("a30x4", None).discover()
    assert [(lk.a, lk.b) for lk in a30.links if lk.kind is LinkKind.NVLINK] == [(0, 1), (2, 3)]


def test_mig_lifecycle_hopper(h100: NvmlAdapter) -> None:
    assert h100.set_mig_mode(0, True) is False  # Hopper: immediate
    a = h100.create_mig_device(0, "3g.40gb", 0)
    b = h100.create_mig_device(0, "3g.40gb")
    # a MIG device's memory is its own figure, a little above its profile's 40448 MiB, by placement
    assert (a.placement_start, b.placement_start, a.memory_mib, b.memory_mib) == (0, 4, 40704, 40576)
    assert a.uuid.startswith("MIG-") and a.uuid != b.uuid
    with pytest.raises(InsufficientResourcesError, match="GPU 0"):
        h100.create_mig_device(0, "1g.10gb")
    with pytest.raises(InputError, match="not offered"):
        h100.create_mig_device(0, "1g.5gb")
    g = h100.discover().gpu(0)
    assert [(d.gi_id, d.profile, d.placement_start) for d in g.mig_devices] == [(1, "3g.40gb", 0), (2, "3g.40gb", 4)]
    h100.destroy_mig_device(0, a.gi_id)
    assert h100.remaining_capacity(0, "4g.40gb") == 1
    with pytest.raises(GpuBusyError, match="in use"):
        h100.set_mig_mode(0, False)  # instances remain
    h100.destroy_mig_device(0, b.gi_id)
    assert h100.set_mig_mode(0, False) is False


def test_idle_ampere_is_current_at_once(tmp_path: Path) -> None:
    nvml = open_nvml("dgx-a100-40gb", tmp_path / "s.json")
    assert nvml.set_mig_mode(3, True) is False  # bare metal: the driver resets the idle GPU itself
    assert nvml.mig_mode(3) == (True, True)


def test_ampere_pending_then_reset(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    nvml = open_nvml("dgx-a100-40gb", tmp_path / "s.json")
    inject.hold_device(nvml.nvml.store, 3, "nvidia-persistenced")
    assert nvml.set_mig_mode(3, True) is True  # status IN_USE: pending, not an error
    assert "switches at the next GPU reset or reboot" in caplog.text
    g = nvml.discover().gpu(3)
    assert (g.mig_current, g.mig_pending) == (False, True)
    nvml.reset_gpu(3)
    assert nvml.mig_mode(3) == (True, True)


def test_busy_gpu_errors_name_the_gpu(h100: NvmlAdapter) -> None:
    inject.inject_process(h100.nvml.store, 2, 31337, "trainer", used_mib=4096)
    assert h100.set_mig_mode(2, True) is True  # busy: the mode is pending until a reset or reboot
    assert h100.mig_mode(2) == (False, True)
    with pytest.raises(GpuBusyError, match=r"GPU 2"):
        h100.reset_gpu(2)
    assert h100.set_mig_mode(2, False) is False  # withdrawn: nothing pending any more
    assert h100.mig_mode(2) == (False, False)
    assert h100.processes(2)[0].name == "trainer"
    assert h100.processes(2)[0].used_memory_mib == 4096
    m = h100.metrics(2)
    assert m.utilisation_pct is not None and m.utilisation_pct >= 40 and m.memory_used_mib >= 4096 and m.power_w > 72 and m.temperature_c > 30
    idle = h100.metrics(1)
    assert idle.utilisation_pct == 0 and idle.memory_total_mib == 81559


def test_rollback_when_compute_instance_fails(h100: NvmlAdapter) -> None:
    h100.set_mig_mode(1, True)
    inject.fail_next(h100.nvml.store, "nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(NvmlError, match="nvmlGpuInstanceCreateComputeInstance"):
        h100.create_mig_device(1, "7g.80gb")
    g = h100.discover().gpu(1)
    assert g.mig_devices == () and g.bare_gpu_instances == ()  # the GI was removed again


def test_lost_gpu(h100: NvmlAdapter) -> None:
    before = h100.discover()
    assert h100.wait_events(0) == []  # the event set exists before the fault, as in the daemon
    inject.inject_lost(h100.nvml.store, 6)
    assert h100.gpu_healthy(6) is False and h100.gpu_healthy(5) is True
    with pytest.raises(GpuLostError, match="GPU 6"):
        h100.processes(6)
    inv = h100.discover()
    assert inv.gpu(6).lost and inv.gpu(6).uuid == before.gpu(6).uuid
    assert len(inv.links) == 21  # pairs among the 7 remaining GPUs
    events = h100.wait_events(1000)
    assert [(e.gpu_index, e.kind, e.xid) for e in events] == [(6, "xid", 79)]
    inject.recover(h100.nvml.store)
    assert h100.gpu_healthy(6)


def test_wait_events_times_out_empty(h100: NvmlAdapter) -> None:
    assert h100.wait_events(0) == []
    inject.inject_xid(h100.nvml.store, 0, 13)
    inject.inject_xid(h100.nvml.store, 7, 31)
    assert [(e.gpu_index, e.xid) for e in h100.wait_events(100)] == [(0, 13), (7, 31)]
    h100.close()
