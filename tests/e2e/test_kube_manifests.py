"""packaging/kubernetes/: every manifest is accepted by the real kube-apiserver (server-side apply, dry run,
strict field validation), and the ClusterRole with the admission policy grants what the agent needs and
nothing more: with a token bound to a pod on its node, the agent changes its own Node and nothing of another.
"""

from __future__ import annotations

import json
import re
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e._agent import REPO
from tests.peers.apiserver import KubeApiServer
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

MANIFESTS = REPO / "packaging/kubernetes"
ORDER = ("namespace.yaml", "gpu-crd.yaml", "rbac.yaml", "admission-policy.yaml", "configmap.yaml", "daemonset.yaml")
# what the DRA plane (plane "dra" or "both") needs besides: the chart renders them with plane dra or both only
DRA_ORDER = ("rbac-dra.yaml", "deviceclass.yaml")
RBAC_KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
              "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")

PATHS = {
    ("v1", "Namespace"): "/api/v1/namespaces/{name}",
    ("v1", "ServiceAccount"): "/api/v1/namespaces/{ns}/serviceaccounts/{name}",
    ("v1", "ConfigMap"): "/api/v1/namespaces/{ns}/configmaps/{name}",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "/apis/rbac.authorization.k8s.io/v1/clusterroles/{name}",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"):
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{name}",
    ("rbac.authorization.k8s.io/v1", "Role"): "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/{name}",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"):
        "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/{name}",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"):
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{name}",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"):
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings/{name}",
    ("apps/v1", "DaemonSet"): "/apis/apps/v1/namespaces/{ns}/daemonsets/{name}",
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"):
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}",
    ("resource.k8s.io/v1", "DeviceClass"): "/apis/resource.k8s.io/v1/deviceclasses/{name}",
}


def documents(names: tuple[str, ...] = ORDER) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in names:
        path = MANIFESTS / name
        if not path.exists():
            pytest.fail(f"{path} is missing", pytrace=False)
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def apply(server: KubeApiServer, doc: dict[str, Any], *, dry_run: bool) -> tuple[int, dict[str, Any]]:
    template = PATHS[(doc["apiVersion"], doc["kind"])]
    meta = doc["metadata"]
    path = template.format(name=meta["name"], ns=meta.get("namespace", ""))
    query = "?fieldManager=nodeagent-e2e&fieldValidation=Strict&force=true" + ("&dryRun=All" if dry_run else "")
    status, body = server.request("PATCH", path + query, json.dumps(doc).encode(),
                                  content_type="application/apply-patch+yaml")
    return status, json.loads(body or b"{}")


def test_every_manifest_is_accepted_by_server_side_dry_run(kube_apiserver: KubeApiServer) -> None:
    docs = documents((*ORDER, *DRA_ORDER))
    kinds = [d["kind"] for d in docs]
    for kind in ("Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                 "Role", "RoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                 "ConfigMap", "DaemonSet", "DeviceClass"):
        assert kind in kinds
    # namespaced objects need their namespace: it is the only object created for real here
    ns = next(d for d in docs if d["kind"] == "Namespace")
    status, body = apply(kube_apiserver, ns, dry_run=False)
    assert status in (200, 201), body
    for doc in docs:
        status, body = apply(kube_apiserver, doc, dry_run=True)
        assert status in (200, 201), f"{doc['kind']} {doc['metadata']['name']}: {body.get('message')}"


def test_daemonset_shape() -> None:
    ds = next(d for d in documents() if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "nodeagent"
    main = pod["containers"][0]
    env = {e["name"]: e for e in main["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    mounts = {m["mountPath"] for m in main["volumeMounts"]}
    assert {"/host/var/lib/kubelet/device-plugins", "/host/var/lib/kubelet/pod-resources", "/host/etc/containerd",
            "/host/etc/nodeagent"} <= mounts
    # never the kubelet's whole directory (every pod's secret volumes): only the subdirectories the agent uses
    for container in (*pod["initContainers"], *pod["containers"]):
        kubelet = {m["mountPath"] for m in container["volumeMounts"] if m["mountPath"].startswith("/host/var/lib/kubelet")}
        assert kubelet == {"/host/var/lib/kubelet/device-plugins", "/host/var/lib/kubelet/pod-resources",
                           "/host/var/lib/kubelet/plugins_registry", "/host/var/lib/kubelet/plugins/gpu.nodeagent.io"}
    # the DRA driver's sockets and claim specs are where the kubelet and the runtime look for them
    from nodeagent.dra.server import dra_socket, registration_socket

    kubelet_dir = Path("/host/var/lib/kubelet")
    assert {str(registration_socket(kubelet_dir).parent), str(dra_socket(kubelet_dir).parent),
            "/host/var/run/cdi"} <= mounts
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert "/var/lib/kubelet" not in host_paths
    # the root for every nodeagent command in the pod, `kubectl exec ... -- nodeagent doctor` included
    for container in (*pod["initContainers"], *pod["containers"]):
        roots = {e["name"]: e.get("value") for e in container["env"] if e["name"].startswith("NODEAGENT_ROOT")}
        assert roots == {"NODEAGENT_ROOT": "/host", "NODEAGENT_ROOT_ON_HOST": "/"}, container["env"]
        assert "--root" not in container["args"]
    assert "/host/proc" in mounts
    # the node's sysfs read-only, no /usr/share: the VFIO switch's writable sysfs and pci.ids are its patch's
    # (daemonset-vfio.patch.yaml; tests/e2e/test_helm_chart.py compares it with the chart's vfio.enabled)
    for container in (*pod["initContainers"], *pod["containers"]):
        by_path = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert by_path["/host/sys"] == {"name": "sys", "mountPath": "/host/sys", "readOnly": True}
        assert "/host/usr/share" not in by_path
    assert "usr-share" not in {v["name"] for v in pod["volumes"]}
    # the config shipped in the ConfigMap is valid for the agent
    from nodeagent.config import parse_config

    cm = next(d for d in documents() if d["kind"] == "ConfigMap")
    cfg = parse_config(cm["data"]["config.toml"], "configmap.yaml")
    assert cfg.runtime.restart == "signal"


def can(server: KubeApiServer, verb: str, resource: str, group: str = "", sub: str = "", ns: str = "",
        name: str = "") -> bool:
    review = {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": "system:serviceaccount:nodeagent:nodeagent",
                 "groups": ["system:serviceaccounts", "system:serviceaccounts:nodeagent", "system:authenticated"],
                 "resourceAttributes": {"verb": verb, "resource": resource, "group": group, "subresource": sub,
                                        "namespace": ns, "name": name}},
    }
    status, body = server.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
    assert status == 201, body
    return bool(json.loads(body)["status"].get("allowed"))


# The roles applied beside rbac.yaml only where their feature is on: the file, its binding, and one grant of it
# (refused again once the binding is gone).
OPT_IN_ROLES = {
    "dra": ("rbac-dra.yaml", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/nodeagent-dra",
            ("create", "resourceslices", "resource.k8s.io", "", "", "")),
    "fleet": ("rbac-fleet.yaml", "/apis/rbac.authorization.k8s.io/v1/namespaces/nodeagent/rolebindings/nodeagent-fleet",
              ("create", "leases", "coordination.k8s.io", "", "nodeagent", "")),
    "nodefeature": ("rbac-nodefeature.yaml",
                    "/apis/rbac.authorization.k8s.io/v1/namespaces/nodeagent/rolebindings/nodeagent-nodefeature",
                    ("create", "nodefeatures", "nfd.k8s-sigs.io", "", "nodeagent", "")),
}


def apply_rbac(server: KubeApiServer, *, crd: bool = False, dra: bool = False, fleet: bool = False,
               nodefeature: bool = False) -> None:
    """The ServiceAccount, ClusterRoles and admission policy of the plain manifests, with the opt-in roles asked
    for (``dra``: rbac-dra.yaml, ``fleet``: rbac-fleet.yaml, ``nodefeature``: rbac-nodefeature.yaml); the
    bindings of the others are deleted, as where those features are not installed."""
    wanted = {"dra": dra, "fleet": fleet, "nodefeature": nodefeature}
    for doc in documents((*ORDER, *(OPT_IN_ROLES[k][0] for k, on in wanted.items() if on))):
        if doc["kind"] in RBAC_KINDS or (crd and doc["kind"] == "CustomResourceDefinition"):
            status, body = apply(server, doc, dry_run=False)
            assert status in (200, 201), body
    for feature in (k for k, on in wanted.items() if not on):
        _, binding, grant = OPT_IN_ROLES[feature]
        code, raw = server.request("DELETE", binding)
        assert code in (200, 404), raw
        deadline = time.monotonic() + 20
        while code == 200 and can(server, *grant):
            assert time.monotonic() < deadline, f"the {feature} role's binding was deleted but still grants"
            time.sleep(0.1)


# What rbac-fleet.yaml and rbac-nodefeature.yaml grant: the fleet's budget and Leases in the agents' namespace
# (nodeagent/fleet/leases.py); [publish] labels = "nodefeature" (nodeagent/kube/nodefeature.py), there only.
FLEET_GRANTS = [
    ("get", "configmaps", "", "", "nodeagent", "nodeagent-fleet"),
    *((v, "leases", "coordination.k8s.io", "", "nodeagent", "")
      for v in ("get", "list", "create", "update", "patch", "delete")),
]
NODEFEATURE_GRANTS = [
    (v, "nodefeatures", "nfd.k8s-sigs.io", "", "nodeagent", "") for v in ("get", "create", "update", "delete")
]


def test_cluster_role_is_least_privilege(kube_apiserver: KubeApiServer) -> None:
    apply_rbac(kube_apiserver)
    # exactly the verbs the code sends (nodeagent/kube/{node,events,gpuobjects,runtimeclass}.py, nodeagent/adopt)
    allowed = [
        ("get", "nodes", "", "", "", ""), ("list", "nodes", "", "", "", ""), ("watch", "nodes", "", "", "", ""),
        ("patch", "nodes", "", "", "", ""), ("patch", "nodes", "", "status", "", ""),
        ("create", "events", "", "", "default", ""),
        ("get", "runtimeclasses", "node.k8s.io", "", "", "nvidia"),
        ("create", "runtimeclasses", "node.k8s.io", "", "", ""),
        ("patch", "runtimeclasses", "node.k8s.io", "", "", "nvidia"),
        ("delete", "runtimeclasses", "node.k8s.io", "", "", "nvidia"),
        ("delete", "runtimeclasses", "node.k8s.io", "", "", "nvidia-cdi"),
        ("list", "gpus", "nodeagent.io", "", "", ""), ("create", "gpus", "nodeagent.io", "", "", ""),
        ("patch", "gpus", "nodeagent.io", "", "", ""), ("delete", "gpus", "nodeagent.io", "", "", ""),
        ("patch", "gpus", "nodeagent.io", "status", "", ""),
        ("list", "nodefeatures", "nfd.k8s-sigs.io", "", "", ""),  # conflict detection (nodeagent/adopt)
        ("list", "resourceslices", "resource.k8s.io", "", "", ""),  # the same, for another DRA driver
    ]
    for verb, res, group, sub, ns, name in allowed:
        assert can(kube_apiserver, verb, res, group, sub, ns, name), (verb, res, sub, ns, name)
    denied = [
        ("delete", "nodes", "", "", "", ""), ("create", "nodes", "", "", "", ""),
        ("update", "nodes", "", "status", "", ""),
        ("get", "secrets", "", "", "nodeagent", ""), ("list", "pods", "", "", "nodeagent", ""),
        ("list", "pods", "", "", "", ""),  # blockingPods reads the node's container runtime instead
        ("watch", "nodefeatures", "nfd.k8s-sigs.io", "", "", ""),
        ("create", "nodefeatures", "nfd.k8s-sigs.io", "", "", ""),
        ("create", "nodefeatures", "nfd.k8s-sigs.io", "", "default", ""),
        ("patch", "nodefeatures", "nfd.k8s-sigs.io", "", "nodeagent", ""),
        ("create", "pods", "", "", "nodeagent", ""),
        ("create", "events", "", "", "nodeagent", ""), ("create", "events", "", "", "kube-system", ""),
        ("delete", "events", "", "", "default", ""), ("patch", "events", "", "", "default", ""),
        ("list", "events", "", "", "default", ""),
        ("update", "runtimeclasses", "node.k8s.io", "", "", "nvidia"),
        ("delete", "runtimeclasses", "node.k8s.io", "", "", "gvisor"),
        ("patch", "runtimeclasses", "node.k8s.io", "", "", "gvisor"),
        ("get", "runtimeclasses", "node.k8s.io", "", "", "gvisor"),
        ("get", "gpus", "nodeagent.io", "", "", ""),
        ("watch", "gpus", "nodeagent.io", "", "", ""), ("update", "gpus", "nodeagent.io", "", "", ""),
        ("create", "customresourcedefinitions", "apiextensions.k8s.io", "", "", ""),
        ("create", "clusterroles", "rbac.authorization.k8s.io", "", "", ""),
        ("get", "configmaps", "", "", "nodeagent", ""),
        ("get", "configmaps", "", "", "nodeagent", "nodeagent-config"),
        ("watch", "leases", "coordination.k8s.io", "", "nodeagent", ""),
        ("create", "leases", "coordination.k8s.io", "", "kube-node-lease", ""),
        ("update", "leases", "coordination.k8s.io", "", "kube-system", ""),
        ("create", "validatingadmissionpolicybindings", "admissionregistration.k8s.io", "", "", ""),
        # without the DRA plane's rbac-dra.yaml: no slice writes, no claims
        ("create", "resourceslices", "resource.k8s.io", "", "", ""),
        ("delete", "resourceslices", "resource.k8s.io", "", "", ""),
        ("get", "resourceclaims", "resource.k8s.io", "", "default", ""),
        ("update", "resourceclaims", "resource.k8s.io", "status", "default", ""),
        # without rbac-fleet.yaml and rbac-nodefeature.yaml: no Leases, no budget, no NodeFeature writes
        *FLEET_GRANTS, *NODEFEATURE_GRANTS,
    ]
    for verb, res, group, sub, ns, name in denied:
        assert not can(kube_apiserver, verb, res, group, sub, ns, name), (verb, res, sub, ns, name)


def test_fleet_and_nodefeature_roles_grant_their_namespace_only(kube_apiserver: KubeApiServer) -> None:
    """rbac-fleet.yaml and rbac-nodefeature.yaml, applied where those features are on, grant what the fleet's
    Leases and the NodeFeature writer send, in the agents' namespace and nowhere else; each file alone grants
    only its own."""
    try:
        apply_rbac(kube_apiserver, fleet=True)
        for grant in FLEET_GRANTS:
            assert can(kube_apiserver, *grant), grant
        for grant in NODEFEATURE_GRANTS:
            assert not can(kube_apiserver, *grant), grant
        apply_rbac(kube_apiserver, nodefeature=True)
        for grant in NODEFEATURE_GRANTS:
            assert can(kube_apiserver, *grant), grant
        for grant in FLEET_GRANTS:
            assert not can(kube_apiserver, *grant), grant
        apply_rbac(kube_apiserver, fleet=True, nodefeature=True)
        for verb, res, group, sub, _, name in (*FLEET_GRANTS, *NODEFEATURE_GRANTS):
            for ns in ("default", "kube-system", "kube-node-lease"):
                assert not can(kube_apiserver, verb, res, group, sub, ns, name), (verb, res, ns)
        denied = [("watch", "leases", "coordination.k8s.io", "", "nodeagent", ""),
                  ("get", "configmaps", "", "", "nodeagent", "nodeagent-config"),
                  ("patch", "nodefeatures", "nfd.k8s-sigs.io", "", "nodeagent", "")]
        for grant in denied:
            assert not can(kube_apiserver, *grant), grant
    finally:
        apply_rbac(kube_apiserver)


def bound_token(server: KubeApiServer, node: str) -> str:
    """A token of the DaemonSet's service account bound to a pod scheduled on ``node``, as the kubelet projects
    it into the agent's pod: it carries the node-name claim the admission policy compares with."""
    pod = f"nodeagent-{node}"
    server.request("DELETE", f"/api/v1/namespaces/nodeagent/pods/{pod}?gracePeriodSeconds=0")
    status, body = server.request("POST", "/api/v1/namespaces/nodeagent/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
        "spec": {"nodeName": node, "serviceAccountName": "nodeagent", "automountServiceAccountToken": False,
                 "containers": [{"name": "nodeagent", "image": "nodeagent:test"}]}})
    assert status == 201, body
    uid = json.loads(body)["metadata"]["uid"]
    return token_request(server, {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid})


def token_request(server: KubeApiServer, bound: dict[str, str] | None = None) -> str:
    spec: dict[str, Any] = {"expirationSeconds": 3600}
    if bound is not None:
        spec["boundObjectRef"] = bound
    req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
    status, body = server.request("POST", "/api/v1/namespaces/nodeagent/serviceaccounts/nodeagent/token", req)
    assert status == 201, body
    token: str = json.loads(body)["status"]["token"]
    return token


def as_agent(server: KubeApiServer, token: str, method: str, path: str, body: Any = None,
             content_type: str = "application/merge-patch+json") -> tuple[int, str]:
    """One request with the service-account token (never the admin's certificate); (status, message)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", content_type)
    ctx = ssl.create_default_context(cafile=str(server.workdir / "pki/ca.crt"))
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return int(resp.status), ""
    except urllib.error.HTTPError as e:
        return e.code, str(json.loads(e.read() or b"{}").get("message", ""))


def event(node: str, ns: str = "default") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": f"{node}.", "namespace": ns},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node}, "reason": "GpuUnhealthy",
            "message": "GPU 0 is unhealthy", "type": "Warning", "source": {"component": "nodeagent"}}


def wait_for_policy(server: KubeApiServer, token: str, other: str) -> None:
    """The policy takes effect once the API server has loaded it: probe with a throw-away label on ``other``
    until it is refused, then remove what got through before."""
    probe = {"metadata": {"labels": {"policy-probe": "x"}}}
    deadline = time.monotonic() + 30
    while as_agent(server, token, "PATCH", f"/api/v1/nodes/{other}", probe)[0] != 403:
        assert time.monotonic() < deadline, "the admission policy never refused a write to another Node"
        time.sleep(0.2)
    status, body = server.request("PATCH", f"/api/v1/nodes/{other}", {"metadata": {"labels": {"policy-probe": None}}},
                                  content_type="application/merge-patch+json")
    assert status == 200, body


def test_the_role_token_is_confined_to_its_own_node(kube_apiserver: KubeApiServer) -> None:
    """With the agent's own (pod-bound) token: its own Node's labels and status are writable; another Node
    cannot be relabelled, cordoned, untainted or given GPUs; its own Node cannot be cordoned; no foreign
    RuntimeClass can be deleted or created; Events only about its own Node; GPU objects only its own."""
    from tests.e2e.test_run_cluster import make_node

    apply_rbac(kube_apiserver, crd=True)
    own, other = "rbac-own", "rbac-other"
    for n in (own, other):
        make_node(kube_apiserver, n)
    status, body = kube_apiserver.request("PATCH", f"/api/v1/nodes/{other}", {"spec": {"taints": [
        {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}]}}, content_type="application/merge-patch+json")
    assert status == 200, body
    for rc, handler in (("gvisor", "runsc"), ("nvidia", "wrong")):  # nvidia's handler is replaced below
        kube_apiserver.request("DELETE", f"/apis/node.k8s.io/v1/runtimeclasses/{rc}")
        status, body = kube_apiserver.request("POST", "/apis/node.k8s.io/v1/runtimeclasses", {
            "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": rc}, "handler": handler})
        assert status == 201, body
    token = bound_token(kube_apiserver, own)
    label = {"metadata": {"labels": {"nvidia.com/gpu.count": "8"}}}
    wait_for_policy(kube_apiserver, token, other)
    gpus_status = [{"op": "add", "path": "/status/capacity", "value": {"nvidia.com/gpu": "64"}}]
    gpu_ready = {"status": {"conditions": [{"type": "nodeagent.io/GPUReady", "status": "True", "reason": "AllGpusReady",
                                            "message": "all 8 GPU(s) present and healthy"}]}}
    strategic = "application/strategic-merge-patch+json"

    def gpu_obj(n: str) -> dict[str, Any]:
        return {"apiVersion": "nodeagent.io/v1alpha1", "kind": "GPU",
                "metadata": {"name": f"{n}-gpu0", "labels": {"nodeagent.io/node": n}},
                "spec": {"index": 0, "uuid": f"GPU-{n}", "nodeName": n}}

    for n in (own, other):
        kube_apiserver.request("DELETE", f"/apis/nodeagent.io/v1alpha1/gpus/{n}-gpu0")
    status, body = kube_apiserver.request("POST", "/apis/nodeagent.io/v1alpha1/gpus", gpu_obj(other))
    assert status == 201, body
    allowed: list[tuple[str, str, Any, str | None]] = [
        ("PATCH", f"/api/v1/nodes/{own}", label, None),
        ("PATCH", f"/api/v1/nodes/{own}/status", gpus_status, "application/json-patch+json"),
        ("PATCH", f"/api/v1/nodes/{own}/status", gpu_ready, strategic),  # the GPU Node conditions
        ("POST", "/api/v1/namespaces/default/events", event(own), "application/json"),
        ("PATCH", "/apis/node.k8s.io/v1/runtimeclasses/nvidia",
         {"metadata": {"labels": {"app.kubernetes.io/managed-by": "nodeagent"}}}, None),
        ("POST", "/apis/nodeagent.io/v1alpha1/gpus", gpu_obj(own), "application/json"),
        ("PATCH", f"/apis/nodeagent.io/v1alpha1/gpus/{own}-gpu0", {"metadata": {"labels": {"x": "y"}}}, None),
        ("DELETE", f"/apis/nodeagent.io/v1alpha1/gpus/{own}-gpu0", None, None),
        ("DELETE", "/apis/node.k8s.io/v1/runtimeclasses/nvidia", None, None),
        ("POST", "/apis/node.k8s.io/v1/runtimeclasses", {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                                                          "metadata": {"name": "nvidia"}, "handler": "nvidia"},
         "application/json"),
    ]
    for method, path, payload, ctype in allowed:
        status, msg = as_agent(kube_apiserver, token, method, path, payload, ctype or "application/merge-patch+json")
        assert status in (200, 201), (method, path, status, msg)
    denied: list[tuple[str, str, Any, str | None]] = [
        ("PATCH", f"/api/v1/nodes/{other}", label, None),
        ("PATCH", f"/api/v1/nodes/{other}", {"spec": {"unschedulable": True}}, None),
        ("PATCH", f"/api/v1/nodes/{other}", {"spec": {"taints": None}}, None),
        ("PATCH", f"/api/v1/nodes/{other}/status", gpus_status, "application/json-patch+json"),
        ("PATCH", f"/api/v1/nodes/{other}/status", gpu_ready, strategic),
        ("PATCH", f"/api/v1/nodes/{own}", {"spec": {"unschedulable": True}}, None),
        ("DELETE", f"/api/v1/nodes/{other}", None, None),
        ("DELETE", "/apis/node.k8s.io/v1/runtimeclasses/gvisor", None, None),
        ("PATCH", "/apis/node.k8s.io/v1/runtimeclasses/gvisor", {"metadata": {"labels": {"a": "b"}}}, None),
        ("POST", "/apis/node.k8s.io/v1/runtimeclasses", {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                                                          "metadata": {"name": "runc-anything"}, "handler": "runc"},
         "application/json"),
        ("POST", "/api/v1/namespaces/default/events", event(other), "application/json"),
        ("POST", "/api/v1/namespaces/kube-system/events", event(own, "kube-system"), "application/json"),
        ("POST", "/apis/nodeagent.io/v1alpha1/gpus", {**gpu_obj(other), "metadata": {
            "name": "sneaky", "labels": {"nodeagent.io/node": other}}}, "application/json"),
        ("PATCH", f"/apis/nodeagent.io/v1alpha1/gpus/{other}-gpu0", {"metadata": {"labels": {
            "nodeagent.io/node": own}}}, None),
        ("DELETE", f"/apis/nodeagent.io/v1alpha1/gpus/{other}-gpu0", None, None),
        # no pods, not even its own node's: a pool's blockingPods asks the node's container runtime
        # (nodeagent/runtime/cri.py), as RBAC cannot confine a list of pods to one node
        ("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{own}", None, None),
        ("GET", "/api/v1/pods", None, None),
    ]
    for method, path, payload, ctype in denied:
        status, msg = as_agent(kube_apiserver, token, method, path, payload, ctype or "application/merge-patch+json")
        assert status == 403, (method, path, status, msg)
    # nothing of the other node changed
    node = json.loads(kube_apiserver.get(f"/api/v1/nodes/{other}")[1])
    assert node["spec"]["taints"][0]["key"] == "dedicated" and not node["spec"].get("unschedulable")
    assert "nvidia.com/gpu" not in node.get("status", {}).get("capacity", {})
    assert not node.get("status", {}).get("conditions")
    assert "nvidia.com/gpu.count" not in node["metadata"].get("labels", {})
    assert json.loads(kube_apiserver.get("/apis/node.k8s.io/v1/runtimeclasses/gvisor")[1])["handler"] == "runsc"
    # a nodeagent token without a node claim (not bound to a pod) changes nothing at all, not even "its" Node
    unbound = token_request(kube_apiserver)
    status, msg = as_agent(kube_apiserver, unbound, "PATCH", f"/api/v1/nodes/{own}", label)
    assert status == 403 and "no node-name claim" in msg, msg


def service_account_kubeconfig(server: KubeApiServer, dest: Path, node: str) -> Path:
    """A kubeconfig holding a token of the DaemonSet's service account bound to a pod on ``node`` (as the kubelet
    projects it), nothing of the admin."""
    token = bound_token(server, node)
    doc = yaml.safe_load(server.kubeconfig.read_text())
    doc["users"] = [{"name": "nodeagent", "user": {"token": token}}]
    for ctx in doc["contexts"]:
        ctx["context"]["user"] = "nodeagent"
    dest.write_text(yaml.safe_dump(doc))
    return dest


def test_the_agent_does_its_whole_job_with_the_cluster_role(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    """The other direction of least privilege: the real agent, holding only the role's token, publishes labels,
    status and GPU objects, deletes a stale GPU object, replaces a wrong RuntimeClass, applies a MIG config and
    records events — and never meets a refusal."""
    from tests.e2e._agent import node_root, running_agent
    from tests.e2e.test_run_cluster import agent_config, eventually, make_node, node_obj, set_label

    apply_rbac(kube_apiserver, crd=True)
    crd = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/gpus.nodeagent.io"
    eventually(lambda: any(c["type"] == "Established" and c["status"] == "True" for c in
                           json.loads(kube_apiserver.get(crd)[1]).get("status", {}).get("conditions", [])),
               20, "GPU CRD established")
    node = "e2e-rbac"
    make_node(kube_apiserver, node)
    gpus = "/apis/nodeagent.io/v1alpha1/gpus"
    stale = {"apiVersion": "nodeagent.io/v1alpha1", "kind": "GPU",
             "metadata": {"name": f"{node}-stale", "labels": {"nodeagent.io/node": node}},
             "spec": {"index": 9, "uuid": "GPU-gone", "nodeName": node}}
    kube_apiserver.request("DELETE", f"{gpus}/{node}-stale")
    status, answer = kube_apiserver.request("POST", gpus, stale)
    assert status == 201, answer
    rc = "/apis/node.k8s.io/v1/runtimeclasses/nvidia"
    kube_apiserver.request("DELETE", rc)
    status, answer = kube_apiserver.request("POST", "/apis/node.k8s.io/v1/runtimeclasses", {
        "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"}, "handler": "wrong"})
    assert status == 201, answer
    kubeconfig = service_account_kubeconfig(kube_apiserver, tmp_path / "sa-kubeconfig", node)
    make_node(kube_apiserver, f"{node}-other")
    wait_for_policy(kube_apiserver, yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"],
                    f"{node}-other")
    with node_root(kubelet_harness) as root:
        cfg = agent_config(root, kubeconfig).read_text().replace("[runtime]\nenabled = false\n", "")
        (root / "etc/nodeagent/config.toml").write_text(cfg + "[runtime]\ncheck_interval = 0.0\n")
        args = ["run", "--config", str(root / "etc/nodeagent/config.toml"), "--simulate", "dgx-h100",
                "--sim-state", str(root / "sim.json"), "--node-name", node]
        with running_agent(tmp_path, root, args) as agent:
            agent.wait_notify("READY=1", timeout=20)

            def labels() -> dict[str, str]:
                found: dict[str, str] = node_obj(kube_apiserver, node)["metadata"].get("labels", {})
                return found

            eventually(lambda: labels().get("nvidia.com/gpu.count") == "8", 20, "gpu.count label")
            eventually(lambda: json.loads(kube_apiserver.get(rc)[1]).get("handler") == "nvidia", 20,
                       "RuntimeClass nvidia replaced")
            eventually(lambda: kube_apiserver.get(f"{gpus}/{node}-stale")[0] == 404, 20, "stale GPU object deleted")
            def owned() -> dict[str, Any]:
                found: dict[str, Any] = json.loads(
                    kube_apiserver.get(f"{gpus}?labelSelector=nodeagent.io/node={node}")[1])
                return found

            eventually(lambda: len(owned()["items"]) == 8 and all(o.get("status") for o in owned()["items"]), 20,
                       "8 GPU objects with status")
            set_label(kube_apiserver, node, "nvidia.com/mig.config", "all-1g.10gb")
            eventually(lambda: labels().get("nvidia.com/mig.config.state") == "success", 60, "MIG state success")
            eventually(lambda: {(c["type"], c["status"]) for c in node_obj(kube_apiserver, node)["status"].get(
                "conditions", [])} >= {("nodeagent.io/GPUReady", "True"), ("nodeagent.io/MIGConfigured", "True")},
                20, "GPU Node conditions written with the agent's own token")
            status, answer = kube_apiserver.get(f"/api/v1/namespaces/default/events?fieldSelector="
                                                f"involvedObject.name={node}")
            assert status == 200 and json.loads(answer)["items"], answer
            log = agent.log()
            # an HTTP 403 anywhere in the log (not the digits of a timestamp's milliseconds, ",403")
            assert not re.search(r"(?<![,.\d])403(?!\d)", log) and "forbidden" not in log.lower(), log
            code, _ = agent.stop()
            assert code == 0


def test_image_recipe_matches_the_daemonset() -> None:
    """No container engine runs here, so the recipe is checked for what can break silently: every COPY source
    exists, the entrypoint is where ENTRYPOINT points and is valid shell, and each container's args are a
    command line the agent accepts (the installed entrypoint itself runs in test_delivery's .deb test)."""
    import subprocess
    import sys

    recipe = (MANIFESTS / "Containerfile").read_text()
    copies = [ln.split()[1:] for ln in recipe.splitlines() if ln.startswith("COPY ") and "--from" not in ln]
    for src, _dest in copies:
        assert (REPO / src).exists(), src
    entry = json.loads(next(ln for ln in recipe.splitlines() if ln.startswith("ENTRYPOINT "))[len("ENTRYPOINT "):])
    assert ["packaging/kubernetes/entrypoint.sh", entry[0]] in copies
    assert subprocess.run(["sh", "-n", str(MANIFESTS / "entrypoint.sh")], timeout=10).returncode == 0
    ds = next(d for d in documents() if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    for container in pod.get("initContainers", []) + pod["containers"]:
        assert "command" not in container  # the image's entrypoint must stay in front
        proc = subprocess.run([sys.executable, "-m", "nodeagent", *container["args"], "--help"], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (container["name"], proc.stderr)


def test_readme_applies_every_manifest_the_agent_needs() -> None:
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("kubectl apply -f packaging/kubernetes/namespace.yaml"):]
    block = block[:block.index("\n```")]
    applied = re.findall(r"-f packaging/kubernetes/([a-z-]+\.yaml)", block)
    assert applied == list(ORDER), applied
    # and, for the DRA plane, what it needs besides
    para = readme[readme.index(block) + len(block):].split("```", 1)[1].strip().split("\n\n", 1)[0]
    assert para.startswith("For the DRA plane"), para
    assert re.findall(r"`packaging/kubernetes/([a-z-]+\.yaml)`", para) == list(DRA_ORDER), para
