"""The DRA plane's VFIO devices on the real peers: after the workload switch binds the simulated L40S GPUs to
vfio-pci (NVML then sees none), the plane publishes one ``vfio`` device per GPU in the node's ResourceSlices,
the kubelet's own DRA code (tests/testbin/dra-harness) prepares a claim for one through nodeagent (a CDI
spec with /dev/vfio/vfio, the GPU's IOMMU group device and ``PCI_RESOURCE_…``), the claim is what holds
that GPU for the switch's wait, the ``vfio.gpu.nodeagent.io`` DeviceClass selects the devices, and back in
``container`` the devices are gone."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.component import DraComponent
from nodeagent.dra.devices import build_vfio_devices
from nodeagent.errors import KubeError
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient
from nodeagent.nvmlsource import adapter_for_sim, pci_kernel
from nodeagent.simulator.open import open_sim
from nodeagent.vfio.switch import VfioSwitch
from nodeagent.vfio.sysfs import PciSysfs
from tests.integration.test_dra_kubelet import CLAIMS, poll
from tests.peers.apiserver import KubeApiServer
from tests.peers.draharness import Pod, running_dra_harness

pytestmark = pytest.mark.peers

MANIFESTS = Path(__file__).resolve().parents[2] / "packaging" / "kubernetes"
RESOURCE = "nvidia.com/AD102GL_L40S"


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="vdra-", dir="/tmp"))  # socket paths must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def slice_devices(kube: KubeClient, node: str) -> dict[str, dict[str, Any]]:
    """The devices of the node's slices (none while the pool has no slice)."""
    items = kube.list_resource_slices(field_selector=f"spec.nodeName={node}") or []
    return {d["name"]: d for s in items for d in s["spec"].get("devices") or ()}


def vfio_claim(kube: KubeClient, node: str, device: str, pod: Pod) -> str:
    """A claim of the VFIO class allocated on ``node`` to ``device`` and reserved for ``pod`` (what the
    scheduler writes); its UID."""
    name = f"vm-{uuid.uuid4().hex[:8]}"
    created = kube.request("POST", CLAIMS, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "vfio.gpu.nodeagent.io"}}]}},
    })
    created["status"] = {
        "allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER_NAME, "pool": node,
                                                "device": device}]}},
        "reservedFor": [{"resource": "pods", "name": pod.name, "uid": pod.uid}],
    }
    kube.request("PUT", f"{CLAIMS}/{name}/status", body=created)
    pod.claims[name] = name
    pod.containers["compute"] = [name]
    return str(created["metadata"]["uid"])


async def test_vfio_devices_published_prepared_and_withdrawn(
        kube_apiserver: KubeApiServer, kube: KubeClient, node_name: str, root: Path) -> None:
    [cls] = [d for d in yaml.safe_load_all((MANIFESTS / "deviceclass.yaml").read_text())
             if d and d["metadata"]["name"] == "vfio.gpu.nodeagent.io"]
    try:
        kube.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", body=cls)
    except KubeError as e:
        assert e.status == 409, e  # another test of this API server applied the manifest already
    paths = HostPaths(root)
    sim = open_sim("l40s-x4")
    adapter = adapter_for_sim(sim, paths)
    switch = VfioSwitch(paths, adapter, PciSysfs(paths, after_write=pci_kernel(paths, "l40s-x4", None, sim.store)))
    await asyncio.to_thread(switch.apply, "vm-passthrough")
    inv = adapter.discover()
    assert inv.gpus == ()  # NVML no longer sees them
    slots = switch.slots()
    devices = build_vfio_devices(switch.resources(), slots, switch.product_names())
    dra = DraComponent(paths=paths, kube=kube, node_name=node_name, verify_interval_s=0.5)
    dra.vfio_devices = devices
    await dra.start(inv)
    try:
        with running_dra_harness(kube_apiserver.kubeconfig, root / "var/lib/kubelet/plugins_registry",
                                 node_name) as h:
            await asyncio.to_thread(h.wait_registered, DRIVER_NAME)
            published = await poll(lambda: (s := slice_devices(kube, node_name)) and len(s) == 4 and s)
            assert sorted(published) == ["gpu-0-vfio", "gpu-1-vfio", "gpu-2-vfio", "gpu-3-vfio"]
            attrs = published["gpu-1-vfio"]["attributes"]
            bdf = attrs["resource.kubernetes.io/pciBusID"]["string"]
            assert slots[bdf] == 1
            assert attrs["type"] == {"string": "vfio"} and attrs["resourceName"] == {"string": RESOURCE}
            assert attrs["productName"] == {"string": "AD102GL [L40S]"}
            group = str(attrs["iommuGroup"]["int"])
            assert (root / "dev/vfio" / group).exists()  # the simulated kernel's group device

            pod = Pod("default", "virt-launcher-vm", str(uuid.uuid4()), {}, {})
            uid = await asyncio.to_thread(vfio_claim, kube, node_name, "gpu-1-vfio", pod)
            cdi = await asyncio.to_thread(h.prepare, pod)
            assert list(cdi) == ["compute"] and cdi["compute"][0] == f"gpu.nodeagent.io/claim={uid}-gpu-1-vfio"
            # beside it only the claim's device metadata (KEP-5304), no other device
            assert all(c.startswith("gpu.nodeagent.io/metadata=") for c in cdi["compute"][1:]), cdi
            spec = json.loads((root / f"var/run/cdi/gpu.nodeagent.io-claim_{uid}.json").read_text())
            assert spec["devices"] == [{"name": f"{uid}-gpu-1-vfio",
                                        "containerEdits": {"deviceNodes": [{"path": f"/dev/vfio/{group}"}]}}]
            assert spec["containerEdits"] == {"env": [f"PCI_RESOURCE_NVIDIA_COM_AD102GL_L40S={bdf}"],
                                              "deviceNodes": [{"path": "/dev/vfio/vfio"}]}
            # the claim holds GPU slot 1 for the switch's wait (back to container must wait for it)
            held = dra.claims_on(switch.gpus())
            assert list(held) == [1] and [r.uid for r in held[1]] == [uid]

            await asyncio.to_thread(h.unprepare, pod)
            assert dra.claims_on(switch.gpus()) == {}
            # back in container: the plane withdraws the VFIO devices
            await asyncio.to_thread(switch.apply, "container")
            await dra.set_vfio(())
            await dra.on_inventory(adapter.discover())
            now = await poll(lambda: (s := slice_devices(kube, node_name)) and "gpu-0" in s and s)
            assert sorted(now) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    finally:
        await dra.stop()
