"""The admission policy and the ClusterRoles judged by the real kube-apiserver with the bound tokens of TWO nodes:
each node's agent may write its own node's ResourceSlices, GPU objects and Node metadata and the RuntimeClasses
in the one shape nodeagent writes them, and nothing of the other node; and, on every release, only the device
status of ResourceClaims allocated from its own node's pool (``CLAIM_CASES``). docs/security.md lists every
case of ``CASES`` and ``CLAIM_CASES`` in the same words (``test_docs_list_every_case``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent.dra.slices import taint_probe_body
from tests.e2e._agent import REPO
from tests.e2e.test_kube_manifests import apply_rbac, as_agent, bound_token, token_request
from tests.integration._releases import shared_release_apiserver
from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers

release_server = shared_release_apiserver  # the API server of each release, shared with other modules

A, B = "conf-a", "conf-b"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
RCS = "/apis/node.k8s.io/v1/runtimeclasses"
GPUS = "/apis/nodeagent.io/v1alpha1/gpus"
NODE_FEATURES = "/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/nodeagent/nodefeatures"
NODES = "/api/v1/nodes"
JSON, MERGE = "application/json", "application/merge-patch+json"
DRIVER = "gpu.nodeagent.io"
TENANT = "conf-tenant"

Body = Callable[[KubeApiServer], Any]


def slice_obj(name: str, node: str | None = A, driver: str = DRIVER, **placement: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": node or "shared", "generation": 1, "resourceSliceCount": 1},
        "devices": [{"name": "gpu-0"}],
        **placement,
    }
    if node is not None:
        spec["nodeName"] = node
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": spec,
    }


def nf_obj(name: str, node: str, owner: str) -> dict[str, Any]:
    """A NodeFeature as ``[publish] labels = "nodefeature"`` writes it (nodeagent/kube/nodefeature.py)."""
    return {
        "apiVersion": "nfd.k8s-sigs.io/v1alpha1",
        "kind": "NodeFeature",
        "metadata": {"name": name, "labels": {"nfd.node.kubernetes.io/node-name": node, **MANAGED},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": owner,
                                          "uid": "00000000-0000-0000-0000-000000000001"}]},
        "spec": {"labels": {"nvidia.com/gpu.count": "8"}},
    }


def rc_obj(name: str, handler: str, *, labels: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if labels is not None:
        meta["labels"] = labels
    return {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": meta,
        "handler": handler,
        **extra,
    }


def gpu_obj(name: str, label: str, node: str, owner: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"nodeagent.io/node": label}}
    if owner is not None:
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": owner, "uid": "00000000-0000-0000-0000-000000000001"}
        ]
    return {
        "apiVersion": "nodeagent.io/v1alpha1",
        "kind": "GPU",
        "metadata": meta,
        "spec": {"index": 0, "uuid": f"GPU-{name}", "nodeName": node},
    }


def stored_slice_with_two_devices(name: str) -> Body:
    """The slice as stored, with one more device: what a replace (PUT) of the publisher sends."""

    def body(server: KubeApiServer) -> Any:
        status, raw = server.get(f"{SLICES}/{name}")
        assert status == 200, raw
        obj = json.loads(raw)
        obj["spec"]["devices"] = [{"name": "gpu-0"}, {"name": "gpu-1"}]
        return obj

    return body


LEASES = "/apis/coordination.k8s.io/v1/namespaces/nodeagent/leases"
SLOT, EXPIRED, POOL = "nf-slot-conf-0000", "nf-slot-conf-0001", "nf-pool-conf"


def now_micro(shift_s: float = 0.0) -> str:
    from datetime import datetime, timedelta, timezone

    return (datetime.now(timezone.utc) + timedelta(seconds=shift_s)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease(name: str, holder: str | None, **spec: Any) -> dict[str, Any]:
    """A fleet Lease as nodeagent.fleet.leases writes it (``holder`` None: no holderIdentity)."""
    body: dict[str, Any] = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
                            "spec": dict(spec)}
    if holder is not None:
        body["spec"]["holderIdentity"] = holder
    return body


def slot(name: str, holder: str) -> Body:
    """A slot taken now for ``holder`` for 60 s."""
    return lambda _: lease(name, holder, leaseDurationSeconds=60, acquireTime=now_micro(), renewTime=now_micro())


def stored_lease(name: str, holder: str | None, **spec: Any) -> Body:
    """The stored Lease (its resourceVersion) with ``holder`` (None: cleared) and ``spec`` changed, times now."""

    def body(server: KubeApiServer) -> Any:
        status, raw = server.get(f"{LEASES}/{name}")
        assert status == 200, raw
        obj = json.loads(raw)
        obj["spec"].pop("holderIdentity", None)
        if holder is not None:
            obj["spec"]["holderIdentity"] = holder
        obj["spec"].update({k: now_micro() if v == "now" else v for k, v in spec.items()})
        return obj

    return body


def brake_cleared(server: KubeApiServer) -> Any:
    obj = json.loads(server.get(f"{LEASES}/{POOL}")[1])
    obj["metadata"]["annotations"].update({"nodeagent.io/fleet-brake": "off", "nodeagent.io/fleet-failures": "0"})
    return obj


MANAGED = {"app.kubernetes.io/managed-by": "nodeagent"}
SELECTOR_A = {
    "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [A]}]}]
}


@dataclass(frozen=True)
class Case:
    what: str
    token: str  # A, B or "unbound" (a nodeagent token without a node claim)
    method: str
    path: str
    body: Any = None
    ctype: str = JSON
    want: int = 403


# Run in this order, each on what the ones before left (the setup is in ``cluster``).
CASES: tuple[Case, ...] = (
    # ResourceSlices
    Case("create a ResourceSlice of its node and driver", A, "POST", SLICES, slice_obj(f"{A}-new"), want=201),
    Case("create a ResourceSlice for another node", A, "POST", SLICES, slice_obj("x1", B)),
    Case(
        "create a ResourceSlice of another driver (gpu.nvidia.com) for its node",
        A,
        "POST",
        SLICES,
        slice_obj("x2", A, "gpu.nvidia.com"),
    ),
    Case(
        "create a ResourceSlice with allNodes: true", A, "POST", SLICES, slice_obj("x3", None, allNodes=True)
    ),
    Case(
        "create a ResourceSlice with a nodeSelector naming its node",
        A,
        "POST",
        SLICES,
        slice_obj("x4", None, nodeSelector=SELECTOR_A),
    ),
    Case(
        "replace (update) its own ResourceSlice",
        A,
        "PUT",
        f"{SLICES}/{A}-new",
        stored_slice_with_two_devices(f"{A}-new"),
        want=200,
    ),
    Case(
        "replace (update) another node's ResourceSlice",
        A,
        "PUT",
        f"{SLICES}/{B}-gpu",
        stored_slice_with_two_devices(f"{B}-gpu"),
    ),
    Case("delete another driver's ResourceSlice of its node", A, "DELETE", f"{SLICES}/{A}-nvidia"),
    Case("delete another node's ResourceSlice", A, "DELETE", f"{SLICES}/{B}-gpu"),
    Case("delete its own ResourceSlice", B, "DELETE", f"{SLICES}/{B}-gpu", want=200),
    Case(
        "create a ResourceSlice with a token without node claim",
        "unbound",
        "POST",
        SLICES,
        slice_obj("x5", A),
    ),
    Case("delete its own ResourceSlice", A, "DELETE", f"{SLICES}/{A}-new", want=200),
    # the remediation's question whether the API server keeps device taints: a dry run, nothing stored
    Case("dry-run create of the device-taint probe ResourceSlice of its node", A, "POST", f"{SLICES}?dryRun=All",
         taint_probe_body(A), want=201),
    Case("dry-run create of the device-taint probe ResourceSlice of another node", A, "POST",
         f"{SLICES}?dryRun=All", taint_probe_body(B)),
    # ResourceClaims: read one by name (RBAC cannot narrow a get to a node's pods), never list or watch
    Case(
        "read a ResourceClaim by name, in any namespace (what remains)",
        A,
        "GET",
        f"{CLAIMS.format(ns=TENANT)}/tenant-claim",
        want=200,
    ),
    Case("list ResourceClaims", A, "GET", CLAIMS.format(ns=TENANT)),
    Case("list ResourceClaims of all namespaces", A, "GET", "/apis/resource.k8s.io/v1/resourceclaims"),
    Case("watch ResourceClaims", A, "GET", f"{CLAIMS.format(ns=TENANT)}?watch=true"),
    # RuntimeClasses (nvidia exists with handler nvidia, unlabelled; nvidia-cdi with the wrong handler runc)
    Case(
        "add nodeagent's label to RuntimeClass nvidia",
        A,
        "PATCH",
        f"{RCS}/nvidia",
        {"metadata": {"labels": MANAGED}},
        MERGE,
        200,
    ),
    Case(
        "add another label to RuntimeClass nvidia",
        A,
        "PATCH",
        f"{RCS}/nvidia",
        {"metadata": {"labels": {"team": "x"}}},
        MERGE,
    ),
    Case(
        "set scheduling.nodeSelector of RuntimeClass nvidia",
        B,
        "PATCH",
        f"{RCS}/nvidia",
        {"scheduling": {"nodeSelector": {"kubernetes.io/hostname": B}}},
        MERGE,
    ),
    Case(
        "set scheduling.tolerations of RuntimeClass nvidia",
        B,
        "PATCH",
        f"{RCS}/nvidia",
        {"scheduling": {"tolerations": [{"operator": "Exists"}]}},
        MERGE,
    ),
    Case(
        "set overhead of RuntimeClass nvidia",
        B,
        "PATCH",
        f"{RCS}/nvidia",
        {"overhead": {"podFixed": {"memory": "64Gi"}}},
        MERGE,
    ),
    Case(
        "annotate RuntimeClass nvidia",
        B,
        "PATCH",
        f"{RCS}/nvidia",
        {"metadata": {"annotations": {"a": "b"}}},
        MERGE,
    ),
    Case("delete RuntimeClass nvidia whose handler is right", A, "DELETE", f"{RCS}/nvidia"),
    Case("delete RuntimeClass nvidia-cdi whose handler is wrong", A, "DELETE", f"{RCS}/nvidia-cdi", want=200),
    Case(
        "create RuntimeClass nvidia-cdi with handler runc",
        B,
        "POST",
        RCS,
        rc_obj("nvidia-cdi", "runc", labels=MANAGED),
    ),
    Case(
        "create RuntimeClass nvidia-cdi with a scheduling.nodeSelector",
        B,
        "POST",
        RCS,
        rc_obj("nvidia-cdi", "nvidia-cdi", labels=MANAGED, scheduling={"nodeSelector": {"x": "y"}}),
    ),
    Case(
        "create RuntimeClass nvidia-cdi as nodeagent does (its handler, its label)",
        B,
        "POST",
        RCS,
        rc_obj("nvidia-cdi", "nvidia-cdi", labels=MANAGED),
        want=201,
    ),
    Case("create a RuntimeClass of another name", A, "POST", RCS, rc_obj("gvisor2", "runsc")),
    Case("delete a RuntimeClass of another name", A, "DELETE", f"{RCS}/gvisor"),
    # Nodes
    Case(
        "label its own Node (nvidia.com/gpu.count)",
        A,
        "PATCH",
        f"{NODES}/{A}",
        {"metadata": {"labels": {"nvidia.com/gpu.count": "8"}}},
        MERGE,
        200,
    ),
    Case(
        "label its own Node (nvidia.com/gpu.count)",
        B,
        "PATCH",
        f"{NODES}/{B}",
        {"metadata": {"labels": {"nvidia.com/gpu.count": "4"}}},
        MERGE,
        200,
    ),
    Case(
        "label the other Node",
        A,
        "PATCH",
        f"{NODES}/{B}",
        {"metadata": {"labels": {"nvidia.com/gpu.count": "0"}}},
        MERGE,
    ),
    Case(
        "label the other Node",
        B,
        "PATCH",
        f"{NODES}/{A}",
        {"metadata": {"labels": {"nvidia.com/gpu.count": "0"}}},
        MERGE,
    ),
    Case(
        "label its own Node node-role.kubernetes.io/control-plane",
        A,
        "PATCH",
        f"{NODES}/{A}",
        {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}},
        MERGE,
    ),
    Case(
        "label its own Node node-restriction.kubernetes.io/gpu",
        A,
        "PATCH",
        f"{NODES}/{A}",
        {"metadata": {"labels": {"node-restriction.kubernetes.io/gpu": "true"}}},
        MERGE,
    ),
    Case(
        "label its own Node example.node-restriction.kubernetes.io/tier",
        A,
        "PATCH",
        f"{NODES}/{A}",
        {"metadata": {"labels": {"example.node-restriction.kubernetes.io/tier": "gold"}}},
        MERGE,
    ),
    Case(
        "remove kubernetes.io/hostname from its own Node",
        A,
        "PATCH",
        f"{NODES}/{A}",
        {"metadata": {"labels": {"kubernetes.io/hostname": None}}},
        MERGE,
    ),
    Case(
        "add a finalizer to its own Node",
        A,
        "PATCH",
        f"{NODES}/{A}",
        {"metadata": {"finalizers": ["x.io/hold"]}},
        MERGE,
    ),
    Case(
        "add an ownerReference to its own Node",
        A,
        "PATCH",
        f"{NODES}/{A}",
        {
            "metadata": {
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": B,
                        "uid": "00000000-0000-0000-0000-000000000002",
                    }
                ]
            }
        },
        MERGE,
    ),
    # GPU objects (conf-mixed is labelled conf-a but its spec.nodeName is conf-b)
    Case(
        "create a GPU object labelled with its node for another spec.nodeName",
        A,
        "POST",
        GPUS,
        gpu_obj("x6", A, B),
    ),
    Case(
        "change a GPU object labelled with its node whose spec.nodeName is another",
        A,
        "PATCH",
        f"{GPUS}/conf-mixed",
        {"metadata": {"labels": {"x": "y"}}},
        MERGE,
    ),
    Case(
        "delete a GPU object labelled with its node whose spec.nodeName is another",
        A,
        "DELETE",
        f"{GPUS}/conf-mixed",
    ),
    Case("create its own GPU object owned by another Node", A, "POST", GPUS, gpu_obj("x7", A, A, owner=B)),
    Case(
        "create its own GPU object owned by its Node",
        A,
        "POST",
        GPUS,
        gpu_obj(f"{A}-gpu1", A, A, owner=A),
        want=201,
    ),
    Case(
        "change the other node's GPU object",
        B,
        "PATCH",
        f"{GPUS}/{A}-gpu0",
        {"metadata": {"labels": {"x": "y"}}},
        MERGE,
    ),
    Case(
        "change its own GPU object",
        B,
        "PATCH",
        f"{GPUS}/{B}-gpu0",
        {"metadata": {"labels": {"x": "y"}}},
        MERGE,
        200,
    ),
    # the fleet's Leases (docs/fleet.md): slots, requests in line, the pool's brake
    Case("take a free slot for itself", A, "POST", LEASES, slot(SLOT, A), want=201),
    Case("take a slot for another node", A, "POST", LEASES, slot("nf-slot-conf-0002", B)),
    Case("extend another node's live slot", B, "PUT", f"{LEASES}/{SLOT}", stored_lease(SLOT, A, renewTime="now")),
    Case("take another node's live slot", B, "PUT", f"{LEASES}/{SLOT}",
         stored_lease(SLOT, B, acquireTime="now", renewTime="now")),
    Case("release another node's slot", B, "PUT", f"{LEASES}/{SLOT}", stored_lease(SLOT, None)),
    Case("delete another node's slot", B, "DELETE", f"{LEASES}/{SLOT}"),
    Case("renew its own slot", A, "PUT", f"{LEASES}/{SLOT}", stored_lease(SLOT, A, renewTime="now"), want=200),
    Case("release its own slot", A, "PUT", f"{LEASES}/{SLOT}", stored_lease(SLOT, None), want=200),
    Case("take a released slot for itself", B, "PUT", f"{LEASES}/{SLOT}",
         stored_lease(SLOT, B, acquireTime="now", renewTime="now"), want=200),
    Case("take an expired slot of another node for itself", A, "PUT", f"{LEASES}/{EXPIRED}",
         stored_lease(EXPIRED, A, acquireTime="now", renewTime="now"), want=200),
    Case("enter the line with its own request", A, "POST", LEASES,
         lease(f"nf-q-conf-0-0000000000001-{A}", A), want=201),
    Case("enter the line in another node's name", A, "POST", LEASES, lease(f"nf-q-conf-0-0000000000001-{B}", B)),
    Case("clear the brake of a pool", A, "PUT", f"{LEASES}/{POOL}", brake_cleared),
    Case("delete a pool", A, "DELETE", f"{LEASES}/{POOL}"),
    Case("create another Lease in the namespace", A, "POST", LEASES, lease("leader", A)),
    # NodeFeatures ([publish] labels = "nodefeature"; NFD applies their labels to the node they name)
    Case("create its NodeFeature", A, "POST", NODE_FEATURES, nf_obj(f"nodeagent-{A}", A, A), want=201),
    Case("create a NodeFeature for the other node", A, "POST", NODE_FEATURES, nf_obj(f"nodeagent-{B}", B, B)),
    Case("create its NodeFeature naming the other node", B, "POST", NODE_FEATURES, nf_obj(f"nodeagent-{B}", A, B)),
    Case("delete the other node's NodeFeature", B, "DELETE", f"{NODE_FEATURES}/nodeagent-{A}"),
    Case("delete its NodeFeature", A, "DELETE", f"{NODE_FEATURES}/nodeagent-{A}", want=200),
)


def admin(
    server: KubeApiServer, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200, 201)
) -> None:
    status, raw = server.request(method, path, body, content_type=MERGE if method == "PATCH" else JSON)
    assert status in ok, (method, path, status, raw[:300])


def cluster(server: KubeApiServer) -> dict[str, str]:
    """Both nodes, their slices and GPU objects, the RuntimeClasses and a tenant's claim; the two nodes' tokens."""
    from tests.e2e.test_run_cluster import make_node

    apply_rbac(server, crd=True, dra=True, fleet=True, nodefeature=True)
    for n in (A, B):
        make_node(server, n)
        admin(server, "PATCH", f"{NODES}/{n}", {"metadata": {"labels": {"kubernetes.io/hostname": n}}})
    for name in (f"{A}-new", f"{A}-nvidia", f"{B}-gpu", "x1", "x2", "x3", "x4", "x5"):
        server.request("DELETE", f"{SLICES}/{name}")
    admin(server, "POST", SLICES, slice_obj(f"{B}-gpu", B))
    admin(server, "POST", SLICES, slice_obj(f"{A}-nvidia", A, "gpu.nvidia.com"))
    for rc in ("nvidia", "nvidia-cdi", "gvisor", "gvisor2"):
        server.request("DELETE", f"{RCS}/{rc}")
    admin(server, "POST", RCS, rc_obj("nvidia", "nvidia"))
    admin(server, "POST", RCS, rc_obj("nvidia-cdi", "runc"))
    admin(server, "POST", RCS, rc_obj("gvisor", "runsc"))
    for name in ("conf-mixed", f"{A}-gpu0", f"{A}-gpu1", f"{B}-gpu0", "x6", "x7"):
        server.request("DELETE", f"{GPUS}/{name}")
    crd = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/gpus.nodeagent.io"
    deadline = time.monotonic() + 20
    while not any(
        c["type"] == "Established" and c["status"] == "True"
        for c in json.loads(server.get(crd)[1]).get("status", {}).get("conditions", [])
    ):
        assert time.monotonic() < deadline, "GPU CRD never established"
        time.sleep(0.2)
    for obj in (gpu_obj("conf-mixed", A, B), gpu_obj(f"{A}-gpu0", A, A), gpu_obj(f"{B}-gpu0", B, B)):
        deadline = time.monotonic() + 20
        while (status := server.request("POST", GPUS, obj)[0]) == 429 and time.monotonic() < deadline:
            time.sleep(0.2)  # a freshly served CRD may answer 429 for a moment
        assert status == 201, status
    install_nfd_crds(server)
    server.request("DELETE", f"{NODE_FEATURES}/nodeagent-{A}")
    server.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TENANT}}
    )
    server.request("DELETE", f"{CLAIMS.format(ns=TENANT)}/tenant-claim")
    admin(
        server,
        "POST",
        CLAIMS.format(ns=TENANT),
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "tenant-claim"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        },
    )
    for name in (SLOT, EXPIRED, POOL, "nf-slot-conf-0002", f"nf-q-conf-0-0000000000001-{A}",
                 f"nf-q-conf-0-0000000000001-{B}", "leader"):
        server.request("DELETE", f"{LEASES}/{name}")
    admin(server, "POST", LEASES, lease(EXPIRED, B, leaseDurationSeconds=5, acquireTime=now_micro(-120),
                                        renewTime=now_micro(-120)))
    pool = lease(POOL, None, renewTime=now_micro())
    pool["metadata"]["annotations"] = {"nodeagent.io/fleet-brake": "on", "nodeagent.io/fleet-failures": "3"}
    admin(server, "POST", LEASES, pool)
    tokens = {A: bound_token(server, A), B: bound_token(server, B), "unbound": token_request(server)}
    # the policy as this file has it takes effect once the API server has loaded it: probe with a refusal
    # the policy's earlier versions did not make
    probe = {"metadata": {"labels": {"node-role.kubernetes.io/probe": ""}}}
    deadline = time.monotonic() + 30
    while as_agent(server, tokens[A], "PATCH", f"{NODES}/{A}", probe)[0] != 403:
        assert time.monotonic() < deadline, "the admission policy never refused a node-role label"
        time.sleep(0.2)
        admin(
            server, "PATCH", f"{NODES}/{A}", {"metadata": {"labels": {"node-role.kubernetes.io/probe": None}}}
        )
    return tokens


def install_nfd_crds(server: KubeApiServer) -> None:
    """NFD's CRDs as released (tests/testbin/setup.sh fetches them), served before the cases run."""
    from tests.peers._resolve import peer_file

    crds = peer_file("NODEAGENT_NFD_CRD", "nodeagent_peers_nfd_crd", "NFD's CRDs (Go module proxy)")
    for doc in yaml.safe_load_all(crds.read_text()):
        if doc:
            server.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", doc)
    deadline = time.monotonic() + 20
    while server.get(NODE_FEATURES)[0] != 200:
        assert time.monotonic() < deadline, "NFD's NodeFeature CRD never served"
        time.sleep(0.2)


def test_two_nodes_each_confined_to_its_own(kube_apiserver: KubeApiServer) -> None:
    tokens = cluster(kube_apiserver)
    wrong: list[str] = []
    for case in CASES:
        body = case.body(kube_apiserver) if callable(case.body) else case.body
        status, msg = as_agent(kube_apiserver, tokens[case.token], case.method, case.path, body, case.ctype)
        if status != case.want or "evaluat" in msg:  # a refusal by a failing expression proves nothing
            wrong.append(f"{case.what} ({case.token}): {status}, wanted {case.want}: {msg[:200]}")
    assert not wrong, "\n".join(wrong)
    assert len(CASES) >= 45
    # what the refusals left as it was
    assert kube_apiserver.get(f"{SLICES}/{A}-nvidia")[0] == 200
    for name in ("x1", "x2", "x3", "x4", "x5"):
        assert kube_apiserver.get(f"{SLICES}/{name}")[0] == 404
    rc = json.loads(kube_apiserver.get(f"{RCS}/nvidia")[1])
    assert rc["handler"] == "nvidia" and "scheduling" not in rc and "overhead" not in rc
    assert rc["metadata"]["labels"] == MANAGED
    assert json.loads(kube_apiserver.get(f"{RCS}/nvidia-cdi")[1])["handler"] == "nvidia-cdi"
    node = json.loads(kube_apiserver.get(f"{NODES}/{A}")[1])
    assert not node["metadata"].get("finalizers") and not node["metadata"].get("ownerReferences")
    assert not any(
        k.startswith(("node-role.", "node-restriction.")) or ".node-restriction." in k
        for k in node["metadata"]["labels"]
    )
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == A
    assert (
        json.loads(kube_apiserver.get(f"{NODES}/{B}")[1])["metadata"]["labels"]["nvidia.com/gpu.count"] == "4"
    )
    assert kube_apiserver.get(f"{GPUS}/conf-mixed")[0] == 200
    assert kube_apiserver.get(f"{GPUS}/x6")[0] == 404 and kube_apiserver.get(f"{GPUS}/x7")[0] == 404


# -- ResourceClaims, on every release ----------------------------------------------------------------------
# node-a's pool holds gpu-0 (of the driver gpu.nodeagent.io and of gpu.nvidia.com), node-b's gpu-0 and gpu-1.
# "own" is allocated from node-a's pool (a device of each driver, node-a's pod in status.reservedFor, the
# other driver's entry in status.devices), "other" from node-b's pool for node-b's pod, "new" not at all;
# "mixed" holds node-b's gpu-1 under a node selector naming node-a (what an allocator could write for a
# slice that node-a published in a pool named after node-b, before the policy refused such slices).
CA, CB = "claim-a", "claim-b"
CLAIM_NS = "claim-tenant"
NVIDIA = "gpu.nvidia.com"
Claim = dict[str, Any]


def on_node(node: str) -> dict[str, Any]:
    return {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}


def allocation(node: str, device: str = "gpu-0", *, nvidia: bool = False, selector: str = "") -> dict[str, Any]:
    """As a scheduler writes it: the devices of ``node``'s pool, the node selector naming ``node`` (or
    ``selector``)."""
    results = [{"request": "gpu", "driver": DRIVER, "pool": node, "device": device}]
    if nvidia:
        results.append({"request": "other", "driver": NVIDIA, "pool": node, "device": "gpu-0"})
    return {"devices": {"results": results}, "nodeSelector": on_node(selector or node)}


def consumer(pod: str) -> dict[str, str]:
    return {"resource": "pods", "name": pod, "uid": f"00000000-0000-0000-0000-{sum(map(ord, pod)):012d}"}


def entry(node: str, driver: str = DRIVER, device: str = "gpu-0", uuid: str = "GPU-0") -> dict[str, Any]:
    return {"driver": driver, "pool": node, "device": device, "data": {"uuid": uuid}}


def set_status(**status: Any) -> Callable[[Claim], Claim]:
    def change(claim: Claim) -> Claim:
        claim["status"] = {**claim.get("status", {}), **status}
        return claim

    return change


def replace_status(status: dict[str, Any]) -> Callable[[Claim], Claim]:
    def change(claim: Claim) -> Claim:
        claim["status"] = status
        return claim

    return change


def add_consumer(claim: Claim) -> Claim:
    claim["status"]["reservedFor"] = [*claim["status"]["reservedFor"], consumer("second-pod")]
    return claim


def change_nvidia_entry(claim: Claim) -> Claim:
    claim["status"]["devices"] = [{**e, "data": {"uuid": "GPU-changed"}} if e["driver"] == NVIDIA else e
                                  for e in claim["status"]["devices"]]
    return claim


@dataclass(frozen=True)
class ClaimCase:
    what: str
    token: str  # CA, CB or "unbound"
    claim: str  # own, other, new, mixed; "" for the ResourceSlice case
    change: Callable[[Claim], Claim] | None  # of the stored claim, PUT to its status; None: ClaimStatusWriter
    want: int = 403
    # refused by the API server itself from 1.36 (DRAResourceClaimGranularStatusAuthorization: the role has
    # no resourceclaims/binding, and resourceclaims/driver only for its driver and node), before admission:
    # 422 naming that synthetic subresource
    native: bool = False

    def wanted(self, minor: int) -> int:
        return 422 if self.native and minor >= 36 else self.want


# Run in this order, each on what the ones before left (the setup is in ``claim_cluster``).
CLAIM_CASES: tuple[ClaimCase, ...] = (
    ClaimCase("write status.devices of a claim allocated from its pool, as the driver does", CA, "own", None,
              want=200),
    ClaimCase("write status.devices of a claim allocated from its pool", CB, "other",
              set_status(devices=[entry(CB, uuid="GPU-b0")]), want=200),
    ClaimCase("allocate an unallocated claim to another node's device", CA, "new",
              set_status(allocation=allocation(CB, "gpu-1")), native=True),
    ClaimCase("add a pod to status.reservedFor of a claim allocated from its pool", CA, "own", add_consumer, native=True),
    ClaimCase("write status.devices of another node's claim", CA, "other",
              set_status(devices=[entry(CB, uuid="GPU-from-a")]), native=True),
    ClaimCase("write status.devices of another node's device in a claim whose node selector names its node", CA,
              "mixed", set_status(devices=[entry(CB, device="gpu-1", uuid="GPU-from-a")])),
    ClaimCase("change another driver's status.devices entry of a claim allocated from its pool", CA, "own",
              change_nvidia_entry, native=True),
    ClaimCase("write status.devices of node-a's claim with a token without node claim", "unbound", "own",
              set_status(devices=[entry(CA, NVIDIA, uuid="GPU-nv0"), entry(CA, uuid="GPU-unbound")]), native=True),
    ClaimCase("empty the status (status: {}) of another node's reserved claim", CA, "other", replace_status({}), native=True),
    ClaimCase("empty the status (status: {}) of a claim allocated from its pool", CA, "own", replace_status({}), native=True),
    ClaimCase("create a ResourceSlice of its node in a pool named after another node", CA, "", None),
)
CLAIM_NAMES = {"own": "claim-own", "other": "claim-other", "new": "claim-new", "mixed": "claim-mixed"}
POOL_SLICE = f"{CA}-pool-{CB}"  # what the ResourceSlice case tries to create


def pool_slice() -> dict[str, Any]:
    obj = slice_obj(POOL_SLICE, CA)
    obj["spec"]["pool"]["name"] = CB
    return obj


def claim_cluster(server: KubeApiServer, tmp: Path) -> tuple[dict[str, str], dict[str, Claim]]:
    """Two nodes with their pools, the three claims allocated as a scheduler would; the tokens (and node-a's
    kubeconfig, for the agent's own writer). Returns the tokens and the claims as stored."""
    from tests.e2e.test_kube_manifests import service_account_kubeconfig
    from tests.e2e.test_run_cluster import make_node

    apply_rbac(server, dra=True)
    for n in (CA, CB):
        make_node(server, n)
    for name in (f"{CA}-gpu", f"{CA}-nvidia", f"{CB}-gpu", POOL_SLICE):
        server.request("DELETE", f"{SLICES}/{name}")
    for obj in (slice_obj(f"{CA}-gpu", CA), slice_obj(f"{CA}-nvidia", CA, NVIDIA), slice_obj(f"{CB}-gpu", CB)):
        admin(server, "POST", SLICES, obj)
    server.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": CLAIM_NS}}
    )
    claims = CLAIMS.format(ns=CLAIM_NS)
    status = {
        "own": {"allocation": allocation(CA, nvidia=True), "reservedFor": [consumer("pod-on-a")],
                "devices": [entry(CA, NVIDIA, uuid="GPU-nv0")]},
        "other": {"allocation": allocation(CB), "reservedFor": [consumer("pod-on-b")]},
        "new": {},
        "mixed": {"allocation": allocation(CB, "gpu-1", selector=CA), "reservedFor": [consumer("pod-on-a")]},
    }
    stored: dict[str, Claim] = {}
    for key, name in CLAIM_NAMES.items():
        server.request("DELETE", f"{claims}/{name}")
        requests = [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}},
                    {"name": "other", "exactly": {"deviceClassName": NVIDIA}}]
        code, raw = server.request("POST", claims, {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": requests}}})
        assert code == 201, raw
        claim = json.loads(raw)
        if status[key]:
            claim["status"] = status[key]
            code, raw = server.request("PUT", f"{claims}/{name}/status", claim)
            assert code == 200, raw
        stored[key] = json.loads(raw)
    kubeconfig = service_account_kubeconfig(server, tmp / "agent-kubeconfig", CA)
    tokens = {CA: yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"], CB: bound_token(server, CB),
              "unbound": token_request(server), "kubeconfig": str(kubeconfig)}
    # the policy as this file has it takes effect once the API server has loaded it: probe (dry run) with a
    # refusal the policy's earlier versions did not make
    deadline = time.monotonic() + 30
    while as_agent(server, tokens[CA], "POST", f"{SLICES}?dryRun=All", pool_slice(), JSON)[0] != 403:
        assert time.monotonic() < deadline, "the admission policy never refused a slice of another node's pool"
        time.sleep(0.2)
    return tokens, stored


def test_claim_status_only_its_pools_device_status_on_every_release(release_server: KubeApiServer,
                                                                       tmp_path: Path) -> None:
    """ResourceClaim status writes with the agent's role (rbac-dra.yaml) and the policy, on each release: a
    node's token writes status.devices of claims allocated from its own pool, through nodeagent's own writer;
    never an allocation or a reservation, another node's claim, another driver's entry, nor without a node
    claim. Refusals leave the claims as they were."""
    from nodeagent.dra.status import ClaimStatusWriter
    from nodeagent.kube.client import KubeClient, connect

    server = release_server
    minor = int(server.version.split(".")[1])
    tokens, stored = claim_cluster(server, tmp_path)
    claims = CLAIMS.format(ns=CLAIM_NS)
    ours = entry(CA, uuid="GPU-a0") | {"data": {"uuid": "GPU-a0", "gpuIndex": 0}}
    wrong: list[str] = []
    answers: dict[str, int] = {}
    for case in CLAIM_CASES:
        if not case.claim:  # the ResourceSlice
            status, msg = as_agent(server, tokens[case.token], "POST", SLICES, pool_slice(), JSON)
        elif case.change is None:  # nodeagent's own writer, with the agent's kubeconfig
            kube = KubeClient(connect(Path(tokens["kubeconfig"])))
            try:
                own = stored["own"]
                wrote = ClaimStatusWriter(kube, DRIVER).write(CLAIM_NS, own["metadata"]["name"],
                                                              own["metadata"]["uid"], [ours])
            finally:
                kube.close()
            status, msg = (200, "") if wrote else (403, "ClaimStatusWriter did not write (see the log)")
        else:
            name = CLAIM_NAMES[case.claim]
            code, raw = server.get(f"{claims}/{name}")
            assert code == 200, raw
            body = case.change(json.loads(raw))
            status, msg = as_agent(server, tokens[case.token], "PUT", f"{claims}/{name}/status", body, JSON)
        answers[f"{case.what} ({case.token})"] = status
        want = case.wanted(minor)
        # a refusal by a failing expression proves nothing; the API server's own names its subresource
        if status != want or "evaluat" in msg or (status == 422 and "requires resource=\"resourceclaims/" not in msg):
            wrong.append(f"{case.what} ({case.token}): {status}, wanted {want}: {msg[:300]}")
    print(json.dumps({"release": server.version, "answers": answers}))
    assert not wrong, f"{server.version}:\n" + "\n".join(wrong)
    # what the refusals left as it was, and what the two writes wrote
    now = {key: json.loads(server.get(f"{claims}/{name}")[1]) for key, name in CLAIM_NAMES.items()}
    for key in ("own", "other", "mixed"):
        for field in ("allocation", "reservedFor"):
            assert now[key]["status"][field] == stored[key]["status"][field], (key, field)
    assert "devices" not in now["mixed"]["status"], now["mixed"]
    assert "status" not in now["new"] or not now["new"]["status"].get("allocation"), now["new"]
    def devices(claim: Claim) -> list[dict[str, Any]]:
        return [{k: v for k, v in e.items() if v is not None} for e in claim["status"].get("devices", [])]

    assert devices(now["own"]) == [entry(CA, NVIDIA, uuid="GPU-nv0"), ours]
    assert devices(now["other"]) == [entry(CB, uuid="GPU-b0")]
    assert server.get(f"{SLICES}/{POOL_SLICE}")[0] == 404


def readme_row(case: Case) -> str:
    who = {A: "node-a", B: "node-b", "unbound": "none"}[case.token]
    verdict = "allowed" if case.want < 300 else "refused"
    return f"| {case.what} | {who} | {case.want} {verdict} |"


def claim_row(case: ClaimCase) -> tuple[str, str]:
    """The start and the end of the case's row in docs/security.md: what, whose token; the answers now on
    1.34/1.35 and on 1.36/1.37 (the columns between: before this policy)."""
    who = {CA: "node-a", CB: "node-b", "unbound": "none"}[case.token]

    def answer(status: int) -> str:
        return f"{status} allowed" if status < 300 else f"{status} refused"

    return f"| {case.what} | {who} |", f"| {answer(case.wanted(35))} | {answer(case.wanted(36))} |"


def test_docs_list_every_case() -> None:
    security = (REPO / "docs/security.md").read_text()
    missing = [readme_row(c) for c in CASES if readme_row(c) not in security]
    lines = security.splitlines()
    for case in CLAIM_CASES:
        start, end = claim_row(case)
        if not any(line.startswith(start) and line.endswith(end) for line in lines):
            missing.append(f"{start} ... {end}")
    assert not missing, "docs/security.md lacks:\n" + "\n".join(missing)
