"""packaging/kubernetes/: every manifest is accepted by the real kube-apiserver (server-side apply, dry run,
strict field validation), and the ClusterRole grants what the agent needs and nothing more."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.e2e._agent import REPO
from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers

MANIFESTS = REPO / "packaging/kubernetes"
ORDER = ("namespace.yaml", "gpu-crd.yaml", "rbac.yaml", "configmap.yaml", "daemonset.yaml")

PATHS = {
    ("v1", "Namespace"): "/api/v1/namespaces/{name}",
    ("v1", "ServiceAccount"): "/api/v1/namespaces/{ns}/serviceaccounts/{name}",
    ("v1", "ConfigMap"): "/api/v1/namespaces/{ns}/configmaps/{name}",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "/apis/rbac.authorization.k8s.io/v1/clusterroles/{name}",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"):
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{name}",
    ("apps/v1", "DaemonSet"): "/apis/apps/v1/namespaces/{ns}/daemonsets/{name}",
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"):
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}",
}


def documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in ORDER:
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
    docs = documents()
    kinds = [d["kind"] for d in docs]
    for kind in ("Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                 "ConfigMap", "DaemonSet"):
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
    assert {"/host/var/lib/kubelet", "/host/etc/containerd", "/host/etc/nodeagent"} <= mounts
    assert main["args"][:2] == ["--root", "/host"]
    # the config shipped in the ConfigMap is valid for the agent
    from nodeagent.config import parse_config

    cm = next(d for d in documents() if d["kind"] == "ConfigMap")
    cfg = parse_config(cm["data"]["config.toml"], "configmap.yaml")
    assert cfg.runtime.restart == "signal"


def can(server: KubeApiServer, verb: str, resource: str, group: str = "", sub: str = "", ns: str = "") -> bool:
    review = {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": "system:serviceaccount:nodeagent:nodeagent",
                 "groups": ["system:serviceaccounts", "system:serviceaccounts:nodeagent", "system:authenticated"],
                 "resourceAttributes": {"verb": verb, "resource": resource, "group": group, "subresource": sub,
                                        "namespace": ns}},
    }
    status, body = server.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
    assert status == 201, body
    return bool(json.loads(body)["status"].get("allowed"))


def test_cluster_role_is_least_privilege(kube_apiserver: KubeApiServer) -> None:
    docs = documents()
    for doc in docs:
        if doc["kind"] in ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
            status, body = apply(kube_apiserver, doc, dry_run=False)
            assert status in (200, 201), body
    allowed = [
        ("get", "nodes", "", ""), ("watch", "nodes", "", ""), ("patch", "nodes", "", ""),
        ("patch", "nodes", "", "status"), ("create", "events", "", ""), ("patch", "events", "", ""),
        ("get", "runtimeclasses", "node.k8s.io", ""), ("create", "runtimeclasses", "node.k8s.io", ""),
        ("update", "runtimeclasses", "node.k8s.io", ""), ("create", "gpus", "nodeagent.io", ""),
        ("patch", "gpus", "nodeagent.io", "status"),
    ]
    for verb, res, group, sub in allowed:
        assert can(kube_apiserver, verb, res, group, sub, "default" if res == "events" else ""), (verb, res, sub)
    denied = [
        ("delete", "nodes", "", ""), ("create", "nodes", "", ""), ("update", "nodes", "", "status"),
        ("get", "secrets", "", ""), ("list", "pods", "", ""), ("create", "pods", "", ""),
        ("delete", "events", "", ""), ("create", "customresourcedefinitions", "apiextensions.k8s.io", ""),
        ("create", "clusterroles", "rbac.authorization.k8s.io", ""),
    ]
    for verb, res, group, sub in denied:
        assert not can(kube_apiserver, verb, res, group, sub, "nodeagent"), (verb, res, sub)
