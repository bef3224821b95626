"""packaging/kubernetes/: every manifest is accepted by the real kube-apiserver (server-side apply, dry run,
strict field validation), and the ClusterRole grants what the agent needs and nothing more."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e._agent import REPO
from tests.peers.apiserver import KubeApiServer
from tests.peers.harness import KubeletHarness

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
    assert {"/host/var/lib/kubelet/device-plugins", "/host/var/lib/kubelet/pod-resources", "/host/etc/containerd",
            "/host/etc/nodeagent"} <= mounts
    # never the kubelet's whole directory (every pod's secret volumes): only the subdirectories the agent uses
    for container in (*pod["initContainers"], *pod["containers"]):
        kubelet = {m["mountPath"] for m in container["volumeMounts"] if m["mountPath"].startswith("/host/var/lib/kubelet")}
        assert kubelet == {"/host/var/lib/kubelet/device-plugins", "/host/var/lib/kubelet/pod-resources"}
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert "/var/lib/kubelet" not in host_paths
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
    # exactly the verbs the code sends (nodeagent/kube/{node,gpuobjects,runtimeclass}.py)
    allowed = [
        ("get", "nodes", "", ""), ("list", "nodes", "", ""), ("watch", "nodes", "", ""), ("patch", "nodes", "", ""),
        ("patch", "nodes", "", "status"), ("create", "events", "", ""),
        ("get", "runtimeclasses", "node.k8s.io", ""), ("create", "runtimeclasses", "node.k8s.io", ""),
        ("patch", "runtimeclasses", "node.k8s.io", ""), ("delete", "runtimeclasses", "node.k8s.io", ""),
        ("list", "gpus", "nodeagent.io", ""), ("create", "gpus", "nodeagent.io", ""),
        ("patch", "gpus", "nodeagent.io", ""), ("delete", "gpus", "nodeagent.io", ""),
        ("patch", "gpus", "nodeagent.io", "status"),
    ]
    for verb, res, group, sub in allowed:
        assert can(kube_apiserver, verb, res, group, sub, "default" if res == "events" else ""), (verb, res, sub)
    denied = [
        ("delete", "nodes", "", ""), ("create", "nodes", "", ""), ("update", "nodes", "", "status"),
        ("get", "secrets", "", ""), ("list", "pods", "", ""), ("create", "pods", "", ""),
        ("delete", "events", "", ""), ("patch", "events", "", ""), ("list", "events", "", ""),
        ("update", "runtimeclasses", "node.k8s.io", ""), ("get", "gpus", "nodeagent.io", ""),
        ("watch", "gpus", "nodeagent.io", ""), ("update", "gpus", "nodeagent.io", ""),
        ("create", "customresourcedefinitions", "apiextensions.k8s.io", ""),
        ("create", "clusterroles", "rbac.authorization.k8s.io", ""), ("get", "configmaps", "", ""),
    ]
    for verb, res, group, sub in denied:
        assert not can(kube_apiserver, verb, res, group, sub, "nodeagent"), (verb, res, sub)


def service_account_kubeconfig(server: KubeApiServer, dest: Path) -> Path:
    """A kubeconfig holding a token of the DaemonSet's service account (TokenRequest), nothing of the admin."""
    req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}
    status, body = server.request("POST", "/api/v1/namespaces/nodeagent/serviceaccounts/nodeagent/token", req)
    assert status == 201, body
    token = json.loads(body)["status"]["token"]
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

    for doc in documents():
        if doc["kind"] in ("Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole",
                           "ClusterRoleBinding"):
            status, body = apply(kube_apiserver, doc, dry_run=False)
            assert status in (200, 201), body
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
    kubeconfig = service_account_kubeconfig(kube_apiserver, tmp_path / "sa-kubeconfig")
    with node_root(kubelet_harness) as root:
        cfg = agent_config(root, kubeconfig).read_text().replace("[runtime]\nenabled = false\n", "")
        (root / "etc/nodeagent/config.toml").write_text(cfg + "[runtime]\ncheck_interval = 0.0\n")
        args = ["run", "--config", str(root / "etc/nodeagent/config.toml"), "--simulate", "dgx-h100",
                "--sim-state", str(tmp_path / "sim.json"), "--node-name", node]
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
