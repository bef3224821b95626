"""The hand-over from NVIDIA's GPU Operator on the whole-node cluster (tests/peers/cluster.py): the README's
section "Moving from the GPU Operator or NVIDIA's device plugin", step 2, as an operator would live it.

NVIDIA's device plugin is stood in for by the kubelet's own device-plugin stub (the server of the Kubernetes
sample device plugin, ``gpu-stub``, built by tests/testbin/setup.sh as NODEAGENT_GPU_STUB, statically linked)
run by a DaemonSet as the GPU Operator runs its operand: named ``nvidia-device-plugin-daemonset`` (pods labelled
``app=nvidia-device-plugin-daemonset``), scheduled on nodes labelled ``nvidia.com/gpu.deploy.device-plugin=true``,
registering ``nvidia.com/gpu`` on ``nvidia-gpu.sock`` (NVIDIA's socket name, nodeagent's too) with the node's GPU
UUIDs as device IDs. Its image is the Debian base the node already has; the binary comes from a read-only
hostPath. A preStop hook keeps it serving after its pod is told to go until the test lets it stop (a plugin
that takes its time to stop), so the test sees what nodeagent does while the other plugin still serves.

Then the README's manifests, with ``[adopt] gpu_operator = true`` in the ConfigMap: nodeagent leaves the live
socket alone and says so (GPUReady's reason, one Warning Event), switches the operand off through the label,
the DaemonSet controller takes the stand-in's pod off the node, nodeagent registers and serves; the GPU pod
started under the stand-in keeps running with the same device (PodResources, its environment, its container)
and a new GPU pod gets its device from nodeagent (nodeagent's own count of the kubelet's Allocate calls).

Then the README's ``nodeagent doctor`` in the agent's pod (``kubectl exec ... ds/nodeagent -- nodeagent doctor``,
the root coming from the pod's environment), and the way back as the README tells it: ``gpu_operator = false``
in the ConfigMap, ``nodeagent adopt --release`` from the agent's pod; the operator's labels are what they were,
its device plugin's pod comes back and serves, and the running nodeagent leaves the socket name to it.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_whole_node import (
    agent_pods,
    allocatable,
    imported_registry,
    pod_devices,
    readme_args,
    readme_manifest_commands,
    running_agent,
)
from tests.peers.cluster import GPU_COUNT, KUBELET_DIR, MACHINE, MANIFESTS, SIM_STATE, Cluster

pytestmark = pytest.mark.timeout(600)

RESOURCE = "nvidia.com/gpu"
NS = "gpu-operator"
OPERAND = "nvidia-device-plugin-daemonset"
DEPLOY = "nvidia.com/gpu.deploy."
SOCKET = KUBELET_DIR / "device-plugins" / "nvidia-gpu.sock"
STUB_IN_POD = "/usr/local/bin/gpu-stub"
PRESTOP_MAX_S = 120  # the stand-in's preStop waits at most this long for the test's word
BASE_IMAGE = "docker.io/library/debian:bookworm-slim"
OPERANDS = ("driver", "device-plugin", "gpu-feature-discovery", "dcgm-exporter", "mig-manager", "container-toolkit")
MOVING_SECTION = "## Moving from the GPU Operator"


def readme_pod_command(words: str) -> list[str]:
    """The README's ``kubectl exec ... -- nodeagent <words>`` line of its section on moving from the operator."""
    import re
    import shlex

    from tests.peers.cluster import REPO

    section = (REPO / "README.md").read_text().split(MOVING_SECTION, 1)[1].split("\n## ", 1)[0]
    lines = [shlex.split(m) for m in re.findall(r"`(kubectl exec [^`]+)`", section)]
    found = [line for line in lines if " ".join(line).endswith(f"-- nodeagent {words}")]
    assert len(found) == 1, (words, lines)
    return found[0]


def doctor_in_pod(cluster: Cluster) -> list[dict[str, str]]:
    """The README's ``kubectl exec ... -- nodeagent doctor`` (with --json) and its findings."""
    command = readme_pod_command("doctor")
    assert command[:2] == ["kubectl", "exec"], command
    r = cluster.kubectl(*command[1:], "--json", check=False, timeout=120)
    assert r.returncode in (0, 1, 2) and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == r.returncode, (doc, r.stderr)
    findings: list[dict[str, str]] = doc["findings"]
    return findings


def finding(findings: list[dict[str, str]], area: str, level: str, start: str) -> dict[str, str]:
    hits = [f for f in findings if f["area"] == area and f["level"] == level and f["text"].startswith(start)]
    assert len(hits) == 1, (area, level, start, findings)
    return hits[0]


def node_uuids() -> list[str]:
    """The node's GPU UUIDs as its driver (the NVML stand-in on the node's own state file) reports them."""
    from nodeagent.nvmlsource import open_nvml

    nvml = open_nvml(MACHINE, SIM_STATE)
    try:
        return sorted(g.uuid for g in nvml.discover().gpus)
    finally:
        nvml.close()


def stand_in_daemonset(stub: str, uuids: list[str], release_dir: Path) -> dict[str, Any]:
    """The stand-in's DaemonSet; its pod, told to go, keeps serving until ``release_dir/stop`` exists."""
    plugin_dir = str(KUBELET_DIR / "device-plugins")
    wait = (f"i=0; while [ ! -e /release/stop ] && [ $i -lt {PRESTOP_MAX_S * 5} ]; do sleep 0.2; i=$((i+1)); "
            "done")
    container = {
        "name": "nvidia-device-plugin", "image": BASE_IMAGE, "imagePullPolicy": "Never",
        "command": [STUB_IN_POD, f"-socket={SOCKET}", f"-kubelet={plugin_dir}/kubelet.sock",
                    f"-resource={RESOURCE}", f"-devices={','.join(uuids)}"],
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", wait]}}},
        "volumeMounts": [{"name": "stub", "mountPath": STUB_IN_POD, "readOnly": True},
                         {"name": "device-plugins", "mountPath": plugin_dir},
                         {"name": "release", "mountPath": "/release", "readOnly": True}],
    }
    return {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": OPERAND, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": OPERAND}},
            "template": {
                "metadata": {"labels": {"app": OPERAND}},
                "spec": {
                    "nodeSelector": {DEPLOY + "device-plugin": "true"},
                    "automountServiceAccountToken": False,
                    "terminationGracePeriodSeconds": PRESTOP_MAX_S + 10,
                    "containers": [container],
                    "volumes": [{"name": "stub", "hostPath": {"path": stub, "type": "File"}},
                                {"name": "device-plugins", "hostPath": {"path": plugin_dir, "type": "Directory"}},
                                {"name": "release", "hostPath": {"path": str(release_dir), "type": "Directory"}}],
                },
            },
        },
    }


def gpu_pod(name: str, command: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0, "containers": [{
                "name": "main", "image": BASE_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", command], "resources": {"limits": {RESOURCE: 1}}}]}}


def operand_pods(cluster: Cluster) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json("pods", "-n", NS, "-l", f"app={OPERAND}")["items"]
    return items


def running(cluster: Cluster, name: str) -> dict[str, Any] | None:
    obj = cluster.get_json("pod", name)
    return obj if obj["status"].get("phase") == "Running" else None


def visible(cluster: Cluster, name: str) -> str:
    return cluster.kubectl("exec", name, "--", "sh", "-c", "echo $NVIDIA_VISIBLE_DEVICES").stdout.strip()


def condition(cluster: Cluster, kind: str) -> dict[str, Any]:
    for c in cluster.node()["status"].get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return {}


def events(cluster: Cluster, reason: str) -> list[dict[str, Any]]:
    from nodeagent.kube.node import EVENT_NAMESPACE

    items: list[dict[str, Any]] = cluster.get_json(
        "events", "-n", EVENT_NAMESPACE,
        f"--field-selector=involvedObject.name={cluster.node_name},reason={reason}")["items"]
    return items


def agent_log(cluster: Cluster) -> str:
    pod = running_agent(cluster)
    if pod is None:
        return ""
    return cluster.kubectl("logs", "-n", "nodeagent", pod["metadata"]["name"], "-c", "nodeagent",
                           check=False).stdout


def series(pod: dict[str, Any], name: str) -> list[str]:
    """The agent's metric ``name`` (its lines), scraped from its pod's address as Prometheus would."""
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:9400/metrics", timeout=5) as r:
        text = r.read().decode()
    return [line for line in text.splitlines() if line.startswith(name + "{")]


@pytest.fixture
def operator_node(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[list[str], Path]]:
    """The node as the GPU Operator leaves it: its deploy labels ``true`` and the stand-in device plugin
    serving the node's GPUs; yields the GPU UUIDs and the file that lets the stand-in stop once its pod is
    told to go. Everything made here and by the agent is removed after."""
    from tests.peers._resolve import peer_binary

    stub = peer_binary("NODEAGENT_GPU_STUB", "nodeagent_peers_harness", "kubelet device-plugin stub")
    uuids = node_uuids()
    assert len(uuids) == GPU_COUNT
    # every operand switched on, as the operator labels a GPU node
    labels = [f"{DEPLOY}{op}=true" for op in OPERANDS]
    release = tmp_path / "release"
    release.mkdir()
    cluster.kubectl("label", "node", cluster.node_name, *labels)
    try:
        cluster.kubectl("create", "namespace", NS)
        cluster.kubectl("apply", "-f", "-", input_text=json.dumps(stand_in_daemonset(str(stub), uuids, release)))
        yield uuids, release / "stop"
    finally:
        (release / "stop").touch()
        cluster.kubectl("delete", "pod", "train", "fresh", "--ignore-not-found", "--grace-period=0", "--force",
                        check=False)
        cluster.kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=true", check=False, timeout=180)
        apply = readme_manifest_commands()[0]
        cluster.kubectl("delete", "--ignore-not-found", "--wait=true", *apply[2:], check=False, timeout=180)
        cluster.kubectl("label", "node", cluster.node_name, "nodeagent.io/gpu-",
                        *(f"{DEPLOY}{op}-" for op in OPERANDS), check=False)
        cluster.kubectl("annotate", "node", cluster.node_name, "nodeagent.io/handed-over-", check=False)


def test_hand_over_from_the_gpu_operator_keeps_the_running_pod(
        cluster: Cluster, operator_node: tuple[list[str], Path]) -> None:
    uuids, let_it_stop = operator_node
    start = time.monotonic()
    # the stand-in serves: its pod Running, registered, the node's 8 GPUs allocatable through it
    cluster.wait_for("the stand-in device plugin registered", lambda: [
        p for p in operand_pods(cluster) if p["status"].get("phase") == "Running" and "registered" in cluster.kubectl(
            "logs", "-n", NS, p["metadata"]["name"], check=False).stdout.split()], timeout=90)
    cluster.wait_for(f"allocatable {RESOURCE}: {GPU_COUNT} from the stand-in",
                     lambda: allocatable(cluster) == GPU_COUNT, timeout=60)
    (operand,) = operand_pods(cluster)
    inode = SOCKET.stat().st_ino
    # a GPU pod on it
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(gpu_pod("train", "sleep 3600")))
    before = cluster.wait_for("pod train Running", lambda: running(cluster, "train"), timeout=90)
    held = pod_devices("train")
    assert len(held) == 1 and held[0] in uuids, held
    assert visible(cluster, "train") == held[0]  # the stand-in's Allocate answer

    # nodeagent from the README's manifests, its ConfigMap with [adopt] gpu_operator = true
    import yaml

    # (the README's registry: where this cluster's imported agent image is named)
    apply, set_image, label = (readme_args(c, cluster, imported_registry(cluster)) for c in readme_manifest_commands())
    cluster.kubectl(*apply)
    cluster.kubectl(*set_image)
    configmap = yaml.safe_load((MANIFESTS / "configmap.yaml").read_text())
    configmap["data"]["config.toml"] += "[adopt]\ngpu_operator = true\n"
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(configmap))
    installed = time.monotonic()
    cluster.kubectl(*label)

    # the hand-over goes through the operator's label; the driver and dcgm-exporter stay NVIDIA's
    cluster.wait_for(f"{DEPLOY}device-plugin=false", lambda: cluster.node()["metadata"]["labels"].get(
        DEPLOY + "device-plugin") == "false", timeout=180)
    labels = cluster.node()["metadata"]["labels"]
    assert labels[DEPLOY + "gpu-feature-discovery"] == "false"
    assert labels[DEPLOY + "driver"] == "true" and labels[DEPLOY + "dcgm-exporter"] == "true", labels
    # no fight while the stand-in still serves (its pod told to go, its preStop waiting for the test): nodeagent
    # says so, waits for the pod and leaves the socket alone
    cluster.wait_for("the stand-in's pod told to go", lambda: [
        p for p in operand_pods(cluster) if p["metadata"]["uid"] == operand["metadata"]["uid"]
        and p["metadata"].get("deletionTimestamp")], timeout=30)
    ready = cluster.wait_for("GPUReady reason AnotherDevicePlugin", lambda: (
        c := condition(cluster, "nodeagent.io/GPUReady")).get("reason") == "AnotherDevicePlugin" and c, timeout=60)
    assert "nvidia-gpu.sock" in ready["message"], ready
    cluster.wait_for("one AnotherDevicePlugin Warning Event", lambda: events(cluster, "AnotherDevicePlugin"),
                     timeout=30)
    cluster.wait_for("the agent waiting for the stand-in's pod",
                     lambda: f"waiting for {NS}/{OPERAND}-" in agent_log(cluster), timeout=30)
    assert [p["metadata"]["uid"] for p in operand_pods(cluster)] == [operand["metadata"]["uid"]]
    assert SOCKET.stat().st_ino == inode, "nodeagent replaced the other plugin's socket"
    assert f"registered {RESOURCE} with the kubelet" not in agent_log(cluster)
    assert visible(cluster, "train") == held[0]

    # the stand-in stops (SIGTERM after its preStop: it removes its socket) and its pod leaves the node;
    # nodeagent registers and serves
    let_it_stop.touch()
    cluster.wait_for("the stand-in's pod gone", lambda: not operand_pods(cluster), timeout=90)
    agent = cluster.wait_for(f"nodeagent registered {RESOURCE}", lambda: (
        f"registered {RESOURCE} with the kubelet" in agent_log(cluster) and running_agent(cluster)), timeout=90)
    cluster.wait_for(f"allocatable {RESOURCE}: {GPU_COUNT} from nodeagent",
                     lambda: allocatable(cluster) == GPU_COUNT, timeout=60)
    served_after = time.monotonic() - installed
    assert SOCKET.exists() and SOCKET.stat().st_ino != inode
    gpus = {g["spec"]["uuid"] for g in cluster.get_json("gpus")["items"]}
    assert gpus == set(uuids), (gpus, uuids)  # the stand-in's device IDs were nodeagent's: same UUIDs

    # the running pod was never disturbed: same container, no restart, same device
    after = running(cluster, "train")
    assert after is not None
    old_status, new_status = before["status"]["containerStatuses"][0], after["status"]["containerStatuses"][0]
    assert new_status["containerID"] == old_status["containerID"] and new_status["restartCount"] == 0, new_status
    assert pod_devices("train") == held
    assert visible(cluster, "train") == held[0]

    # a new GPU pod gets a device from nodeagent, not the held one
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(gpu_pod("fresh", "sleep 3600")))
    cluster.wait_for("pod fresh Running", lambda: running(cluster, "fresh"), timeout=90)
    fresh = pod_devices("fresh")
    assert len(fresh) == 1 and fresh[0] in uuids and fresh[0] != held[0], (fresh, held)
    assert visible(cluster, "fresh") == fresh[0]
    answered = [f'nodeagent_allocate_requests_total{{resource="{RESOURCE}",result="answered"}} 1.0']
    # (the metrics are refreshed every [metrics] interval, 15 s by default)
    cluster.wait_for("nodeagent's count of the Allocate call", lambda: series(
        agent, "nodeagent_allocate_requests_total") == answered, timeout=45, poll=2.0)

    # the conflict is over; it was told once, and the hand-over once
    cluster.wait_for("GPUReady back to AllGpusReady", lambda: condition(
        cluster, "nodeagent.io/GPUReady").get("reason") == "AllGpusReady", timeout=90)
    assert len(events(cluster, "AnotherDevicePlugin")) == 1
    assert len(events(cluster, "GpuOperatorHandedOver")) == 1
    assert [p["metadata"]["uid"] for p in agent_pods(cluster)] == [agent["metadata"]["uid"]]  # never restarted
    handed = time.monotonic()

    # the README's doctor in the agent's pod: what serves the node now
    findings = doctor_in_pod(cluster)
    finding(findings, "driver", "ok", "driver ")
    finding(findings, "gpus", "ok", f"{GPU_COUNT} GPU(s): NVIDIA H100")
    finding(findings, "containerd", "ok", "wired: runtimes ")
    finding(findings, "containerd", "ok", "/etc/containerd/config.toml read by nodeagent only: containerd itself is "
            "not asked under --root /host")
    finding(findings, "kubelet", "ok", f"registered with the kubelet: {RESOURCE} ({GPU_COUNT} devices)")
    finding(findings, "node", "ok", f"allocatable {RESOURCE} {GPU_COUNT} ({GPU_COUNT} GPU(s) discovered)")
    finding(findings, "node", "ok", "handed over from the GPU Operator: container-toolkit, device-plugin, "
            "gpu-feature-discovery, mig-manager switched off")
    running_in = finding(findings, "agent", "ok", "nodeagent run is running (pid ")
    assert f"in pod {agent['metadata']['uid']}" in running_in["text"], running_in
    assert not [f for f in findings if f["level"] == "error"], findings
    doctor_s = time.monotonic() - handed

    # the way back, as the README says: gpu_operator = false, then the release from the agent's pod
    released = time.monotonic()
    configmap["data"]["config.toml"] = configmap["data"]["config.toml"].replace("gpu_operator = true",
                                                                                "gpu_operator = false")
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(configmap))
    command = readme_pod_command("adopt --release")
    out = cluster.kubectl(*command[1:], timeout=120)
    assert json.loads(out.stdout)["labels"] == {
        f"{DEPLOY}{op}": "true" for op in ("container-toolkit", "device-plugin", "gpu-feature-discovery",
                                           "mig-manager")}, out.stdout
    node = cluster.node()
    assert {k: v for k, v in node["metadata"]["labels"].items() if k.startswith(DEPLOY)} == {
        f"{DEPLOY}{op}": "true" for op in OPERANDS}  # what the operator had set
    assert "nodeagent.io/handed-over" not in (node["metadata"].get("annotations") or {})
    # the operator's device plugin comes back and serves; nodeagent stops serving and does not fight it
    cluster.wait_for("nodeagent stopped serving", lambda: f"{RESOURCE} is no longer served: the GPU Operator "
                     "deploys its device plugin" in agent_log(cluster), timeout=60)
    back = cluster.wait_for("the stand-in's pod back and registered", lambda: [
        p for p in operand_pods(cluster) if p["status"].get("phase") == "Running" and "registered" in cluster.kubectl(
            "logs", "-n", NS, p["metadata"]["name"], check=False).stdout.split()], timeout=120)
    assert back[0]["metadata"]["uid"] != operand["metadata"]["uid"]
    cluster.wait_for(f"allocatable {RESOURCE}: {GPU_COUNT} from the stand-in again",
                     lambda: allocatable(cluster) == GPU_COUNT, timeout=60)
    cluster.wait_for("GPUReady reason GpuOperatorDevicePlugin", lambda: condition(
        cluster, "nodeagent.io/GPUReady").get("reason") == "GpuOperatorDevicePlugin", timeout=60)
    theirs = SOCKET.stat().st_ino
    log_before = agent_log(cluster).count(f"registered {RESOURCE} with the kubelet")
    time.sleep(8.0)  # a few of the agent's passes and the kubelet's syncs: nobody takes the socket back
    assert SOCKET.stat().st_ino == theirs, "nodeagent took the socket back from the operator's plugin"
    assert agent_log(cluster).count(f"registered {RESOURCE} with the kubelet") == log_before
    assert [p["metadata"]["uid"] for p in operand_pods(cluster)] == [back[0]["metadata"]["uid"]]
    assert [p["metadata"]["uid"] for p in agent_pods(cluster)] == [agent["metadata"]["uid"]]
    assert running(cluster, "train") is not None and running(cluster, "fresh") is not None
    assert pod_devices("train") == held
    print(f"hand-over: nodeagent served {served_after:.1f}s after its manifests were applied; doctor in the pod "
          f"{doctor_s:.1f}s; release to the stand-in serving again {time.monotonic() - released:.1f}s "
          f"({time.monotonic() - start:.1f}s for the whole test)")
