"""The eviction hand-off between agent and controller: the annotations' format (bad input refused with one
clear error), the controller's checks of a pod, and the agent's reading of outcomes, over a fake API."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nodeagent.errors import ConfigError, KubeError
from nodeagent.remediation import evictreq as er
from nodeagent.remediation.broker import EvictionBroker
from nodeagent.remediation.nodepods import ControllerPods, EvictionRefused


def test_requests_round_trip_and_bad_ones_name_node_and_fault() -> None:
    reqs = {"team/a": er.Request("team/a", "u1", ("GPU-1",), 30, 1000.0)}
    assert er.decode_requests("n1", er.encode_requests(reqs)) == reqs
    for value, fault in (("{", "not JSON"), ('{"nons": {}}', "namespace/name"),
                         ('{"t/a": {"grace": -1, "deadline": 1}}', "grace"),
                         ('{"t/a": {"deadline": "soon"}}', "deadline"), ("[1]", "object")):
        with pytest.raises(ConfigError, match=fault) as e:
            er.decode_requests("n1", value)
        assert "Node n1" in str(e.value) and er.REQUESTS in str(e.value)
    assert er.decode_results('{"t/a": {"result": "nonsense"}, "t/b": {"result": "gone"}}') == \
        {"t/b": er.Outcome("gone")}
    assert er.decode_results("not json") == {}


def test_pod_checks() -> None:
    req = er.Request("t/a", "", (), 0, 0)
    pod: dict[str, Any] = {"metadata": {"uid": "u"}, "spec": {"nodeName": "n2", "containers": [
        {"resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    assert "does not run on node n1" in er.check_pod(pod, "n1", req)
    assert er.check_pod(pod, "n2", req) == "" and er.holds_device_plugin_gpu(pod)
    assert not er.holds_device_plugin_gpu({"spec": {"containers": [{"resources": {"limits": {"cpu": "1"}}}]}})
    claim = {"status": {"reservedFor": [{"resource": "pods", "uid": "u"}], "allocation": {"devices": {"results": [
        {"driver": er.DRA_DRIVER, "pool": "n2", "device": "gpu-0"}]}}}}
    assert er.claim_holds_gpu_on(claim, "n2", "u")
    assert not er.claim_holds_gpu_on(claim, "n1", "u") and not er.claim_holds_gpu_on(claim, "n2", "other")


class FakeKube:
    """Nodes and pods in memory; the Eviction API refuses (429) while ``budget`` is 0."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {"n1": {"metadata": {"name": "n1"}},
                                                 "n2": {"metadata": {"name": "n2"}}}
        self.pods: dict[str, dict[str, Any]] = {}
        self.budget = 0
        self.evicted: list[str] = []

    def add_pod(self, pod: str, node: str, gpu: bool = True) -> None:
        res = {"limits": {"nvidia.com/gpu": "1"}} if gpu else {}
        self.pods[pod] = {"metadata": {"uid": f"uid-{pod}"}, "spec": {"nodeName": node, "containers": [
            {"resources": res}]}}

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "nodes"] and len(parts) == 3:
            return {"items": list(self.nodes.values())}
        if parts[:3] == ["api", "v1", "nodes"]:
            node = self.nodes[parts[3]]
            if method == "PATCH":
                ann = node["metadata"].setdefault("annotations", {})
                for k, v in body["metadata"]["annotations"].items():
                    if v is None:
                        ann.pop(k, None)
                    else:
                        ann[k] = v
            return json.loads(json.dumps(node))
        pod = f"{parts[3]}/{parts[5]}"
        if pod not in self.pods:
            raise KubeError("not found", status=404)
        if parts[-1] == "eviction":
            assert body["deleteOptions"]["preconditions"]["uid"] == self.pods[pod]["metadata"]["uid"]
            if self.budget == 0:
                raise KubeError("budget", status=429)
            self.evicted.append(pod)
            return {}
        return self.pods[pod]


def test_the_agent_asks_the_controller_evicts_within_budget_and_refuses_other_nodes_pods() -> None:
    kube = FakeKube()
    kube.add_pod("t/mine", "n1")
    kube.add_pod("t/theirs", "n2")
    kube.add_pod("t/cpu", "n1", gpu=False)
    pods = ControllerPods(kube, "n1", read_every_s=0)  # type: ignore[arg-type]
    broker = EvictionBroker(kube)  # type: ignore[arg-type]
    for p in ("t/mine", "t/theirs", "t/cpu"):
        assert pods._evict(p, 5) == "blocked"
    assert broker.pass_once().results == {"n1": {"t/mine": "blocked", "t/theirs": "refused", "t/cpu": "refused"}}
    with pytest.raises(EvictionRefused, match="does not run on node n1"):
        pods._evict("t/theirs", 5)
    with pytest.raises(EvictionRefused, match="holds no GPU"):
        pods._evict("t/cpu", 5)
    assert pods._evict("t/mine", 5) == "blocked" and kube.evicted == []
    kube.budget = 1
    broker.pass_once()
    assert kube.evicted == ["t/mine"] and pods._evict("t/mine", 5) == "evicted" and not pods._gone("t/mine")
    del kube.pods["t/mine"]
    broker.pass_once()
    assert pods._gone("t/mine") and "t/mine" not in pods.pending()
    assert kube.evicted == ["t/mine"]  # never evicted twice, never the other node's pod


def test_a_request_past_its_deadline_expires_and_a_replaced_pod_is_gone() -> None:
    kube = FakeKube()
    kube.add_pod("t/a", "n1")
    now = [1000.0]
    pods = ControllerPods(kube, "n1", timeout_s=10, clock=lambda: now[0], read_every_s=0,  # type: ignore[arg-type]
                          uid_of=lambda p: "uid-old")
    broker = EvictionBroker(kube, clock=lambda: now[0])  # type: ignore[arg-type]
    pods._evict("t/a", 0)
    assert broker.pass_once().results["n1"]["t/a"] == "gone"  # the UID asked for is not the pod's
    kube2 = FakeKube()
    kube2.add_pod("t/a", "n1")
    pods2 = ControllerPods(kube2, "n1", timeout_s=10, clock=lambda: now[0], read_every_s=0)  # type: ignore[arg-type]
    broker2 = EvictionBroker(kube2, clock=lambda: now[0])  # type: ignore[arg-type]
    pods2._evict("t/a", 0)
    now[0] += 11
    assert broker2.pass_once().results["n1"]["t/a"] == "expired"  # the controller stops trying
    with pytest.raises(EvictionRefused, match="expired"):
        pods2._gone("t/a")
    # a later run asks again: a renewed request (new deadline) is decided anew, not by the old outcome
    assert pods2._evict("t/a", 0) == "blocked"
    kube2.budget = 1
    assert broker2.pass_once().results["n1"]["t/a"] == "evicted" and kube2.evicted == ["t/a"]
    assert pods2._evict("t/a", 0) == "evicted"


def test_a_malformed_request_annotation_is_reported_and_skipped() -> None:
    kube = FakeKube()
    kube.nodes["n2"]["metadata"]["annotations"] = {er.REQUESTS: "{"}
    kube.add_pod("t/a", "n1")
    ControllerPods(kube, "n1", read_every_s=0)._evict("t/a", 0)  # type: ignore[arg-type]
    kube.budget = 1
    res = EvictionBroker(kube).pass_once()  # type: ignore[arg-type]
    assert res.results == {"n1": {"t/a": "evicted"}} and "Node n2" in res.problems[0]


def test_dra_holders_are_the_pods_with_a_claim_on_the_gpu_from_this_nodes_pool() -> None:
    from nodeagent.kube.podresources import ClaimAssignment
    from nodeagent.remediation.holders import dra_holders, merge

    uses = [ClaimAssignment("t", "whole", "c", "t", "c1", (("gpu.nodeagent.io", "n1", "gpu-3"),)),
            ClaimAssignment("t", "slice", "c", "t", "c2", (("gpu.nodeagent.io", "n1", "gpu-3-mig-1g-10gb-at-0"),)),
            ClaimAssignment("t", "other-pool", "c", "t", "c3", (("gpu.nodeagent.io", "n2", "gpu-3"),)),
            ClaimAssignment("t", "other-driver", "c", "t", "c4", (("x.example.com", "n1", "gpu-3"),)),
            ClaimAssignment("t", "channel", "c", "t", "c5", (("gpu.nodeagent.io", "n1", "channel-0"),))]
    got = dra_holders(uses, "n1", {3: "GPU-3", 5: "GPU-5"})
    assert got == {"GPU-3": ["t/slice", "t/whole"]}
    assert merge(got, {"GPU-3": ["t/plugin"], "GPU-5": ["t/five"]}) == \
        {"GPU-3": ["t/plugin", "t/slice", "t/whole"], "GPU-5": ["t/five"]}


def test_the_eviction_path_key() -> None:
    from nodeagent.config import parse_config

    assert parse_config('[remediation]\nevictions = "direct"\n', "c.toml").remediation.evictions == "direct"
    assert parse_config("", "c.toml").remediation.evictions == "controller"
    with pytest.raises(ConfigError, match=r"'remediation\.evictions' must be one of 'controller', 'direct'"):
        parse_config('[remediation]\nevictions = "kubelet"\n', "c.toml")
