"""Node publishing details judged by the REAL kube-apiserver: health-change Events, one shared watch of the own
Node (counted by the apiserver's own metrics), and the GPU CRD's printer columns as ``kubectl get gpus``
receives them (the server-side Table)."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
import urllib.request
from typing import Any

from nodeagent.config import PublishSettings
from nodeagent.gpu.inventory import Gpu, Inventory
from nodeagent.kube.client import KubeClient
from nodeagent.kube.gpuobjects import API_PATH, install_crd
from nodeagent.kube.labels import NetFacts
from nodeagent.kube.node import NodeClient, NodeView, NodeWatchHub
from nodeagent.kube.publisher import NodePublisher
from tests._metrics import node_watches
from tests.integration._kube import wait_for
from tests.peers.apiserver import KubeApiServer

TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"


def gpu(i: int) -> Gpu:
    return Gpu(i, f"GPU-{i}-9c3e", "NVIDIA H100 80GB HBM3", f"00000000:{0x18 + i:02X}:00.0", 0x233010DE, 81559,
               0, 9, 0, i, "hopper")


INV = Inventory("550.54.15", 12040, (gpu(0), gpu(1)))


def node_events(nc: NodeClient) -> list[tuple[str, str, str]]:
    uid = nc.get().uid
    return [(e["reason"], e["type"], e["message"]) for e in nc.list_events() if e["involvedObject"]["uid"] == uid]


def test_health_changes_are_node_events(kube: KubeClient, node_name: str) -> None:
    pub = NodePublisher(kube, node_name, PublishSettings(gpu_objects=False), net=NetFacts())
    nc = NodeClient(kube, node_name)
    pub.publish(INV, ["nvidia.com/gpu"], health={0: True, 1: True})
    assert node_events(nc) == []  # healthy from the start is no change
    pub.publish(INV, ["nvidia.com/gpu"], health={0: True, 1: False})
    pub.publish(INV, ["nvidia.com/gpu"], health={0: True, 1: False})  # same health: no second event
    assert node_events(nc) == [("GpuUnhealthy", "Warning", "GPU 1 (GPU-1-9c3e, NVIDIA H100 80GB HBM3) is "
                                "unhealthy: the kubelet no longer allocates its devices")]
    pub.publish(INV, ["nvidia.com/gpu"], health={0: True, 1: True})
    assert ("GpuHealthy", "Normal", "GPU 1 (GPU-1-9c3e, NVIDIA H100 80GB HBM3) is healthy: its devices are "
            "allocatable again") in node_events(nc)
    assert len(node_events(nc)) == 2
    # no health information (e.g. bootstrap's label pass): no event, whatever was seen before
    pub.publish(INV, ["nvidia.com/gpu"])
    assert len(node_events(nc)) == 2


async def test_publisher_and_mig_label_updates_share_one_watch(
    kube: KubeClient, node_name: str, kube_apiserver: KubeApiServer
) -> None:
    """What the daemon does: the publisher watches the Node for reset values and the MIG reconciler watches it
    for its label, each through its own NodeClient on the one KubeClient: ONE watch request, field-selected to
    this node (the apiserver counts it under scope "resource", not "cluster")."""
    base = node_watches(kube_apiserver)
    watches0 = kube.stats.watches
    sent: list[tuple[str, str]] = []
    real_call = kube.api.call_api

    def spy(method: str, url: str, *args: Any, **kwargs: Any) -> Any:  # what goes on the wire, unchanged
        sent.append((method, url))
        return real_call(method, url, *args, **kwargs)

    setattr(kube.api, "call_api", spy)  # noqa: B010
    hub = NodeWatchHub()  # the daemon owns one and hands it to every NodeClient it makes
    pub = NodePublisher(kube, node_name, PublishSettings(gpu_objects=False), net=NetFacts(), watches=hub)
    pub.publish(INV, ["nvidia.com/gpu"])
    await asyncio.to_thread(pub.start_watch, watch_timeout_s=60)
    reconciler_node = NodeClient(kube, node_name, watches=hub)
    agen = reconciler_node.updates()
    try:
        first: NodeView = await asyncio.wait_for(agen.__anext__(), 10)  # the newest known version, at once
        assert first.name == node_name and first.labels.get("nvidia.com/gpu.count") == "2"
        await reconciler_node.apatch_labels({"nvidia.com/mig.config": "all-balanced"})
        while (await asyncio.wait_for(agen.__anext__(), 10)).labels.get("nvidia.com/mig.config") != "all-balanced":
            pass
        # the publisher sees the same stream: a reset label is re-applied
        await reconciler_node.apatch_labels({"nvidia.com/gpu.count": None})
        await asyncio.to_thread(wait_for, lambda: reconciler_node.get().labels.get("nvidia.com/gpu.count") == "2")
        assert kube.stats.watches - watches0 == 1
        now = node_watches(kube_apiserver)
        assert now.get("resource", 0) - base.get("resource", 0) == 1, (base, now)
        assert now.get("cluster", 0) == base.get("cluster", 0), (base, now)
    finally:
        setattr(kube.api, "call_api", real_call)  # noqa: B010
        await agen.aclose()  # type: ignore[attr-defined]
        await asyncio.to_thread(pub.close)
    # every request about nodes names this node: by path, or by the metadata.name field selector
    node_calls = [(m, u) for m, u in sent if "/api/v1/nodes" in u]
    lists = [u for m, u in node_calls if m == "GET" and urllib.parse.urlsplit(u).path == "/api/v1/nodes"]
    assert len(lists) == 2, node_calls  # the watch's initial list (of one node) and the watch itself
    for u in lists:
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(u).query)
        assert q["fieldSelector"] == [f"metadata.name={node_name}"], u
    assert sum("watch=true" in u for u in lists) == 1
    assert all(urllib.parse.urlsplit(u).path.startswith(f"/api/v1/nodes/{node_name}") for m, u in node_calls
               if u not in lists)
    # the last subscriber gone, the watch is closed
    await asyncio.to_thread(wait_for, lambda: node_watches(kube_apiserver).get("resource", 0) == base.get("resource", 0))
    assert len(hub) == 0  # the hub forgets a watch with its last subscriber


def test_kubectl_get_gpus_table(kube: KubeClient, node_name: str, kube_apiserver: KubeApiServer) -> None:
    """The CRD's additionalPrinterColumns as the apiserver renders them for kubectl (Accept: Table)."""
    install_crd(kube)

    def published() -> bool:
        try:
            NodePublisher(kube, node_name, PublishSettings(), net=NetFacts()).publish(
                INV, ["nvidia.com/gpu"], health={0: True, 1: False})
        except Exception as e:  # a freshly served CRD may answer 429 for a moment
            if "429" in str(e):
                return False
            raise
        return True

    wait_for(published, 30)
    req = urllib.request.Request(f"{kube_apiserver.url}{API_PATH}?labelSelector=nodeagent.io%2Fnode%3D{node_name}",
                                 headers={"Accept": TABLE})
    with urllib.request.urlopen(req, context=kube_apiserver.ssl_context(), timeout=10) as r:
        table = json.loads(r.read())
    assert table["kind"] == "Table"
    cols = [c["name"] for c in table["columnDefinitions"]]
    assert cols == ["Name", "Node", "Index", "Model", "Memory(MiB)", "State", "Allocated", "Age"]
    rows = {r["cells"][0]: r["cells"][1:7] for r in table["rows"]}
    assert rows == {
        f"{node_name}-gpu0": [node_name, 0, "NVIDIA H100 80GB HBM3", 81559, "Healthy", 0],
        f"{node_name}-gpu1": [node_name, 1, "NVIDIA H100 80GB HBM3", 81559, "Unhealthy", 0],
    }
    for name in rows:
        kube.request("DELETE", f"{API_PATH}/{name}")
