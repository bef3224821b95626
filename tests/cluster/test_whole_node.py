"""The README's Kubernetes section, run as written on a real single-node cluster (tests/peers/cluster.py):
the manifests applied with the release's kubectl, the agent from its own image (built from
packaging/kubernetes/Containerfile), the real kubelet serving GPU pods through it.

The tests run in file order on one installation of the agent (module fixture ``agent``) and one cluster."""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.peers.cluster import GPU_COUNT, Cluster

pytestmark = pytest.mark.timeout(600)

README_SECTION = "## Kubernetes"
RESOURCE = "nvidia.com/gpu"


def readme_manifest_commands() -> list[list[str]]:
    """The shell lines of the README's "Without Helm" block (kubectl apply ..., kubectl label node ...)."""
    from tests.peers.cluster import REPO

    text = (REPO / "README.md").read_text()
    section = text.split(README_SECTION, 1)[1]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    block = next(b for b in blocks if "kubectl apply -f packaging/kubernetes/" in b)
    lines = block.replace("\\\n", " ").strip().splitlines()
    return [shlex.split(line) for line in lines if line.strip()]


def agent_pods(cluster: Cluster) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json(
        "pods", "-n", "nodeagent", "-l", "app.kubernetes.io/name=nodeagent")["items"]
    return items


def running_agent(cluster: Cluster) -> dict[str, Any] | None:
    for pod in agent_pods(cluster):
        statuses = pod.get("status", {}).get("containerStatuses", [])
        if (pod["metadata"].get("deletionTimestamp") is None and statuses
                and all(s.get("ready") for s in statuses)):
            return pod
    return None


def allocatable(cluster: Cluster, resource: str = RESOURCE) -> int:
    return int(cluster.node().get("status", {}).get("allocatable", {}).get(resource, "0"))


@pytest.fixture(scope="module")
def agent(cluster: Cluster) -> Iterator[dict[str, Any]]:
    """The README's lines run verbatim (with the cluster's node name), the agent Running and ready."""
    commands = readme_manifest_commands()
    assert [c[:2] for c in commands] == [["kubectl", "apply"], ["kubectl", "label"]], commands
    start = time.monotonic()
    for command in commands:
        args = [a.replace("<gpu-node>", cluster.node_name) for a in command[1:]]
        cluster.kubectl(*args)
    pod = cluster.wait_for("the agent pod Running and ready", lambda: running_agent(cluster), timeout=180)
    cluster.wait_for(f"allocatable {RESOURCE}: {GPU_COUNT}", lambda: allocatable(cluster) == GPU_COUNT, timeout=60)
    pod["readyAfter"] = time.monotonic() - start
    yield pod


def test_readme_manifests_make_the_node_gpu_ready(cluster: Cluster, agent: dict[str, Any]) -> None:
    node = cluster.node()
    assert node["status"]["allocatable"][RESOURCE] == str(GPU_COUNT)
    assert node["status"]["capacity"][RESOURCE] == str(GPU_COUNT)
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/gpu.count"] == str(GPU_COUNT)
    assert "H100" in labels["nvidia.com/gpu.product"], labels
    assert labels["nodeagent.io/gpu"] == "true"
    conditions = {c["type"]: c for c in node["status"]["conditions"]}
    for kind in ("nodeagent.io/GPUReady", "nodeagent.io/GPUHealthy", "nodeagent.io/RuntimeReady"):
        assert conditions[kind]["status"] == "True", conditions[kind]
    # the init container (bootstrap) ran to completion before the agent started
    init = agent["status"]["initContainerStatuses"]
    assert [s["name"] for s in init] == ["bootstrap"]
    assert init[0]["state"]["terminated"]["exitCode"] == 0, init
    # one GPU object per card, written by the agent
    gpus = cluster.get_json("gpus")["items"]
    assert sorted(g["spec"]["index"] for g in gpus) == list(range(GPU_COUNT))


def test_agent_writes_with_its_own_service_account_token(cluster: Cluster, agent: dict[str, Any]) -> None:
    assert agent["spec"]["serviceAccountName"] == "nodeagent"
    writes, _ = cluster.apiserver.audit_writes()
    node_writes = [w for w in writes if w.resource == "nodes" and w.name == cluster.node_name
                   and w.user == "system:serviceaccount:nodeagent:nodeagent"]
    assert node_writes, "the agent never wrote its Node with its service account"
    assert all(w.code < 300 for w in node_writes), node_writes
    # the admission policy is in force: the same token may not touch another Node
    policy = cluster.get_json("validatingadmissionpolicybinding", "nodeagent-own-node")
    assert policy["spec"]["policyName"] == "nodeagent-own-node"


def _gpu_pod(name: str, count: int, command: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main", "image": "docker.io/library/debian:bookworm-slim", "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", command],
    }
    if count:
        container["resources"] = {"limits": {RESOURCE: count}}
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container], **(extra or {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def run_pod(cluster: Cluster, pod: dict[str, Any], timeout: float = 90) -> tuple[dict[str, Any], str]:
    """Create ``pod``, wait until it ends; (its final object, its log)."""
    name = pod["metadata"]["name"]
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(pod))

    def ended() -> dict[str, Any] | None:
        obj = cluster.get_json("pod", name)
        return obj if obj["status"].get("phase") in ("Succeeded", "Failed") else None

    obj = cluster.wait_for(f"pod {name} ended", ended, timeout=timeout)
    log = cluster.kubectl("logs", name).stdout
    return obj, log


PROBE = ("ls /dev | grep -E '^nvidia[0-9]+$' | sort | tr '\\n' ' '; echo; "
         "echo \"env=$NVIDIA_VISIBLE_DEVICES\"; ls /dev/nvidiactl; "
         # alive until the test has asked the kubelet's PodResources API, at most 60 s
         "i=0; while [ ! -e /tmp/done ] && [ $i -lt 120 ]; do sleep 0.5; i=$((i+1)); done")


def pod_devices(name: str, resource: str = RESOURCE) -> list[str]:
    """The device IDs the kubelet's PodResources API says pod ``name`` (namespace default) holds."""
    from nodeagent.kube.podresources import PodResourcesClient
    from tests.peers.cluster import KUBELET_DIR

    client = PodResourcesClient(KUBELET_DIR / "pod-resources" / "kubelet.sock")
    try:
        return sorted(d for a in client.list() if a.namespace == "default" and a.pod == name
                      and a.resource == resource for d in a.device_ids)
    finally:
        client.close()


def run_probe(cluster: Cluster, pod: dict[str, Any]) -> tuple[dict[str, Any], str, list[str]]:
    """Start ``pod`` (running PROBE), read what the kubelet says it holds while it runs, let it end; (its
    final object, its log, its device IDs)."""
    name = pod["metadata"]["name"]
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(pod))
    cluster.wait_for(f"pod {name} Running", lambda: cluster.get_json("pod", name)["status"].get("phase") in (
        "Running", "Succeeded", "Failed"), timeout=90)
    devices = pod_devices(name)
    cluster.kubectl("exec", name, "--", "touch", "/tmp/done")

    def ended() -> dict[str, Any] | None:
        obj = cluster.get_json("pod", name)
        return obj if obj["status"].get("phase") in ("Succeeded", "Failed") else None

    obj = cluster.wait_for(f"pod {name} ended", ended, timeout=90)
    log = cluster.kubectl("logs", name).stdout
    cluster.kubectl("delete", "pod", name, "--wait=true")
    return obj, log, devices


def test_pod_with_two_gpus_sees_exactly_its_devices(cluster: Cluster, agent: dict[str, Any]) -> None:
    obj, log, devices = run_probe(cluster, _gpu_pod("two-gpus", 2, PROBE))
    assert obj["status"]["phase"] == "Succeeded", (obj["status"], log)
    terminated = obj["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0, terminated
    lines = log.splitlines()
    nodes = lines[0].split()
    assert len(nodes) == 2, log
    uuids = lines[1].removeprefix("env=").split(",")
    assert len(uuids) == 2 and all(u.startswith("GPU-") for u in uuids), log
    # what the kubelet gave the pod (PodResources) is what the container got
    assert sorted(uuids) == devices, (uuids, devices)
    gpus = {g["spec"]["uuid"]: g["spec"]["path"] for g in cluster.get_json("gpus")["items"]}
    assert sorted(gpus[u].rsplit("/", 1)[1] for u in uuids) == sorted(nodes), (gpus, log)
