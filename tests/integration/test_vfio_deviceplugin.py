"""The VFIO device plugin judged by the kubelet's own device manager (the Go harness): after the workload
switch binds the simulated L40S GPUs (and their audio functions) to vfio-pci, the resource named by the
PCI ID rule is registered with the GPUs' bus ids, and Allocate answers as NVIDIA's sandbox plugin does."""

from __future__ import annotations

import asyncio
import uuid
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
    sim = open_sim("l40s-x4")
    switch = VfioSwitch(paths, adapter_for_sim(sim, paths),
                        PciSysfs(paths, after_write=pci_kernel(paths, "l40s-x4", None, sim.store)))
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


async def test_gpu_resource_gives_way_and_the_return_waits_for_vm_pods(
        kubelet_harness: KubeletHarness, tmp_path: Path) -> None:
    """While the node is in vm-passthrough the kubelet has no ``nvidia.com/gpu`` left to allocate (NVML no
    longer lists the GPUs) and the VFIO resource served; a pod given VFIO devices holds their GPUs: the wait before the
    switch back finds it through the kubelet's PodResources (by the resource and bus ids, as for
    ``nvidia.com/gpu`` pods), names it and gives up untouched; once the pod is gone the wait ends."""
    from nodeagent.daemon.components.mig import GpuHolderSources
    from nodeagent.daemon.components.switches import vfio_device_ids
    from nodeagent.daemon.shared import Shared
    from nodeagent.deviceplugin.service import DevicePluginService
    from nodeagent.dra import DRIVER_NAME
    from nodeagent.errors import OperationError
    from nodeagent.kube.podresources import PodResourcesClient
    from nodeagent.labelswitch import wait_released

    root = tmp_path / "root"
    root.mkdir()
    paths = HostPaths(root)
    sim = open_sim("l40s-x4")
    adapter = adapter_for_sim(sim, paths)
    switch = VfioSwitch(paths, adapter, PciSysfs(paths, after_write=pci_kernel(paths, "l40s-x4", None, sim.store)))
    service = DevicePluginService(plugin_dir=kubelet_harness.plugin_dir)
    plugin = VfioDevicePlugin(kubelet_harness.plugin_dir)
    await service.start(adapter.discover())
    try:
        await asyncio.to_thread(kubelet_harness.wait, "nvidia.com/gpu", total=4, registered=True)
        await asyncio.to_thread(switch.apply, "vm-passthrough")
        await service.update(adapter.discover())  # the daemon's resync after the switch
        await plugin.serve(switch.resources())
        # the plugin of nvidia.com/gpu is gone: the kubelet keeps the name 5 minutes with nothing allocatable
        await asyncio.to_thread(kubelet_harness.wait, "nvidia.com/gpu", healthy=0)
        await asyncio.to_thread(kubelet_harness.wait, RESOURCE, total=4, healthy=4, registered=True)

        pod = await asyncio.to_thread(kubelet_harness.allocate, RESOURCE, 1, pod="virt-launcher-vm", namespace="vms",
                                      pod_uid=str(uuid.uuid4()))
        slot = switch.slots()[pod.device_ids[0]]
        holders = GpuHolderSources(
            PodResourcesClient(kubelet_harness.pod_resources_socket),
            lambda gpus: vfio_device_ids(switch.resources(), switch.slots(), gpus),
            Shared().dra, pool="node", driver=DRIVER_NAME, who="vfio")
        gpus = switch.gpus()
        assert gpus == frozenset(range(4))  # NVML sees none of them: the slots stand for the GPUs
        announced: list[str] = []

        async def announce(line: str) -> None:
            announced.append(line)

        with pytest.raises(OperationError, match=rf"GPU {slot} is held by pod vms/virt-launcher-vm after waiting"):
            await wait_released(holders, gpus, timeout_s=0.4, poll_s=0.05, what_waits="container",
                                announce=announce, subject="workload")
        assert announced == [f"container waits up to 0.4s: GPU {slot} is held by pod vms/virt-launcher-vm"]
        assert switch.current() == "vm-passthrough"

        await asyncio.to_thread(kubelet_harness.release, pod.pod_uid)
        await wait_released(holders, gpus, timeout_s=5, poll_s=0.05, what_waits="container",
                            announce=announce, subject="workload")
        await plugin.stop()
        await asyncio.to_thread(switch.apply, "container")
        await service.update(adapter.discover())
        await asyncio.to_thread(kubelet_harness.wait, "nvidia.com/gpu", total=4, registered=True)
    finally:
        await plugin.stop()
        await service.stop()
