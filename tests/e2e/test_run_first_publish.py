"""What one ``nodeagent run`` costs the API server, counted by the REAL kube-apiserver's audit log: the first
publish of a simulated DGX H100 (8 GPUs) is 10 writes — one metadata PATCH (labels and annotations), one
status PATCH (the unserved extended resources together with the four GPU Node conditions), one create per GPU
object — in a cluster whose RuntimeClass exists already; then nothing while idle, and nothing at all when the
agent restarts onto a Node that already shows everything. Counts, not times."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from nodeagent.kube.client import KubeClient, connect
from nodeagent.kube.conditions import CONDITION_TYPES, GPU_READY, RUNTIME_READY
from nodeagent.kube.gpuobjects import API_PATH
from nodeagent.kube.runtimeclass import desired_classes, ensure_runtime_classes
from tests.e2e._agent import eventually, fresh_node_with_gpu_crd, node_root, running_agent
from tests.e2e.test_run_conditions import cond, wire_containerd
from tests.peers.apiserver import AuditWrite, KubeApiServer
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

NODE = "e2e-first-publish"
GPUS = 8


def agent_writes(server: KubeApiServer, since: int) -> tuple[list[AuditWrite], int]:
    """Writes about this agent's node since ``since``: the Node, its GPU objects, its Events, RuntimeClasses."""
    writes, offset = server.audit_writes(since)
    mine = [w for w in writes if w.user != "system:apiserver" and (
        (w.resource == "nodes" and w.name == NODE) or (w.resource == "gpus" and w.name.startswith(f"{NODE}-gpu"))
        or w.resource in ("events", "runtimeclasses"))]
    return mine, offset


def shape(writes: list[AuditWrite]) -> Counter[tuple[str, str, str]]:
    return Counter((w.verb, w.resource, w.subresource) for w in writes)


def node_doc(server: KubeApiServer) -> dict[str, Any]:
    status, body = server.get(f"/api/v1/nodes/{NODE}")
    assert status == 200, body
    doc: dict[str, Any] = json.loads(body)
    return doc


def gpu_objects(server: KubeApiServer) -> list[dict[str, Any]]:
    status, body = server.get(f"{API_PATH}?labelSelector=nodeagent.io%2Fnode%3D{NODE}")
    assert status == 200, body
    items: list[dict[str, Any]] = json.loads(body).get("items") or []
    return items


def published(server: KubeApiServer) -> bool:
    node = node_doc(server)
    status = node.get("status") or {}
    types = {c.get("type") for c in status.get("conditions") or ()}
    return (node["metadata"].get("labels", {}).get("nvidia.com/gpu.count") == str(GPUS)
            and "nvidia.com/gpu-memory" in (status.get("capacity") or {})
            and set(CONDITION_TYPES) <= types and cond(server, NODE, GPU_READY)[0] == "True"
            and cond(server, NODE, RUNTIME_READY)[0] == "True"
            and sum(bool(o.get("status")) for o in gpu_objects(server)) == GPUS)


def test_first_publish_is_ten_writes_then_none(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    fresh_node_with_gpu_crd(kube_apiserver, NODE)
    for i in range(GPUS):
        kube_apiserver.request("DELETE", f"{API_PATH}/{NODE}-gpu{i}")
    admin = KubeClient(connect(kube_apiserver.kubeconfig))
    try:  # the cluster's first agent made it (a fleet shares it): this agent only reads it
        ensure_runtime_classes(admin, desired_classes())
    finally:
        admin.close()
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'kubeconfig = "{kube_apiserver.kubeconfig}"\nresync_interval = 1.0\n'
                   "[runtime]\nenabled = true\ncheck_interval = 1.0\n"
                   "[health]\nwindow = 2.0\npoll_interval = 1.0\n"
                   '[kubelet]\npod_resources_socket = "/var/lib/kubelet/pod-resources.sock"\n')
    args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state",
            str(kubelet_harness.workdir / "sim.json"), "--node-name", NODE]  # in the root node_root gives
    with node_root(kubelet_harness) as root:
        wire_containerd(root)
        _, offset = kube_apiserver.audit_writes()  # after the set-up writes are flushed
        with running_agent(tmp_path, root, args) as agent:
            agent.wait_notify("READY=1", timeout=30)
            eventually(lambda: published(kube_apiserver), 30, "labels, resources, conditions and GPU objects")
            time.sleep(2.0)  # anything still on its way (a second status patch, an event) lands in the count
            first, offset = agent_writes(kube_apiserver, offset)
            assert shape(first) == {("patch", "nodes", ""): 1, ("patch", "nodes", "status"): 1,
                                    ("create", "gpus", ""): GPUS}, first
            assert len(first) == 10 and all(200 <= w.code < 300 for w in first), first

            # idle: resync, health polls and runtime checks every second, not one write
            time.sleep(8.0)
            idle, offset = agent_writes(kube_apiserver, offset)
            assert idle == [], idle
            code, _ = agent.stop(signal.SIGTERM)
            assert code == 0, agent.log()
        _, offset = agent_writes(kube_apiserver, offset)  # whatever the stop wrote does not count below

        # a restart onto a Node that shows everything already: the first publish writes nothing
        (tmp_path / "restart").mkdir()
        with running_agent(tmp_path / "restart", root, args) as agent:
            agent.wait_notify("READY=1", timeout=30)
            time.sleep(6.0)
            again, offset = agent_writes(kube_apiserver, offset)
            assert again == [], again
            code, _ = agent.stop(signal.SIGTERM)
            assert code == 0, agent.log()
    for i in range(GPUS):
        kube_apiserver.request("DELETE", f"{API_PATH}/{NODE}-gpu{i}")
