"""The VFIO device plugin judged by the kubelet's own device manager (the Go harness): after the workload
switch binds the simulated L40S GPUs (and their audio functions) to vfio-pci, the resource named by the
PCI ID rule is registered with the GPUs' bus ids, and Allocate answers as NVIDIA's sandbox plugin does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from nodeagent.deviceplugin.vfio import VfioDevicePlugin
from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import adapter_for_sim, pci_kernel
from nodeagent.simulator.open import open_sim
from nodeagent.vfio.switch import VfioSwitch
from nodeagent.vfio.sysfs import PciSysfs
from tests.peers.harness import HarnessError, KubeletHarness

pytestmark = pytest.mark.peers

RESOURCE = "nvidia.com/AD102GL_L40S"
ENV = "PCI_RESOURCE_NVIDIA_COM_AD102GL_L40S"


async def test_vfio_resource_and_allocate(kubelet_harness: KubeletHarness, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    paths = HostPaths(root)
    switch = VfioSwitch(paths, adapter_for_sim(open_sim("l40s-x4"), paths),
                        PciSysfs(paths, after_write=pci_kernel(paths, "l40s-x4", None)))
    assert switch.resources() == {}  # on the nvidia driver: nothing for VMs
    await asyncio.to_thread(switch.apply, "vm-passthrough")
    resources = switch.resources()
    assert {k: sorted(v) for k, v in resources.items()} == {
        RESOURCE: ["0000:17:00.0", "0000:3d:00.0", "0000:97:00.0", "0000:bd:00.0"]}
    plugin = VfioDevicePlugin(kubelet_harness.plugin_dir)
    try:
        await plugin.serve(resources)
        _, seen = await asyncio.to_thread(kubelet_harness.wait, RESOURCE, total=4, healthy=4)
        assert sorted(d.id for d in seen.devices) == sorted(resources[RESOURCE])
        assert {d.numa for d in seen.devices} == {(0,), (1,)}
        a = await asyncio.to_thread(kubelet_harness.allocate, RESOURCE, 2, pod="vm-a")
        assert len(a.device_ids) == 2
        assert list(a.envs) == [ENV]  # the bus ids in the order the kubelet asked for them
        assert sorted(a.envs[ENV].split(",")) == sorted(a.device_ids)
        groups = sorted(f"/dev/vfio/{resources[RESOURCE][b].iommu_group}" for b in a.device_ids)
        paths_given = [d["container_path"] for d in a.devices]
        assert sorted(paths_given) == sorted(["/dev/vfio/vfio", *groups])
        assert all(d["host_path"] == d["container_path"] and d["permissions"] == "rw" for d in a.devices)
        with pytest.raises(HarnessError):  # only 2 left
            await asyncio.to_thread(kubelet_harness.allocate, RESOURCE, 3, pod="vm-b")
    finally:
        await plugin.stop()
    await asyncio.to_thread(switch.apply, "container")
    assert switch.resources() == {}
