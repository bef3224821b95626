"""Node publishing against the REAL kube-apiserver: labels, status PATCH, events, watch, GPU objects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from nodeagent.config import PublishSettings
from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice
from nodeagent.kube.client import JSON_PATCH, KubeClient
from nodeagent.kube.gpuobjects import API_PATH, NODE_LABEL, install_crd
from nodeagent.kube.labels import MANAGED_LABELS_ANNOTATION, NET_RDMA_NICS, NetFacts
from nodeagent.kube.node import NodeClient, NodeView
from nodeagent.kube.podresources import PodResourcesClient
from nodeagent.kube.podresources_api import podresources_pb2 as pb
from nodeagent.kube.podresources_api import podresources_pb2_grpc as pb_grpc
from nodeagent.kube.publisher import NodePublisher
from nodeagent.kube.resources import MANAGED_RESOURCES_ANNOTATION, ResourceSettings
from nodeagent.sharing.spec import parse_plugin_config
from tests.integration._kube import throwaway_node, wait_for

P = "nvidia.com/"
MEM = "nvidia.com~1gpu-memory"
MIGS = (MigDevice(1, 1, 0, "3g.20gb", 0, 4, 19968, "MIG-1-1"), MigDevice(1, 2, 0, "3g.20gb", 4, 4, 19968, "MIG-1-2"))


def gpu(i: int, mig: bool = False) -> Gpu:
    return Gpu(i, f"GPU-{i}-4b1d", "NVIDIA A100-SXM4-40GB", f"00000000:{7 + i:02X}:00.0", 0x20B010DE, 40960, 0,
               8, 0, i, "ampere", mig_capable=True, mig_current=mig, mig_devices=MIGS if mig else ())


def inventory(*gpus: Gpu) -> Inventory:
    return Inventory("535.161.08", 12020, gpus)


MIXED = parse_plugin_config("version: v1\nflags:\n  migStrategy: mixed\n", source="mixed.yaml")


@pytest.fixture
def node_name(kube: KubeClient) -> Iterator[str]:
    """A Node that looks kubelet-registered: own labels plus CPU and GPU capacity."""
    with throwaway_node(kube, "gpu-node", lambda name: {"team": "vision", "kubernetes.io/hostname": name}) as name:
        kube.request("PATCH", f"/api/v1/nodes/{name}/status", content_type=JSON_PATCH, body=[
            {"op": "add", "path": "/status/capacity", "value": {"cpu": "64", "nvidia.com/gpu": "2"}},
            {"op": "add", "path": "/status/allocatable", "value": {"cpu": "63", "nvidia.com/gpu": "2"}},
        ])
        yield name


def publisher(kube: KubeClient, name: str, **cfg: Any) -> NodePublisher:
    return NodePublisher(kube, name, PublishSettings(gpu_objects=cfg.pop("gpu_objects", False), **cfg),
                         net=NetFacts(100000, 2))


def test_node_client_labels_and_events(kube: KubeClient, node_name: str) -> None:
    nc = NodeClient(kube, node_name)
    view = nc.patch_labels({"a.example/x": "1", "team": None})
    assert view is not None and view.labels["a.example/x"] == "1" and "team" not in view.labels
    assert nc.patch_labels({}) is None
    name = nc.create_event("MigReconfigured", "applied all-balanced", "Normal")
    nc.create_event("GpuUnhealthy", "GPU 3: XID 79", "Warning")
    events = {e["metadata"]["name"]: e for e in nc.list_events()}
    assert events[name]["involvedObject"]["uid"] == view.uid
    assert {(e["reason"], e["type"]) for e in events.values()} == {
        ("MigReconfigured", "Normal"), ("GpuUnhealthy", "Warning")}
    with pytest.raises(ValueError):
        nc.create_event("X", "y", "Error")


def test_labels_added_changed_removed_and_foreign_untouched(kube: KubeClient, node_name: str) -> None:
    pub = publisher(kube, node_name)
    r1 = pub.publish(inventory(gpu(0), gpu(1, mig=True)), ["nvidia.com/gpu", "nvidia.com/mig-3g.20gb"], MIXED)
    assert r1.metadata_writes >= 1
    labels = NodeClient(kube, node_name).get().labels
    assert labels[P + "mig-3g.20gb.count"] == "2"
    assert labels[P + "gpu.count"] == "2"  # physical GPUs, as gpu-feature-discovery counts them
    assert labels[P + "gpu.replicas"] == "1"
    assert labels[NET_RDMA_NICS] == "2"
    assert labels["team"] == "vision"

    before = kube.stats.writes
    r2 = pub.publish(inventory(gpu(0), gpu(1, mig=True)), ["nvidia.com/gpu", "nvidia.com/mig-3g.20gb"], MIXED)
    assert r2.writes == 0 and kube.stats.writes == before

    # MIG disabled, strategy none: mixed-MIG labels go, counts change; the user's label stays
    r3 = pub.publish(inventory(gpu(0), gpu(1)), ["nvidia.com/gpu"], None)
    assert r3.metadata_writes == 1
    view = NodeClient(kube, node_name).get()
    assert P + "mig-3g.20gb.count" not in view.labels
    assert view.labels[P + "gpu.count"] == "2"
    assert view.labels[P + "mig.strategy"] == "none"
    assert view.labels["team"] == "vision"
    owned = set(view.annotations[MANAGED_LABELS_ANNOTATION].split(","))
    assert "team" not in owned and P + "gpu.count" in owned


def test_extended_resources_added_removed_and_never_served_names(kube: KubeClient, node_name: str) -> None:
    resources = ResourceSettings(gpushare_memory="aliyun.com/gpu-mem", extra={"nvidia.com/gpu": "99"})
    pub = NodePublisher(kube, node_name, PublishSettings(gpu_objects=False), resources=resources, net=NetFacts())
    res = pub.publish(inventory(gpu(0), gpu(1)), ["nvidia.com/gpu"])
    assert res.refused == ("nvidia.com/gpu",)
    view = NodeClient(kube, node_name).get()
    assert view.capacity["nvidia.com/gpu-memory"] == "81920" == view.allocatable["nvidia.com/gpu-memory"]
    assert view.capacity["aliyun.com/gpu-mem"] == "80" == view.allocatable["aliyun.com/gpu-mem"]
    assert view.capacity["nvidia.com/gpu"] == "2"  # the served name is the kubelet's, untouched
    assert view.capacity["cpu"] == "64"
    assert any(e["reason"] == "ExtendedResourceRefused" for e in NodeClient(kube, node_name).list_events())

    # gpushare no longer configured: removed from capacity and allocatable, ownership shrinks
    pub2 = NodePublisher(kube, node_name, PublishSettings(gpu_objects=False), net=NetFacts())
    pub2.publish(inventory(gpu(0), gpu(1)), ["nvidia.com/gpu"])
    view = NodeClient(kube, node_name).get()
    assert "aliyun.com/gpu-mem" not in view.capacity and "aliyun.com/gpu-mem" not in view.allocatable
    assert view.annotations[MANAGED_RESOURCES_ANNOTATION] == "nvidia.com/gpu-memory"
    before = kube.stats.writes
    assert pub2.publish(inventory(gpu(0), gpu(1)), ["nvidia.com/gpu"]).writes == 0
    assert kube.stats.writes == before


def test_reset_values_are_reapplied_through_the_watch(kube: KubeClient, node_name: str) -> None:
    pub = publisher(kube, node_name)
    pub.publish(inventory(gpu(0)), ["nvidia.com/gpu"])
    pub.start_watch(watch_timeout_s=30)
    try:
        nc = NodeClient(kube, node_name)
        # the kubelet (or a person) resets our values: capacity zeroed, a label deleted
        kube.request("PATCH", f"/api/v1/nodes/{node_name}/status", content_type=JSON_PATCH, body=[
            {"op": "replace", "path": f"/status/capacity/{MEM}", "value": "0"},
            {"op": "remove", "path": f"/status/allocatable/{MEM}"},
        ])
        nc.patch_labels({P + "gpu.product": None})
        view = wait_for(lambda: (v := nc.get()).capacity.get("nvidia.com/gpu-memory") == "40960"
                        and v.allocatable.get("nvidia.com/gpu-memory") == "40960"
                        and P + "gpu.product" in v.labels and v)
        assert view.labels[P + "gpu.product"] == "NVIDIA-A100-SXM4-40GB"
        assert pub.reapplied >= 1
        # and then it is quiet again: no writes while nothing changes
        time.sleep(0.5)
        before = kube.stats.writes
        time.sleep(1.0)
        assert kube.stats.writes == before
    finally:
        pub.close()


async def test_async_node_updates(kube: KubeClient, node_name: str) -> None:
    nc = NodeClient(kube, node_name)
    seen: list[NodeView] = []
    agen = nc.updates(watch_timeout_s=30)
    try:
        first = await asyncio.wait_for(agen.__anext__(), 10)
        assert first.name == node_name
        await nc.apatch_labels({"nvidia.com/mig.config": "all-balanced"})
        while True:
            v = await asyncio.wait_for(agen.__anext__(), 10)
            seen.append(v)
            if v.labels.get("nvidia.com/mig.config") == "all-balanced":
                break
    finally:
        await agen.aclose()  # type: ignore[attr-defined]
    assert seen[-1].resource_version != first.resource_version


class PodResourcesServer(pb_grpc.PodResourcesListerServicer):
    """A gRPC server in the test speaking the kubelet's PodResources v1 proto."""

    def __init__(self) -> None:
        self.pods: list[pb.PodResources] = []

    def List(self, request: Any, context: Any) -> Any:
        return pb.ListPodResourcesResponse(pod_resources=self.pods)

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        return pb.AllocatableResourcesResponse(devices=[
            pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-0-4b1d"]),
            pb.ContainerDevices(resource_name="nvidia.com/mig-3g.20gb", device_ids=["MIG-1-1", "MIG-1-2"]),
        ])


@pytest.fixture
def podresources(tmp_path: Path) -> Iterator[tuple[PodResourcesServer, Path]]:
    sock = tmp_path / "pod-resources" / "kubelet.sock"
    sock.parent.mkdir()
    servicer = PodResourcesServer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PodResourcesListerServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    yield servicer, sock
    server.stop(None).wait(5)


def test_gpu_objects_lifecycle(
    kube: KubeClient, node_name: str, podresources: tuple[PodResourcesServer, Path]
) -> None:
    install_crd(kube)
    servicer, sock = podresources
    servicer.pods = [pb.PodResources(name="train", namespace="ml", containers=[
        pb.ContainerResources(name="main", devices=[
            pb.ContainerDevices(resource_name="nvidia.com/mig-3g.20gb", device_ids=["MIG-1-2"])])])]
    client = PodResourcesClient(sock)
    assert client.allocatable()["nvidia.com/mig-3g.20gb"] == ("MIG-1-1", "MIG-1-2")
    pub = NodePublisher(kube, node_name, PublishSettings(), net=NetFacts(), pod_resources=client)
    try:
        inv = inventory(gpu(0), gpu(1, mig=True))
        res = pub.publish(inv, ["nvidia.com/gpu", "nvidia.com/mig-3g.20gb"], MIXED, health={0: True, 1: True})
        assert sorted(res.gpu_objects.created) == [f"{node_name}-gpu0", f"{node_name}-gpu1"]
        node_uid = NodeClient(kube, node_name).get().uid
        objs = {o["metadata"]["name"]: o for o in kube.request(
            "GET", API_PATH, query={"labelSelector": f"{NODE_LABEL}={node_name}"})["items"]}
        g1 = objs[f"{node_name}-gpu1"]
        assert g1["spec"]["uuid"] == "GPU-1-4b1d" and g1["spec"]["nodeName"] == node_name
        assert g1["metadata"]["ownerReferences"][0]["uid"] == node_uid
        assert g1["status"]["capacity"] == {"nvidia.com/mig-3g.20gb": "2"}
        assert g1["status"]["allocated"]["ml/train"]["containers"] == [
            {"container": "main", "resource": "nvidia.com/mig-3g.20gb", "devices": ["MIG-1-2"]}]
        assert objs[f"{node_name}-gpu0"]["status"]["state"] == "Healthy"

        before = kube.stats.writes
        assert pub.publish(inv, ["nvidia.com/gpu", "nvidia.com/mig-3g.20gb"], MIXED,
                           health={0: True, 1: True}).writes == 0
        assert kube.stats.writes == before

        # health change and a finished pod: only the status subresource is written
        servicer.pods = []
        res = pub.publish(inv, ["nvidia.com/gpu", "nvidia.com/mig-3g.20gb"], MIXED, health={0: False, 1: True})
        assert sorted(res.gpu_objects.status_updated) == [f"{node_name}-gpu0", f"{node_name}-gpu1"]
        assert res.gpu_objects.updated == []
        g0 = kube.request("GET", f"{API_PATH}/{node_name}-gpu0")
        assert g0["status"]["state"] == "Unhealthy" and g0["status"]["allocatable"] == {"nvidia.com/gpu": "0"}

        # GPU 1 disappears: its object is deleted
        res = pub.publish(inventory(gpu(0)), ["nvidia.com/gpu"], None, health={0: False})
        assert res.gpu_objects.deleted == [f"{node_name}-gpu1"]
        names = [o["metadata"]["name"] for o in kube.request(
            "GET", API_PATH, query={"labelSelector": f"{NODE_LABEL}={node_name}"})["items"]]
        assert names == [f"{node_name}-gpu0"]
    finally:
        client.close()
        pub.close()
