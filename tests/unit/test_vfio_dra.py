"""The DRA plane's devices for GPUs on a VFIO driver (pure): one device ``gpu-<slot>-vfio`` per GPU with type
``vfio`` and the attributes a selector needs, its claim's CDI spec (the VFIO container device, the IOMMU group
devices, ``PCI_RESOURCE_…`` per resource, nothing of the nvidia driver), the device status, the GPU index
the name carries, and the device IDs the workload switch's wait looks for in PodResources."""

from __future__ import annotations

import pytest

from nodeagent.daemon.components.switches import vfio_device_ids
from nodeagent.dra.cdi import claim_spec
from nodeagent.dra.checkpoint import PreparedDevice
from nodeagent.dra.devices import build_vfio_devices, device_gpu_index
from nodeagent.dra.status import device_status
from nodeagent.vfio.allocate import VfioDevice

RES = "nvidia.com/GH100_H100_SXM5_80GB"
RESOURCES = {RES: {
    "0000:18:00.0": VfioDevice("0000:18:00.0", "20", None, 0),
    "0000:2a:00.0": VfioDevice("0000:2a:00.0", "21", None, 0),
    "0000:ab:00.0": VfioDevice("0000:ab:00.0", "23", None, 1),
}}
SLOTS = {"0000:18:00.0": 0, "0000:2a:00.0": 1, "0000:9a:00.0": 2, "0000:ab:00.0": 3}


def test_devices_one_per_gpu_by_slot_with_selector_attributes() -> None:
    devs = build_vfio_devices(RESOURCES, SLOTS, {RES: "GH100 [H100 SXM5 80GB]"})
    assert [d.name for d in devs] == ["gpu-0-vfio", "gpu-1-vfio", "gpu-3-vfio"]
    d = devs[2]
    assert (d.kind, d.gpu_index, d.uuid, d.vfio_resource) == ("vfio", 3, "", RES)
    assert d.attributes == {
        "type": {"string": "vfio"}, "index": {"int": 3}, "resourceName": {"string": RES},
        "iommuGroup": {"int": 23}, "resource.kubernetes.io/pciBusID": {"string": "0000:ab:00.0"},
        "productName": {"string": "GH100 [H100 SXM5 80GB]"}, "numaNode": {"int": 1},
        "resource.kubernetes.io/numaNode": {"int": 1},
    }
    assert d.capacity == {}
    assert [device_gpu_index(x.name) for x in devs] == [0, 1, 3]
    assert device_gpu_index("gpu-1-vfio-x") is None
    # a bus id without a slot (not an NVIDIA GPU of the tree) is left out
    assert build_vfio_devices({RES: {"0000:ff:00.0": VfioDevice("0000:ff:00.0", "9")}}, SLOTS) == []


def test_claim_spec_gives_vfio_nodes_and_pci_resource_only() -> None:
    devs = build_vfio_devices(RESOURCES, SLOTS)
    spec = claim_spec("uid-1", [devs[2], devs[0]])
    assert [d["name"] for d in spec["devices"]] == ["uid-1-gpu-3-vfio", "uid-1-gpu-0-vfio"]
    assert [d["containerEdits"]["deviceNodes"] for d in spec["devices"]] == [
        [{"path": "/dev/vfio/23"}], [{"path": "/dev/vfio/20"}]]
    assert spec["containerEdits"] == {
        "env": ["PCI_RESOURCE_NVIDIA_COM_GH100_H100_SXM5_80GB=0000:ab:00.0,0000:18:00.0"],
        "deviceNodes": [{"path": "/dev/vfio/vfio"}],
    }


def test_claim_spec_refuses_mixing_vfio_and_nvidia_gpus() -> None:
    from nodeagent.dra.devices import DraDevice

    vfio = build_vfio_devices(RESOURCES, SLOTS)[0]
    gpu = DraDevice(name="gpu-5", kind="gpu", gpu_index=5, minor=5, uuid="GPU-x")
    with pytest.raises(ValueError, match="VFIO driver and GPUs on the nvidia driver"):
        claim_spec("uid-2", [vfio, gpu])


def test_device_status_names_bus_and_group() -> None:
    devs = {d.name: d for d in build_vfio_devices(RESOURCES, SLOTS)}
    pd = PreparedDevice(("vm",), "node-a", "gpu-1-vfio", ("gpu.nodeagent.io/claim=u-gpu-1-vfio",))
    [entry] = device_status("gpu.nodeagent.io", [pd], devs)
    assert entry["data"] == {"pciBusID": "0000:2a:00.0", "iommuGroup": "21", "gpuIndex": 1}


def test_pod_resources_ids_of_vfio_devices() -> None:
    assert vfio_device_ids(RESOURCES, SLOTS, frozenset({1, 3})) == {
        (RES, "0000:2a:00.0"): 1, (RES, "0000:ab:00.0"): 3}
    assert vfio_device_ids(RESOURCES, SLOTS, frozenset()) == {}


def test_plane_config_splits_the_vfio_gpus_between_plugin_and_dra() -> None:
    from types import SimpleNamespace
    from typing import Any

    from nodeagent.daemon.components.switches import _vfio_to_dra

    def ctx(plane: str, gpus: tuple[int, ...] = (), kube: bool = True) -> Any:
        cfg = SimpleNamespace(device_plugin=SimpleNamespace(plane=plane), dra=SimpleNamespace(gpus=gpus))
        return SimpleNamespace(config=cfg, kube=object() if kube else None,
                               shared=SimpleNamespace(planes=SimpleNamespace(split=None)))

    assert _vfio_to_dra(ctx("dra"), SLOTS) == frozenset(SLOTS)
    assert _vfio_to_dra(ctx("device-plugin"), SLOTS) == frozenset()
    assert _vfio_to_dra(ctx("dra", kube=False), SLOTS) == frozenset()
    assert _vfio_to_dra(ctx("both", (1, 3)), SLOTS) == {"0000:2a:00.0", "0000:ab:00.0"}
