"""Taking a node's GPUs over from NVIDIA's DRA driver (``gpu.nvidia.com``) on the real kube-apiserver and
kube-scheduler (1.34.4).

A stand-in for NVIDIA's driver publishes three of the node's four GPUs in its own ResourceSlices (two by
UUID, one by PCI bus id only), and the scheduler allocates one of them to a pod's claim. nodeagent's DRA
component, fed by the conflict detection's reading of the API (``ForeignDraGpus``, as the daemon's adopt
component does it), publishes only the fourth GPU: no GPU is offered twice. The hand-over switches the GPU
Operator's DRA stack off on the node (``adopt.switch_off``: the DRA driver and its validator, not the
switches nodeagent does not replace); the stand-in then leaves (its slices deleted, as the kubelet deletes a
gone plugin's slices). nodeagent publishes the GPUs nobody holds; the GPU the running pod holds through its
``gpu.nvidia.com`` claim stays out until that pod has ended (the devices the kubelet's PodResources lists for
the node's pods are what the daemon asks; here the test hands them in). A new claim for three GPUs lands on
nodeagent's slices and never on the held GPU, the running claim keeps its allocation. ``adopt --release``
switches back exactly what the hand-over switched."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent import adopt
from nodeagent.adopt.detect import ForeignDraGpus, dra_conflicts, gpu_keys, read_kube_facts
from nodeagent.cdi import simhost
from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.component import DraComponent
from nodeagent.dra.devices import pci_bus_id
from nodeagent.errors import KubeError
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient, connect
from tests.integration._kube import wait_for
from tests.integration._releases import release_binary
from tests.peers.apiserver import KubeApiServer
from tests.unit._dp_inventories import mig_box

pytestmark = pytest.mark.peers

NVIDIA = "gpu.nvidia.com"
NS = "default"
RESOURCE = "/apis/resource.k8s.io/v1"
CLAIMS = f"{RESOURCE}/namespaces/{NS}/resourceclaims"
PODS = f"/api/v1/namespaces/{NS}/pods"
MANIFESTS = Path(__file__).resolve().parents[2] / "packaging/kubernetes"
INVENTORY = mig_box(gpus_on=0, gpus_off=4)
OPERATOR_LABELS = {f"nvidia.com/gpu.deploy.{op}": "true" for op in (
    "driver", "dra-driver", "dra-validator", "dcgm-dra", "dcgm-exporter-dra", "kata-sandbox-device-plugin",
    "client")}


@pytest.fixture(scope="module")
def scheduler(kube_apiserver: KubeApiServer) -> Iterator[subprocess.Popen[bytes]]:
    binary = release_binary(kube_apiserver.version, "kube-scheduler")
    log = (kube_apiserver.workdir / "kube-scheduler-handover.log").open("wb")
    proc = subprocess.Popen([str(binary), f"--kubeconfig={kube_apiserver.kubeconfig}", "--leader-elect=false",
                             "--secure-port=0", "--v=2"], stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _create(kube: KubeClient, path: str, body: dict[str, Any]) -> None:
    try:
        kube.request("POST", path, body=body)
    except KubeError as e:
        if e.status != 409:  # a class another module made already
            raise


def _node(kube: KubeClient, name: str) -> None:
    kube.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": name, "labels": {"kubernetes.io/hostname": name, **OPERATOR_LABELS}}})
    status = {"capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
              "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
              "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                              "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                              "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    kube.request("PATCH", f"/api/v1/nodes/{name}/status", body={"status": status},
                 content_type="application/merge-patch+json")
    node = kube.request("GET", f"/api/v1/nodes/{name}")
    if node["spec"].get("taints"):  # the not-ready taint of admission: no lifecycle controller lifts it here
        node["spec"].pop("taints")
        kube.request("PUT", f"/api/v1/nodes/{name}", body=node)


def _stand_in_slice(node: str) -> dict[str, Any]:
    """NVIDIA's driver as it publishes GPUs 0 and 1 (uuid, PCI bus id) and GPU 2 (PCI bus id alone)."""
    devices = []
    for g in INVENTORY.gpus[:3]:
        attrs: dict[str, Any] = {"type": {"string": "gpu"}, "productName": {"string": g.name},
                                 "resource.kubernetes.io/pciBusID": {"string": pci_bus_id(g.pci_bus_id)}}
        if g.index < 2:
            attrs["uuid"] = {"string": g.uuid}
        devices.append({"name": f"gpu-{g.index}", "attributes": attrs})
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{NVIDIA}"},
            "spec": {"driver": NVIDIA, "nodeName": node, "pool": {"name": node, "generation": 1,
                                                                   "resourceSliceCount": 1},
                     "devices": devices}}


def _pod_with_claim(kube: KubeClient, name: str, device_class: str, count: int = 1) -> None:
    kube.request("POST", CLAIMS, body={"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                       "metadata": {"name": name}, "spec": {"devices": {"requests": [
                                           {"name": "gpu", "exactly": {"deviceClassName": device_class,
                                                                       "allocationMode": "ExactCount",
                                                                       "count": count}}]}}})
    kube.request("POST", PODS, body={"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                        "resources": {"claims": [{"name": "gpu"}]}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimName": name}], "terminationGracePeriodSeconds": 0}})


def _results(kube: KubeClient, claim: str) -> list[tuple[str, str, str]] | None:
    alloc = (kube.request("GET", f"{CLAIMS}/{claim}").get("status") or {}).get("allocation")
    if not alloc:
        return None
    return sorted((r["driver"], r["pool"], r["device"]) for r in alloc["devices"]["results"])


def _our_devices(kube: KubeClient, node: str) -> list[str]:
    items = kube.list_resource_slices(field_selector=f"spec.nodeName={node}")
    return sorted(d["name"] for s in items if s["spec"]["driver"] == DRIVER_NAME for d in s["spec"]["devices"])


def test_no_gpu_is_offered_twice_and_the_hand_over_keeps_the_running_claim(
        kube_apiserver: KubeApiServer, kube: KubeClient, scheduler: subprocess.Popen[bytes]) -> None:
    started = time.monotonic()
    node = f"handover-{uuid.uuid4().hex[:6]}"
    for doc in yaml.safe_load_all((MANIFESTS / "deviceclass.yaml").read_text()):
        if doc:
            _create(kube, f"{RESOURCE}/deviceclasses", doc)
    _create(kube, f"{RESOURCE}/deviceclasses", {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                               "metadata": {"name": NVIDIA}, "spec": {"selectors": [
                                                   {"cel": {"expression": f"device.driver == '{NVIDIA}'"}}]}})
    _node(kube, node)
    kube.request("POST", f"{RESOURCE}/resourceslices", body=_stand_in_slice(node))
    root = Path(tempfile.mkdtemp(prefix="dra-ho-", dir="/tmp"))
    agent = KubeClient(connect(kube_apiserver.kubeconfig))
    dra = DraComponent(paths=HostPaths(root), kube=agent, node_name=node, verify_interval_s=0.5)
    foreign = ForeignDraGpus()
    keys = gpu_keys(INVENTORY)
    held: set[tuple[str, str, str]] = set()  # what PodResources would list for the node's pods

    async def detect() -> frozenset[int]:
        facts = await asyncio.to_thread(read_kube_facts, agent, node)
        assert facts.slices is not None, facts.unread
        gpus = foreign.update(facts.slices, DRIVER_NAME, keys, held)
        await dra.set_foreign(gpus)
        await dra.wait_published(20)
        return gpus

    async def scenario() -> None:
        try:
            await handed_over()
        finally:
            await dra.stop()

    async def handed_over() -> None:
        simhost.materialise(HostPaths(root), INVENTORY)
        assert await detect() == frozenset({0, 1, 2})  # before the first publish, as the daemon orders it
        await dra.start(INVENTORY)
        await dra.wait_published(20)
        # the other driver's GPUs (by UUID, and GPU 2 by its PCI bus id alone) are not offered again
        assert _our_devices(kube, node) == ["gpu-3"]
        facts = await asyncio.to_thread(read_kube_facts, agent, node)
        [conflict] = dra_conflicts(facts.slices or (), DRIVER_NAME, (), keys)
        assert conflict.owner == NVIDIA and "leaves GPU(s) 0,1,2 out of its ResourceSlices" in conflict.detail

        # a pod's claim is allocated on the other driver's device
        _pod_with_claim(kube, "on-nvidia", NVIDIA)
        running = await asyncio.to_thread(wait_for, lambda: _results(kube, "on-nvidia"), 30)
        [(driver, pool, device)] = running
        assert (driver, pool) == (NVIDIA, node)
        held.add((driver, pool, device))
        gpu = int(device.removeprefix("gpu-"))

        # the hand-over: the operator's DRA driver and its validator are switched off on this node, nothing
        # nodeagent does not replace; then the driver is gone and with it its slices
        switched = await asyncio.to_thread(adopt.switch_off, agent, node)
        labels = kube.request("GET", f"/api/v1/nodes/{node}")["metadata"]["labels"]
        assert {op for op in switched if op.startswith("dra")} == {"dra-driver", "dra-validator"}
        for op in ("dcgm-dra", "dcgm-exporter-dra", "kata-sandbox-device-plugin", "client", "driver"):
            assert labels[f"nvidia.com/gpu.deploy.{op}"] == "true", op
        assert labels["nvidia.com/gpu.deploy.dra-driver"] == "false"
        kube.request("DELETE", f"{RESOURCE}/resourceslices/{node}-{NVIDIA}")

        # nodeagent offers every GPU but the one the running claim holds
        assert await detect() == frozenset({gpu})
        free = sorted(f"gpu-{i}" for i in range(4) if i != gpu)
        assert _our_devices(kube, node) == free
        _pod_with_claim(kube, "on-nodeagent", "gpu.nodeagent.io", count=3)
        got = await asyncio.to_thread(wait_for, lambda: _results(kube, "on-nodeagent"), 30)
        assert got == [(DRIVER_NAME, node, d) for d in free]
        assert _results(kube, "on-nvidia") == running  # the running claim keeps its device

        # its pod ends: the GPU is nodeagent's too
        held.clear()
        assert await detect() == frozenset()
        assert _our_devices(kube, node) == [f"gpu-{i}" for i in range(4)]

    try:
        asyncio.run(scenario())
        back = adopt.release(agent, node)
        labels = kube.request("GET", f"/api/v1/nodes/{node}")["metadata"]["labels"]
        assert back.labels["nvidia.com/gpu.deploy.dra-driver"] == "true"
        assert {k: v for k, v in labels.items() if k in OPERATOR_LABELS} == OPERATOR_LABELS
        assert "nvidia.com/gpu.deploy.dcgm-exporter-dra" not in back.labels  # never switched: left as it was
    finally:
        for path in (*(f"{PODS}/{n}?gracePeriodSeconds=0" for n in ("on-nvidia", "on-nodeagent")),
                     *(f"{CLAIMS}/{n}" for n in ("on-nvidia", "on-nodeagent")),
                     f"{RESOURCE}/resourceslices/{node}-{NVIDIA}", f"/api/v1/nodes/{node}"):
            with contextlib.suppress(KubeError):
                kube.request("DELETE", path)
        agent.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"hand-over scenario: {time.monotonic() - started:.1f} s")
