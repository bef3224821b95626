"""The NVLink clique on the REAL kube-apiserver: nvidia.com/gpu.clique published as GFD writes it and withdrawn
while the fabric is not ready, the NVLinkCliqueReady condition saying why, and the clique's Nodes found by
label with their InternalIPs (the IMEX daemon's peers)."""

from __future__ import annotations

import dataclasses

from nodeagent.config import PublishSettings
from nodeagent.gpu.fabric import CLIQUE_LABEL, decide
from nodeagent.gpu.inventory import Fabric, Gpu, Inventory
from nodeagent.kube.client import JSON_PATCH, KubeClient
from nodeagent.kube.conditions import NVLINK_CLIQUE_READY, ConditionSnapshot, ConditionWriter
from nodeagent.kube.node import NodeClient, internal_ips
from nodeagent.kube.publisher import NodePublisher
from tests.integration._kube import throwaway_node

UUID = "7b968a6d-c8aa-45e1-9e07-e1e51be99c31"
HEALTHY = Fabric(state=3, status=0, cluster_uuid=UUID, clique_id=1, health_mask=4522, health_summary=1)


def _inv(fabric: Fabric) -> Inventory:
    gpus = tuple(Gpu(i, f"GPU-{i}-gb", "NVIDIA GB200", f"0000000{8 + i}:01:00.0", 0x294110DE, 189471, 0, 10, 0, i,
                     "blackwell", fabric=fabric) for i in range(2))
    return Inventory("570.133.20", 12080, gpus)


def _set_ip(kube: KubeClient, name: str, ip: str) -> None:
    kube.request("PATCH", f"/api/v1/nodes/{name}/status", content_type=JSON_PATCH, body=[
        {"op": "add", "path": "/status/addresses", "value": [{"type": "InternalIP", "address": ip},
                                                            {"type": "Hostname", "address": name}]}])


def test_clique_label_condition_and_peers(kube: KubeClient, node_name: str) -> None:
    nc = NodeClient(kube, node_name)
    pub = NodePublisher(kube, node_name, PublishSettings(gpu_objects=False, extended_resources=False))
    writer = ConditionWriter(nc)
    value = f"{UUID}.1"

    pub.publish(_inv(HEALTHY))
    assert nc.get().labels[CLIQUE_LABEL] == value
    writer.sync(ConditionSnapshot(fabric=decide(_inv(HEALTHY))))
    cond = {c["type"]: c for c in nc.get().conditions}[NVLINK_CLIQUE_READY]
    assert (cond["status"], cond["reason"]) == ("True", "CliqueJoined")

    # the clique's Nodes by label: this one (with its InternalIP), not a Node of another clique
    _set_ip(kube, node_name, "10.99.0.2")
    with throwaway_node(kube, "rack-other", lambda n: {CLIQUE_LABEL: f"{UUID}.2"}) as other:
        _set_ip(kube, other, "10.99.0.3")
        found = internal_ips(kube.list_nodes(label_selector=f"{CLIQUE_LABEL}={value}"))
        assert found == {node_name: "10.99.0.2"}

    # fabric registration restarts: the label goes, the condition says why
    starting = dataclasses.replace(HEALTHY, state=2, status=27, cluster_uuid="00000000-0000-0000-0000-000000000000",
                                   clique_id=0)
    pub.publish(_inv(starting))
    assert CLIQUE_LABEL not in nc.get().labels
    assert writer.sync(ConditionSnapshot(fabric=decide(_inv(starting)))) == [NVLINK_CLIQUE_READY]
    cond = {c["type"]: c for c in nc.get().conditions}[NVLINK_CLIQUE_READY]
    assert (cond["status"], cond["reason"]) == ("False", "FabricInProgress")
    assert "GPU 0" in cond["message"]
    assert writer.sync(ConditionSnapshot(fabric=decide(_inv(starting)))) == []  # nothing new, nothing written
