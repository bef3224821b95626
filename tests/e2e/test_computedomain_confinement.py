"""ComputeDomains under the two-token rule, judged by the real kube-apiserver with NVIDIA's CRD installed and the
plain manifests (rbac.yaml, rbac-dra.yaml, admission-policy.yaml, computedomain-controller.yaml) applied:

- a node agent's bound token reports only on its OWN Node (the annotation nodeagent.io/computedomains), and
  can neither write another node's report nor any ResourceClaimTemplate, ComputeDomain or the controller's
  Lease;
- the controller's token (service account nodeagent-controller) writes exactly the templates, the domains'
  status and its Lease, and can write no Node, no ResourceSlice, no ResourceClaim and no domain's spec."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from nodeagent.computedomain.reconcile import REPORT_ANNOTATION
from tests.e2e.test_kube_confinement import slice_obj
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
from tests.integration._computedomain import install_crd
from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers

A, B = "cdconf-a", "cdconf-b"
TENANT = "cdconf-tenant"
NODES = "/api/v1/nodes"
CDS = f"/apis/resource.nvidia.com/v1beta1/namespaces/{TENANT}/computedomains"
ALL_CDS = "/apis/resource.nvidia.com/v1beta1/computedomains"
ALL_RCTS = "/apis/resource.k8s.io/v1/resourceclaimtemplates"
RCTS = f"/apis/resource.k8s.io/v1/namespaces/{TENANT}/resourceclaimtemplates"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/nodeagent/leases"
MERGE, JSON = "application/merge-patch+json", "application/json"
CTL = "controller"


def template(name: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [
                {"name": "channel", "exactly": {"deviceClassName": "imex-channel.nodeagent.io"}}]}}}}


def lease(name: str) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
            "spec": {"holderIdentity": "x", "leaseDurationSeconds": 15}}


def report(uid: str = "u1") -> dict[str, Any]:
    return {"metadata": {"annotations": {REPORT_ANNOTATION: json.dumps({uid: "Ready"})}}}


@dataclass(frozen=True)
class Case:
    what: str
    token: str  # A, B or CTL
    method: str
    path: str
    body: Any = None
    ctype: str = JSON
    want: int = 403


CASES: tuple[Case, ...] = (
    # the node agents: their own report only
    Case("report on its own Node", A, "PATCH", f"{NODES}/{A}", report(), MERGE, 200),
    Case("report on the other Node", A, "PATCH", f"{NODES}/{B}", report(), MERGE),
    Case("remove the other Node's report", B, "PATCH", f"{NODES}/{A}",
         {"metadata": {"annotations": {REPORT_ANNOTATION: None}}}, MERGE),
    Case("create a ResourceClaimTemplate", A, "POST", RCTS, template("by-agent")),
    Case("delete the domain's ResourceClaimTemplate", A, "DELETE", f"{RCTS}/cd-channel"),
    Case("write a ComputeDomain's status", A, "PATCH", f"{CDS}/cd/status",
         {"status": {"status": "Ready"}}, MERGE),
    Case("list ComputeDomains", A, "GET", CDS),
    Case("take the controller's Lease", A, "POST", LEASES, lease("nodeagent-controller")),
    # the controller: templates, status, its Lease; nothing of nodes, slices, claims or specs
    Case("list ComputeDomains", CTL, "GET", CDS, want=200),
    Case("write a ComputeDomain's status", CTL, "PATCH", f"{CDS}/cd/status",
         {"status": {"status": "NotReady"}}, MERGE, 200),
    Case("change a ComputeDomain's spec", CTL, "PATCH", f"{CDS}/cd", {"spec": {"numNodes": 3}}, MERGE),
    Case("delete a ComputeDomain", CTL, "DELETE", f"{CDS}/cd"),
    Case("create a ResourceClaimTemplate", CTL, "POST", RCTS, template("by-controller"), want=201),
    Case("delete a ResourceClaimTemplate", CTL, "DELETE", f"{RCTS}/by-controller", want=200),
    Case("list Nodes", CTL, "GET", NODES, want=200),
    # its watches (cluster-wide): the domains, the templates and the Nodes; the agents watch none of the first two
    Case("watch ComputeDomains", CTL, "GET", f"{ALL_CDS}?watch=true&timeoutSeconds=1", want=200),
    Case("watch ResourceClaimTemplates", CTL, "GET", f"{ALL_RCTS}?watch=true&timeoutSeconds=1", want=200),
    Case("watch Nodes", CTL, "GET", f"{NODES}?watch=true&timeoutSeconds=1", want=200),
    Case("watch ComputeDomains", A, "GET", f"{ALL_CDS}?watch=true&timeoutSeconds=1"),
    Case("watch ResourceClaimTemplates", A, "GET", f"{ALL_RCTS}?watch=true&timeoutSeconds=1"),
    Case("watch ResourceSlices", CTL, "GET", f"{SLICES}?watch=true&timeoutSeconds=1"),
    Case("label a Node", CTL, "PATCH", f"{NODES}/{A}", {"metadata": {"labels": {"x": "y"}}}, MERGE),
    Case("write a node's report", CTL, "PATCH", f"{NODES}/{A}", report("forged"), MERGE),
    Case("write a Node's status", CTL, "PATCH", f"{NODES}/{A}/status", {"status": {"capacity": {"x": "1"}}},
         MERGE),
    Case("create a ResourceSlice", CTL, "POST", SLICES, slice_obj("cdconf-x1", A)),
    Case("list ResourceSlices", CTL, "GET", SLICES),
    Case("create a ResourceClaim", CTL, "POST", f"/apis/resource.k8s.io/v1/namespaces/{TENANT}/resourceclaims",
         {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "x"},
          "spec": {"devices": {"requests": [{"name": "c", "exactly": {"deviceClassName": "x"}}]}}}),
    Case("read Secrets", CTL, "GET", "/api/v1/namespaces/nodeagent/secrets"),
    Case("create its Lease", CTL, "POST", LEASES, lease("nodeagent-controller"), want=201),
    Case("update its Lease", CTL, "PUT", f"{LEASES}/nodeagent-controller", None, want=200),
    Case("update another Lease", CTL, "PUT", f"{LEASES}/other", None),
)


def controller_token(server: KubeApiServer, account: str = "nodeagent-controller") -> str:
    req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}
    status, body = server.request(
        "POST", f"/api/v1/namespaces/nodeagent/serviceaccounts/{account}/token", req)
    assert status == 201, body
    token: str = json.loads(body)["status"]["token"]
    return token


def test_agents_report_only_their_own_node_controller_writes_only_its_objects(
        kube_apiserver: KubeApiServer) -> None:
    server = kube_apiserver
    install_crd(server)
    apply_rbac(server, crd=True, dra=True)
    paths = {**PATHS, ("apps/v1", "Deployment"): "/apis/apps/v1/namespaces/{ns}/deployments/{name}"}
    docs = [d for d in yaml.safe_load_all((MANIFESTS / "computedomain-controller.yaml").read_text())
            if d]
    assert {d["kind"] for d in docs} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                                         "RoleBinding", "DeviceClass", "Deployment"}
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in paths and doc["kind"] != "Deployment":
            status, body = apply(server, doc, dry_run=False)
            assert status in (200, 201), body
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "nodeagent-controller"
    for n in (A, B):
        make_node(server, n)
    server.request("POST", "/api/v1/namespaces",
                   {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TENANT}})
    for path in (f"{CDS}/cd", f"{RCTS}/cd-channel", f"{RCTS}/by-controller", f"{LEASES}/nodeagent-controller",
                 f"{LEASES}/other"):
        server.request("DELETE", path)
    status, raw = server.request("POST", CDS, {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain", "metadata": {"name": "cd"},
        "spec": {"channel": {"resourceClaimTemplate": {"name": "cd-channel"}}}})
    assert status == 201, raw
    assert server.request("POST", RCTS, template("cd-channel"))[0] == 201
    assert server.request("POST", LEASES, lease("other"))[0] == 201
    tokens = {A: bound_token(server, A), B: bound_token(server, B), CTL: controller_token(server)}
    wait_for_policy(server, tokens[A], B)
    wrong: list[str] = []
    for case in CASES:
        body = case.body
        if case.method == "PUT" and body is None:  # a Lease update: the stored object, holder changed
            code, raw = server.request("GET", case.path)
            body = json.loads(raw) if code == 200 else lease(case.path.rsplit("/", 1)[1])
            body.setdefault("spec", {})["holderIdentity"] = "controller-0"
        status, msg = as_agent(server, tokens[case.token], case.method, case.path, body, case.ctype)
        if status != case.want or "evaluat" in msg:
            wrong.append(f"{case.what} ({case.token}): {status}, wanted {case.want}: {msg[:200]}")
    assert not wrong, "\n".join(wrong)
    # what the refusals left as they were
    node_b = json.loads(server.get(f"{NODES}/{B}")[1])
    assert REPORT_ANNOTATION not in (node_b["metadata"].get("annotations") or {})
    node_a = json.loads(server.get(f"{NODES}/{A}")[1])
    assert json.loads(node_a["metadata"]["annotations"][REPORT_ANNOTATION]) == {"u1": "Ready"}
    cd = json.loads(server.get(f"{CDS}/cd")[1])
    assert cd["spec"].get("numNodes", 0) == 0 and cd["status"]["status"] == "NotReady"
    assert server.get(f"{RCTS}/cd-channel")[0] == 200 and server.get(f"{RCTS}/by-agent")[0] == 404
    assert server.get(f"{SLICES}/cdconf-x1")[0] == 404
