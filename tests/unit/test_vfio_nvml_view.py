"""What the simulated NVML shows of GPUs on vfio-pci: nothing, as the real NVML (it enumerates only the GPUs the
nvidia driver owns). A GPU the simulated kernel moved to vfio-pci is gone from the device count, from the
handles by index (the others close up, index order kept), by UUID and by PCI bus id, and comes back when the
kernel gives it to nvidia again; the record is shared through a state file with other processes."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import adapter_for_sim, pci_kernel
from nodeagent.simulator.nvml import SimulatedNvml
from nodeagent.simulator.open import open_sim
from nodeagent.vfio.plan import SysfsWrite
from nodeagent.vfio.sysfs import PciSysfs


def _move(sysfs: PciSysfs, bdf: str, to_vfio: bool) -> None:
    """The writes of NVIDIA's vfio-manager for one function (there and back)."""
    dev = f"/sys/bus/pci/devices/{bdf}"
    if to_vfio:
        for w in (SysfsWrite(f"{dev}/driver_override", "vfio-pci"), SysfsWrite("/sys/bus/pci/drivers/nvidia/unbind", bdf),
                  SysfsWrite("/sys/bus/pci/drivers/vfio-pci/bind", bdf)):
            sysfs.write(w)
    else:
        for w in (SysfsWrite(f"{dev}/driver_override", "\n"), SysfsWrite("/sys/bus/pci/drivers/vfio-pci/unbind", bdf),
                  SysfsWrite("/sys/bus/pci/drivers_probe", bdf)):
            sysfs.write(w)


def _ids(sim: SimulatedNvml) -> list[tuple[int, str, str]]:
    out = []
    for i in range(sim.nvmlDeviceGetCount()):
        h = sim.nvmlDeviceGetHandleByIndex(i)
        out.append((sim.nvmlDeviceGetIndex(h), sim.nvmlDeviceGetUUID(h), str(sim.nvmlDeviceGetPciInfo(h).busId)))
    return out


def _not_found(call: object) -> None:
    with pytest.raises(pynvml.NVMLError) as e:
        call()  # type: ignore[operator]
    assert e.value.value == pynvml.NVML_ERROR_NOT_FOUND


def test_gpu_on_vfio_is_invisible_to_nvml_and_comes_back(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    paths = HostPaths(root)
    sim = open_sim("l40s-x4")
    sim.nvmlInit()
    sysfs = PciSysfs(paths, after_write=pci_kernel(paths, "l40s-x4", None, sim.store))
    before = _ids(sim)
    assert [i for i, _, _ in before] == [0, 1, 2, 3]
    gone_uuid, gone_bus = before[1][1], before[1][2]
    bdf = gone_bus.lower()[4:]  # 00000000:xx:00.0 → 0000:xx:00.0

    kept = sim.nvmlDeviceGetHandleByIndex(1)  # a handle from before
    _move(sysfs, bdf, to_vfio=True)
    assert sysfs.function(bdf).driver == "vfio-pci"
    with pytest.raises(pynvml.NVMLError) as lost:
        sim.nvmlDeviceGetIndex(kept)
    assert lost.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    assert sim.nvmlDeviceGetCount() == 3
    after = _ids(sim)
    # the remaining GPUs close up: NVML index 1 is now the machine's third GPU
    assert after == [(0, before[0][1], before[0][2]), (1, before[2][1], before[2][2]), (2, before[3][1], before[3][2])]
    with pytest.raises(pynvml.NVMLError) as e:
        sim.nvmlDeviceGetHandleByIndex(3)
    assert e.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
    _not_found(lambda: sim.nvmlDeviceGetHandleByUUID(gone_uuid))
    _not_found(lambda: sim.nvmlDeviceGetHandleByPciBusId(gone_bus))
    _not_found(lambda: sim.nvmlDeviceGetHandleByPciBusId(gone_bus[4:]))  # the legacy short form too
    # the nodeagent adapter's discovery follows
    adapter = adapter_for_sim(sim, paths)
    assert [g.uuid for g in adapter.discover().gpus] == [u for _, u, _ in after]

    _move(sysfs, bdf, to_vfio=False)
    assert sysfs.function(bdf).driver == "nvidia"
    assert _ids(sim) == before
    assert sim.nvmlDeviceGetIndex(sim.nvmlDeviceGetHandleByUUID(gone_uuid)) == 1


def test_state_file_carries_the_drivers_to_other_processes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    paths = HostPaths(root)
    state = tmp_path / "sim.json"
    sysfs = PciSysfs(paths, after_write=pci_kernel(paths, "l40s-x4", state))  # its own store on the file
    other = open_sim(None, state)  # another process's view: the same file
    other.nvmlInit()
    assert other.nvmlDeviceGetCount() == 4
    for f in sysfs.functions():
        if f.is_gpu:
            _move(sysfs, f.bdf, to_vfio=True)
    assert other.nvmlDeviceGetCount() == 0
    # a kernel made again over the existing tree (an agent restart) keeps telling NVML what the tree shows
    fresh = open_sim("l40s-x4")
    fresh.nvmlInit()
    pci_kernel(paths, "l40s-x4", None, fresh.store)
    assert fresh.nvmlDeviceGetCount() == 0
