"""Controller-executed evictions under the two-token rule, judged by the real kube-apiserver with the plain
manifests (rbac.yaml, admission-policy.yaml, remediation-controller.yaml) applied:

- a node agent's bound token writes eviction requests only on its OWN Node, never another node's, and can
  evict no pod itself;
- the remediation controller's token (service account nodeagent-remediation) reads pods and claims, evicts,
  and of a Node changes only the outcome annotation: no label, no other annotation (not the agents'
  requests), no spec (no cordon), no status; it deletes no pod and reads no Secret."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from nodeagent.remediation import evictreq as er
from tests.e2e.test_computedomain_confinement import controller_token
from tests.e2e.test_kube_manifests import (
    MANIFESTS,
    PATHS,
    apply,
    apply_rbac,
    as_agent,
    bound_token,
    wait_for_policy,
)
from tests.e2e.test_run_cluster import make_node
from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers

A, B = "remconf-a", "remconf-b"
TENANT = "remconf-tenant"
NODES = "/api/v1/nodes"
PODS = f"/api/v1/namespaces/{TENANT}/pods"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/nodeagent/leases"
MERGE, JSON = "application/merge-patch+json", "application/json"
REM = "remediation"
SA = "nodeagent-remediation"


def requests(pod: str = f"{TENANT}/on-a") -> dict[str, Any]:
    value = er.encode_requests({pod: er.Request(pod, "", ("GPU-0",), 0, time.time() + 600)})
    return {"metadata": {"annotations": {er.REQUESTS: value}}}


def results(result: er.Result = "evicted") -> dict[str, Any]:
    return {"metadata": {"annotations": {er.RESULTS: er.encode_results({f"{TENANT}/on-a": er.Outcome(result)})}}}


def eviction(name: str) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": TENANT}}


@dataclass(frozen=True)
class Case:
    what: str
    token: str  # A, B or REM
    method: str
    path: str
    body: Any = None
    ctype: str = JSON
    want: int = 403


CASES: tuple[Case, ...] = (
    Case("request an eviction on its own Node", A, "PATCH", f"{NODES}/{A}", requests(), MERGE, 200),
    Case("request an eviction on the other Node", A, "PATCH", f"{NODES}/{B}", requests(), MERGE),
    Case("remove the other Node's requests", B, "PATCH", f"{NODES}/{A}",
         {"metadata": {"annotations": {er.REQUESTS: None}}}, MERGE),
    Case("evict a pod itself", A, "POST", f"{PODS}/on-a/eviction", eviction("on-a")),
    Case("read a pod", A, "GET", f"{PODS}/on-a"),
    Case("read a pod", REM, "GET", f"{PODS}/on-b", want=200),
    Case("list Nodes", REM, "GET", NODES, want=200),
    Case("watch Nodes", REM, "GET", f"{NODES}?watch=true&timeoutSeconds=1", want=200),
    Case("watch pods", REM, "GET", "/api/v1/pods?watch=true&timeoutSeconds=1"),
    Case("read a ResourceClaim", REM, "GET", f"/apis/resource.k8s.io/v1/namespaces/{TENANT}/resourceclaims/x",
         want=404),
    Case("write the outcome on a Node", REM, "PATCH", f"{NODES}/{A}", results(), MERGE, 200),
    Case("forge a node's requests", REM, "PATCH", f"{NODES}/{B}", requests(f"{TENANT}/on-a"), MERGE),
    Case("write another annotation", REM, "PATCH", f"{NODES}/{A}", {"metadata": {"annotations": {"x": "y"}}},
         MERGE),
    Case("label a Node", REM, "PATCH", f"{NODES}/{A}", {"metadata": {"labels": {"x": "y"}}}, MERGE),
    Case("cordon a Node", REM, "PATCH", f"{NODES}/{A}", {"spec": {"unschedulable": True}}, MERGE),
    Case("write a Node's status", REM, "PATCH", f"{NODES}/{A}/status", {"status": {"capacity": {"x": "1"}}},
         MERGE),
    Case("delete a Node", REM, "DELETE", f"{NODES}/{B}"),
    Case("delete a pod", REM, "DELETE", f"{PODS}/on-b"),
    Case("read Secrets", REM, "GET", "/api/v1/namespaces/nodeagent/secrets"),
    Case("update the ComputeDomain controller's Lease", REM, "PUT", f"{LEASES}/nodeagent-controller",
         {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "nodeagent-controller"},
          "spec": {"holderIdentity": "x"}}),
    Case("evict a pod", REM, "POST", f"{PODS}/on-a/eviction", eviction("on-a"), want=201),
)


def test_agents_request_only_on_their_own_node_and_the_controller_writes_only_outcomes(
        kube_apiserver: KubeApiServer) -> None:
    server = kube_apiserver
    apply_rbac(server)
    docs = [d for d in yaml.safe_load_all((MANIFESTS / "remediation-controller.yaml").read_text()) if d]
    assert {d["kind"] for d in docs} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                                         "RoleBinding", "ValidatingAdmissionPolicy",
                                         "ValidatingAdmissionPolicyBinding", "Deployment"}
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in PATHS and doc["kind"] != "Deployment":
            status, body = apply(server, doc, dry_run=False)
            assert status in (200, 201), body
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == SA
    for n in (A, B):
        make_node(server, n)
    server.request("POST", "/api/v1/namespaces",
                   {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TENANT}})
    for pod, node in (("on-a", A), ("on-b", B)):
        server.request("DELETE", f"{PODS}/{pod}?gracePeriodSeconds=0")
        status, raw = server.request("POST", PODS, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "stand-in"}]}})
        assert status == 201, raw
    tokens = {A: bound_token(server, A), B: bound_token(server, B), REM: controller_token(server, SA)}
    wait_for_policy(server, tokens[A], B)
    deadline = time.monotonic() + 30  # the controller's policy loaded: its label probe (a new value each) refused
    tries = 0
    while as_agent(server, tokens[REM], "PATCH", f"{NODES}/{B}",
                   {"metadata": {"labels": {"probe": str(tries)}}})[0] != 403:
        assert time.monotonic() < deadline, "the remediation controller's policy never refused a label"
        tries += 1
        time.sleep(0.2)
    assert server.request("PATCH", f"{NODES}/{B}", {"metadata": {"labels": {"probe": None}}}, content_type=MERGE)[0] \
        == 200
    wrong: list[str] = []
    for case in CASES:
        status, msg = as_agent(server, tokens[case.token], case.method, case.path, case.body, case.ctype)
        if status != case.want or "evaluat" in msg:
            wrong.append(f"{case.what} ({case.token}): {status}, wanted {case.want}: {msg[:200]}")
    assert not wrong, "\n".join(wrong)
    node_a = json.loads(server.get(f"{NODES}/{A}")[1])
    ann = node_a["metadata"]["annotations"]
    assert er.REQUESTS in ann and er.decode_results(ann[er.RESULTS])[f"{TENANT}/on-a"].result == "evicted"
    assert "x" not in ann and not node_a["spec"].get("unschedulable")
    node_b = json.loads(server.get(f"{NODES}/{B}")[1])
    assert er.REQUESTS not in (node_b["metadata"].get("annotations") or {})
    assert server.get(f"{PODS}/on-b")[0] == 200
