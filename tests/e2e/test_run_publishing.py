"""``nodeagent run`` as a real process against the real kube-apiserver and kubelet device manager, judged by
the apiserver's own request metrics: one field-selected watch of the own Node and no list of other nodes,
zero writes while nothing changes, refused ``nvidia.com/mig.config`` values ending ``failed`` with an Event
naming the value, and a GPU health change (an XID injected into the simulator) as a Node Event."""

from __future__ import annotations

import json
import signal
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nodeagent.kube.gpuobjects import API_PATH
from nodeagent.simulator.inject import inject_xid
from nodeagent.simulator.state import SimStore
from tests._metrics import node_watches
from tests.e2e._agent import eventually, fresh_node_with_gpu_crd, node_root, running_agent
from tests.peers.apiserver import KubeApiServer
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE", "APPLY", "DELETECOLLECTION"}
WATCHED = {"nodes", "events", "gpus"}  # what the agent writes (the apiserver itself renews leases meanwhile)


def apiserver_requests(server: KubeApiServer) -> defaultdict[tuple[str, str, str], float]:
    """apiserver_request_total summed by (verb, resource, scope), from the apiserver's /metrics."""
    status, body = server.get("/metrics")
    assert status == 200
    out: defaultdict[tuple[str, str, str], float] = defaultdict(float)
    for fam in text_string_to_metric_families(body.decode()):
        if fam.name != "apiserver_request":
            continue
        for s in fam.samples:
            if s.name == "apiserver_request_total":
                out[(s.labels.get("verb", ""), s.labels.get("resource", ""), s.labels.get("scope", ""))] += s.value
    return out


def settle_node_watches(server: KubeApiServer, when: str) -> None:
    """Wait until the apiserver holds no open watch of one named Node (scope "resource": an agent's own)."""
    eventually(lambda: node_watches(server).get("resource", 0) == 0, 30, f"no open watch of one Node {when}")


def node_obj(server: KubeApiServer, name: str) -> dict[str, Any]:
    status, body = server.get(f"/api/v1/nodes/{name}")
    assert status == 200, body
    doc: dict[str, Any] = json.loads(body)
    return doc


def events(server: KubeApiServer, name: str) -> list[tuple[str, str, str]]:
    uid = node_obj(server, name)["metadata"]["uid"]
    status, body = server.get(f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{name}")
    assert status == 200, body
    return [(e["reason"], e["type"], e["message"]) for e in json.loads(body)["items"]
            if e["involvedObject"].get("uid") == uid]


def set_label(server: KubeApiServer, name: str, key: str, value: str | None) -> None:
    status, body = server.request("PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": {key: value}}},
                                  content_type="application/merge-patch+json")
    assert status == 200, body


def test_one_watch_zero_steady_writes_refused_labels_and_health_events(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    node = "e2e-publishing"
    fresh_node_with_gpu_crd(kube_apiserver, node)
    sim_state = kubelet_harness.workdir / "sim.json"  # inside the root node_root gives
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'kubeconfig = "{kube_apiserver.kubeconfig}"\nresync_interval = 1.0\n'
                   "[runtime]\nenabled = false\n[metrics]\naddress = \"\"\n"
                   '[kubelet]\npod_resources_socket = "/var/lib/kubelet/pod-resources.sock"\n')
    args = ["run", "--config", str(cfg), "--simulate", "a30x4", "--sim-state", str(sim_state), "--node-name", node]
    # an earlier test's agent whose watch of its own Node is still closing would show in the open-watch gauge
    # as this agent's: wait until no field-selected node watch is open before taking its baseline
    settle_node_watches(kube_apiserver, "before the agent starts")
    watches0 = node_watches(kube_apiserver)
    _, audit0 = kube_apiserver.audit_node_reads(node)
    with node_root(kubelet_harness) as root, running_agent(tmp_path, root, args) as agent:
        agent.wait_notify("READY=1", timeout=20)
        eventually(lambda: node_obj(kube_apiserver, node)["metadata"].get("labels", {}).get("nvidia.com/gpu.count")
                   == "4", 15, "gpu.count label")
        eventually(lambda: len(json.loads(kube_apiserver.get(
            f"{API_PATH}?labelSelector=nodeagent.io%2Fnode%3D{node}")[1]).get("items") or []) == 4, 20, "4 GPU objects")

        # no TCP listener unless configured (metrics.address = "" here): nothing on 0.0.0.0 or elsewhere
        listening = [c for c in psutil.Process(agent.pid).net_connections(kind="inet") if c.status == "LISTEN"]
        assert listening == [], listening

        # one watch on the own Node (publisher and MIG reconciler share it), field-selected: scope "resource"
        time.sleep(1.5)
        watches = node_watches(kube_apiserver)
        assert watches.get("resource", 0) - watches0.get("resource", 0) == 1, (watches0, watches)
        assert watches.get("cluster", 0) == watches0.get("cluster", 0), (watches0, watches)

        # steady state: several resync passes (every 1 s), not one write
        before = apiserver_requests(kube_apiserver)
        time.sleep(6.0)
        after = apiserver_requests(kube_apiserver)
        writes = {k: after[k] - before[k] for k in after
                  if k[0] in WRITE_VERBS and k[1] in WATCHED and after[k] != before[k]}
        assert writes == {}, writes

        # refused input: an empty value and a name no config has both end `failed`, the Event names the value
        for value in ("", "all-7g.99gb"):
            set_label(kube_apiserver, node, "nvidia.com/mig.config", value)
            eventually(lambda v=value: any(e[0] == "MigConfigFailed" and e[2].startswith(f"MIG config {v!r} failed")  # type: ignore[misc]
                                           for e in events(kube_apiserver, node)), 20, f"MigConfigFailed for {value!r}")
            # the Event and the state label are two writes; the label may land second
            eventually(lambda: node_obj(kube_apiserver, node)["metadata"]["labels"]["nvidia.com/mig.config.state"]
                       == "failed", 10, f"mig.config.state failed for {value!r}")
        msgs = [e[2] for e in events(kube_apiserver, node) if e[0] == "MigConfigFailed"]
        assert any("label nvidia.com/mig.config has the empty value ''" in m for m in msgs), msgs
        assert any("no config named 'all-7g.99gb' (known: all-disabled, all-enabled" in m for m in msgs), msgs
        assert all(e[1] == "Warning" for e in events(kube_apiserver, node) if e[0] == "MigConfigFailed")

        # a health change: XID 48 (double-bit ECC) on GPU 2 → Unhealthy at the kubelet and a Node Event
        store = SimStore.open("a30x4", sim_state)
        uuid2 = store.machine.gpus[2].uuid
        inject_xid(store, 2, 48)
        kubelet_harness.wait("nvidia.com/gpu", healthy=3, timeout=20)
        unhealthy = eventually(lambda: [e for e in events(kube_apiserver, node) if e[0] == "GpuUnhealthy"], 20,
                               "GpuUnhealthy event")
        (_reason, type_, message), = unhealthy
        assert type_ == "Warning" and message.startswith(f"GPU 2 ({uuid2}, NVIDIA A30) is unhealthy"), message
        eventually(lambda: json.loads(kube_apiserver.get(f"{API_PATH}/{node}-gpu2")[1])["status"]["state"]
                   == "Unhealthy", 20, "GPU object state Unhealthy")
        code, took = agent.stop(signal.SIGTERM)
        assert code == 0 and took < 5.0, agent.log()

    # over the agent's whole life: ONE list of its Node (the watch's start, field-selected to the own Node as
    # tests/integration/test_kube_audit.py shows on the wire) and that one watch, counted by the apiserver's
    # audit log by the Node's name: the request counter has no name, and the apiserver's own watch of all
    # Nodes, renewed every few minutes, had once been counted as this agent's second WATCH
    reads, _ = kube_apiserver.audit_node_reads(node, audit0)
    assert reads == ["list", "watch"], reads
    for name in (f"{node}-gpu{i}" for i in range(4)):
        kube_apiserver.request("DELETE", f"{API_PATH}/{name}")
