"""The hand-over from NVIDIA's GPU Operator on real peers: the kubelet's own device manager (the harness), the
real kube-apiserver and ``nodeagent run`` with ``[adopt] gpu_operator = true``.

The other plugin is the kubelet's device-plugin stub (the server of the Kubernetes sample device plugin, in
Go) registering ``nvidia.com/gpu`` on ``nvidia-gpu.sock``, the socket name NVIDIA's plugin and nodeagent both
use, with this node's GPU UUIDs as device IDs, as NVIDIA's plugin does; a container holds one GPU through it.
nodeagent starts, leaves the live socket alone, reports the conflict (the GPUReady reason, one Warning Event, the
``nodeagent_conflict`` metric) and sets ``nvidia.com/gpu.deploy.device-plugin=false``.

What the GPU Operator would do next is simulated by the test, honestly so: there is no operator here. When the
test sees the deploy label ``false`` it stops the stub (SIGTERM: it removes its socket, as NVIDIA's plugin does
when its pod is deleted) and deletes the operand pod from the API, as the operator's DaemonSet controller
would. nodeagent then serves and registers; the running container keeps its GPU (same UUID) and a new
container gets its devices from nodeagent (nodeagent's own count of the kubelet's Allocate calls says it
answered). ``nodeagent adopt --release`` gives the operands back.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.nvmlsource import open_nvml
from tests.e2e._agent import REPO, eventually, node_root, running_agent
from tests.e2e._proxy import forwarded
from tests.peers.apiserver import KubeApiServer, free_port
from tests.peers.gpustub import running_gpu_stub
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers
NS = "gpu-operator"
OPERAND_POD = "nvidia-device-plugin-daemonset-q7x2k"


def _node(server: KubeApiServer, name: str) -> dict[str, Any]:
    status, body = server.get(f"/api/v1/nodes/{name}")
    assert status == 200, body
    doc: dict[str, Any] = json.loads(body)
    return doc


def _condition(server: KubeApiServer, name: str, kind: str) -> dict[str, Any]:
    for c in _node(server, name).get("status", {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return {}


def _events(server: KubeApiServer, node: str, reason: str) -> list[dict[str, Any]]:
    status, body = server.get(
        f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{node},reason%3D{reason}"
    )
    assert status == 200, body
    return list(json.loads(body).get("items") or [])


def _series(port: int, name: str) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def _conflict_series(port: int) -> list[str]:
    return _series(port, "nodeagent_conflict")


def _device_plugin_only_config(root: Path, kubeconfig: Path, extra: str = "") -> Path:
    """The agent's config under ``root``: the API through ``kubeconfig``, resync every 2 s, containerd and MIG
    left alone; ``extra`` (TOML tables) appended."""
    etc = root / "etc/nodeagent"
    etc.mkdir(parents=True)
    cfg = etc / "config.toml"
    cfg.write_text(
        f'kubeconfig = "{kubeconfig}"\nresync_interval = 2.0\n[runtime]\nenabled = false\n[mig]\nenabled = false\n'
        + extra
    )
    return cfg


def _sim_uuids(sim: Path) -> list[str]:
    """The UUIDs of the simulated a30x4 whose state is ``sim`` (made there on first use), sorted."""
    nvml = open_nvml("a30x4", sim)
    try:
        return sorted(g.uuid for g in nvml.discover().gpus)
    finally:
        nvml.close()


@pytest.fixture
def root(kubelet_harness: KubeletHarness) -> Iterator[Path]:
    with node_root(kubelet_harness) as path:
        yield path


def test_hand_over_from_a_plugin_on_the_same_socket_keeps_the_running_container(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness, root: Path
) -> None:
    server, harness, node = kube_apiserver, kubelet_harness, "e2e-adopt"
    server.request("DELETE", f"/api/v1/nodes/{node}")
    operator = {
        f"nvidia.com/gpu.deploy.{op}": "true"
        for op in (
            "driver",
            "device-plugin",
            "gpu-feature-discovery",
            "mig-manager",
            "container-toolkit",
            "dcgm-exporter",
        )
    }
    status, body = server.request(
        "POST",
        "/api/v1/nodes",
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": operator}},
    )
    assert status == 201, body
    server.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    )
    server.request(
        "POST",
        f"/api/v1/namespaces/{NS}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}},
    )
    status, body = server.request(
        "POST",
        f"/api/v1/namespaces/{NS}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": OPERAND_POD, "labels": {"app": "nvidia-device-plugin-daemonset"}},
            "spec": {
                "nodeName": node,
                "automountServiceAccountToken": False,
                "containers": [{"name": "c", "image": "registry.invalid/k8s-device-plugin:v0"}],
            },
        },
    )
    assert status == 201, body

    sim = root / "sim.json"  # the simulated node's state: inside its root
    uuids = _sim_uuids(sim)
    sock = harness.plugin_dir / "nvidia-gpu.sock"
    cfg = _device_plugin_only_config(root, server.kubeconfig, "[metrics]\ninterval = 1.0\n[adopt]\ngpu_operator = true\n")
    port = free_port()
    args = ["run", "--config", str(cfg), "--simulate", "a30x4", "--sim-state", str(sim), "--node-name", node]
    try:
        with running_gpu_stub(sock, harness.kubelet_socket, uuids, tmp_path) as stub:
            harness.wait("nvidia.com/gpu", total=4, registered=True, timeout=15)
            running = harness.allocate("nvidia.com/gpu", 1, pod="train-0", namespace="ml")
            (held,) = running.device_ids
            assert held in uuids and running.envs["NVIDIA_VISIBLE_DEVICES"] == held  # the stub's answer
            inode = sock.stat().st_ino

            with running_agent(tmp_path, root, args, metrics=f"127.0.0.1:{port}") as agent:
                # no fight: the switch goes through the operator's label; the stub keeps its socket
                eventually(
                    lambda: (
                        _node(server, node)["metadata"]["labels"].get("nvidia.com/gpu.deploy.device-plugin")
                        == "false"
                    ),
                    30,
                    "device-plugin deploy label false",
                )
                labels = _node(server, node)["metadata"]["labels"]
                assert labels["nvidia.com/gpu.deploy.driver"] == "true"  # the driver stays NVIDIA's
                assert labels["nvidia.com/gpu.deploy.dcgm-exporter"] == "true"
                ready = eventually(
                    lambda: (
                        _condition(server, node, "nodeagent.io/GPUReady").get("reason")
                        == "AnotherDevicePlugin"
                        and _condition(server, node, "nodeagent.io/GPUReady")
                    ),
                    30,
                    "GPUReady reason AnotherDevicePlugin",
                )
                assert ready["status"] == "True" and "nvidia-gpu.sock" in ready["message"], ready
                series = eventually(lambda: _conflict_series(port), 20, "nodeagent_conflict")
                assert series == [
                    'nodeagent_conflict{kind="device-plugin",owner="nvidia-gpu.sock",'
                    'subject="nvidia.com/gpu"} 1.0'
                ], series
                seq = max((u.seq for u in harness.updates("nvidia.com/gpu")), default=0)
                time.sleep(5.0)  # two resyncs and the register loop's retries: still nothing replaced
                assert sock.stat().st_ino == inode, "nodeagent replaced the other plugin's socket"
                assert stub.proc.poll() is None
                assert all(u.resource.registered for u in harness.updates("nvidia.com/gpu", since=seq))
                assert (
                    len(_events(server, node, "AnotherDevicePlugin")) == 1
                )  # one Warning Event, not one a pass
                assert agent.proc.poll() is None

                # the operator's reaction to the label, simulated: its plugin pod goes, with the plugin
                assert stub.stop() == 0
                assert not sock.exists()
                status, body = server.request(
                    "DELETE", f"/api/v1/namespaces/{NS}/pods/{OPERAND_POD}?gracePeriodSeconds=0"
                )
                assert status == 200, body

                # nodeagent's own word that the kubelet accepted its registration (the kubelet keeps listing the
                # stopped plugin's resource as registered for a while: that state alone proves nothing)
                registered = ['nodeagent_device_plugin_registered{resource="nvidia.com/gpu"} 1.0']
                eventually(
                    lambda: _series(port, "nodeagent_device_plugin_registered") == registered,
                    30,
                    "nodeagent registered",
                )
                assert sock.exists()
                harness.wait("nvidia.com/gpu", total=4, healthy=4, registered=True, timeout=30)
                fresh = harness.allocate("nvidia.com/gpu", 1, pod="infer-0", namespace="ml")
                assert fresh.device_ids[0] in uuids and fresh.device_ids[0] != held  # the held GPU stays held
                assert fresh.envs["NVIDIA_VISIBLE_DEVICES"] == fresh.device_ids[0]
                # nodeagent answered it (its own count of the kubelet's Allocate calls), not the stub
                answered = [
                    'nodeagent_allocate_requests_total{resource="nvidia.com/gpu",result="answered"} 1.0'
                ]
                eventually(
                    lambda: _series(port, "nodeagent_allocate_requests_total") == answered,
                    10,
                    "nodeagent's count of the Allocate call",
                )
                health = harness.pod_health("ml/train-0")
                assert health.containers["main"]["nvidia.com/gpu"] == {held: "Healthy"}, health
                eventually(
                    lambda: _condition(server, node, "nodeagent.io/GPUReady").get("reason") == "AllGpusReady",
                    30,
                    "GPUReady back to AllGpusReady",
                )
                eventually(lambda: _conflict_series(port) == [], 20, "nodeagent_conflict gone")
                assert len(_events(server, node, "GpuOperatorHandedOver")) == 1

                # back to the operator while nodeagent still runs: the labels true again; nodeagent stops serving
                # (its socket goes) and leaves the name to the operator's plugin when it comes back, no fight
                back = subprocess.run(
                    [sys.executable, "-m", "nodeagent", "adopt", "--release", "--node-name", node,
                     "--kubeconfig", str(server.kubeconfig)],
                    cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
                )
                assert back.returncode == 0, back.stderr
                labels = _node(server, node)["metadata"]["labels"]
                assert {k: v for k, v in labels.items() if k.startswith("nvidia.com/gpu.deploy.")} == operator
                eventually(lambda: not sock.exists(), 15, "nodeagent's socket gone after the release")
                assert ("nvidia.com/gpu is no longer served: the GPU Operator deploys its device plugin on this node"
                        in agent.log())
                eventually(
                    lambda: _condition(server, node, "nodeagent.io/GPUReady").get("reason")
                    == "GpuOperatorDevicePlugin",
                    20,
                    "GPUReady reason GpuOperatorDevicePlugin",
                )
                again_dir = tmp_path / "operator-again"
                again_dir.mkdir()
                with running_gpu_stub(sock, harness.kubelet_socket, uuids, again_dir) as again:
                    inode = sock.stat().st_ino
                    harness.wait("nvidia.com/gpu", total=4, registered=True, timeout=15)
                    time.sleep(5.0)  # two resyncs: nodeagent neither replaces the socket nor registers
                    assert sock.stat().st_ino == inode and again.proc.poll() is None
                    assert _series(port, "nodeagent_device_plugin_registered") == [
                        'nodeagent_device_plugin_registered{resource="nvidia.com/gpu"} 0.0']
                    assert agent.proc.poll() is None
    finally:
        server.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{OPERAND_POD}?gracePeriodSeconds=0")
        server.request("DELETE", f"/api/v1/nodes/{node}")


def test_a_plugin_under_another_socket_name_is_not_fought(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness, root: Path
) -> None:
    """Another plugin registering nvidia.com/gpu under its own socket name (the sample device plugin's style,
    ``dp.<time>``) listing this node's GPU UUIDs: nodeagent serves its own socket but does not register (the
    kubelet would drop the other's registration for it) while the other one is there; once it stops,
    nodeagent registers at its next pass."""
    server, harness, node = kube_apiserver, kubelet_harness, "e2e-adopt-other"
    server.request("DELETE", f"/api/v1/nodes/{node}")
    status, body = server.request(
        "POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
    )
    assert status == 201, body
    sim = root / "sim.json"  # the simulated node's state: inside its root
    uuids = _sim_uuids(sim)
    cfg = _device_plugin_only_config(root, server.kubeconfig, "[metrics]\ninterval = 1.0\n")
    port = free_port()
    args = ["run", "--config", str(cfg), "--simulate", "a30x4", "--sim-state", str(sim), "--node-name", node]
    registered = 'nodeagent_device_plugin_registered{resource="nvidia.com/gpu"}'
    try:
        with running_gpu_stub(
            harness.plugin_dir / "dp.1700000000", harness.kubelet_socket, uuids, tmp_path
        ) as stub:
            harness.wait("nvidia.com/gpu", total=4, registered=True, timeout=15)
            with running_agent(tmp_path, root, args, metrics=f"127.0.0.1:{port}") as agent:
                ready = eventually(
                    lambda: (
                        _condition(server, node, "nodeagent.io/GPUReady").get("reason")
                        == "AnotherDevicePlugin"
                        and _condition(server, node, "nodeagent.io/GPUReady")
                    ),
                    30,
                    "GPUReady reason AnotherDevicePlugin",
                )
                assert "dp.1700000000" in ready["message"], ready
                assert "nvidia.com/gpu is not registered: another device plugin serves" in agent.log()
                assert (harness.plugin_dir / "nvidia-gpu.sock").exists()  # served, not registered
                eventually(
                    lambda: _series(port, "nodeagent_device_plugin_registered") == [registered + " 0.0"],
                    20,
                    "registered 0",
                )
                time.sleep(4.0)  # two resyncs: still not registered; the kubelet still uses the other plugin
                assert _series(port, "nodeagent_device_plugin_registered") == [registered + " 0.0"]
                during = harness.allocate("nvidia.com/gpu", 1, pod="train-0", namespace="ml")
                (held,) = during.device_ids
                time.sleep(1.5)
                assert _series(port, "nodeagent_allocate_requests_total") == []  # the other plugin answered
                assert len(_events(server, node, "AnotherDevicePlugin")) == 1

                assert stub.stop() == 0
                eventually(
                    lambda: _series(port, "nodeagent_device_plugin_registered") == [registered + " 1.0"],
                    30,
                    "nodeagent registered",
                )
                harness.wait("nvidia.com/gpu", total=4, registered=True, timeout=30)
                fresh = harness.allocate("nvidia.com/gpu", 1, pod="infer-0", namespace="ml")
                assert fresh.device_ids[0] != held
                answered = [
                    'nodeagent_allocate_requests_total{resource="nvidia.com/gpu",result="answered"} 1.0'
                ]
                eventually(
                    lambda: _series(port, "nodeagent_allocate_requests_total") == answered, 10, "answered"
                )
                eventually(
                    lambda: _condition(server, node, "nodeagent.io/GPUReady").get("reason") == "AllGpusReady",
                    30,
                    "GPUReady back to AllGpusReady",
                )
    finally:
        server.request("DELETE", f"/api/v1/nodes/{node}")


def test_another_dra_driver_and_a_mig_manager_seen_by_the_agent(
    tmp_path: Path, kube_apiserver: KubeApiServer
) -> None:
    """The API's conflicts as the running agent sees them: another DRA driver's ResourceSlice listing one of
    the node's GPU UUIDs, and nvidia.com/mig.config.state written by NVIDIA's mig-manager (its field manager):
    both in GPUReady's message (the reason is the first), one Warning Event each."""
    server, node = kube_apiserver, "e2e-adopt-api"
    server.request("DELETE", f"/api/v1/nodes/{node}")
    status, body = server.request(
        "POST",
        "/api/v1/nodes?fieldManager=nvidia-mig-manager",
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": node, "labels": {"nvidia.com/mig.config.state": "success"}},
        },
    )
    assert status == 201, body
    sim = tmp_path / "sim.json"
    first = _sim_uuids(sim)[0]
    slice_name = f"{node}-gpu.nvidia.com"
    status, body = server.request(
        "POST",
        "/apis/resource.k8s.io/v1/resourceslices",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": slice_name},
            "spec": {
                "driver": "gpu.nvidia.com",
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-0", "attributes": {"uuid": {"string": first}}}],
            },
        },
    )
    assert status == 201, body
    with node_root() as root:
        cfg = _device_plugin_only_config(root, server.kubeconfig)
        shutil.copyfile(sim, root / "sim.json")  # the simulated node's state: inside its root
        args = [
            "run",
            "--config",
            str(cfg),
            "--simulate",
            "a30x4",
            "--sim-state",
            str(root / "sim.json"),
            "--node-name",
            node,
        ]
        try:
            with running_agent(tmp_path, root, args):
                ready = eventually(
                    lambda: (
                        _condition(server, node, "nodeagent.io/GPUReady").get("reason") == "AnotherDraDriver"
                        and _condition(server, node, "nodeagent.io/GPUReady")
                    ),
                    30,
                    "GPUReady reason AnotherDraDriver",
                )
                assert "2 conflict(s) with another agent" in ready["message"], ready
                assert (
                    f"DRA driver gpu.nvidia.com publishes ResourceSlices with this node's GPUs ({first})"
                    in (ready["message"])
                )
                assert "was written by nvidia-mig-manager" in ready["message"], ready
                eventually(
                    lambda: len(_events(server, node, "AnotherMigManager")) == 1, 15, "the MIG manager Event"
                )
                assert len(_events(server, node, "AnotherDraDriver")) == 1

                server.request("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{slice_name}")
                ready = eventually(
                    lambda: (
                        _condition(server, node, "nodeagent.io/GPUReady").get("reason") == "AnotherMigManager"
                        and _condition(server, node, "nodeagent.io/GPUReady")
                    ),
                    30,
                    "the DRA conflict gone at a resync",
                )
                assert "1 conflict(s)" in ready["message"], ready
        finally:
            server.request("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{slice_name}")
            server.request("DELETE", f"/api/v1/nodes/{node}")


def test_the_operator_switch_on_at_start_keeps_the_agent_from_ever_serving(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness, root: Path
) -> None:
    """A node where the GPU Operator is about to deploy its device plugin (``nvidia.com/gpu.deploy.device-plugin
    =true``, its plugin not serving yet): nodeagent, started there without a hand-over and reaching the API
    through a slow link (each answer held back 0.15 s), never creates its socket nor registers, not even for
    the moment between its start and its first look at the API (sampled every 20 ms from the start); once the
    switch is off, it serves and registers."""
    server, harness, node = kube_apiserver, kubelet_harness, "e2e-adopt-switch"
    server.request("DELETE", f"/api/v1/nodes/{node}")
    labels = {"nvidia.com/gpu.deploy.device-plugin": "true", "nvidia.com/gpu.deploy.driver": "true"}
    status, body = server.request(
        "POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}}
    )
    assert status == 201, body
    kubeconfig = tmp_path / "kubeconfig"
    slow = forwarded(server.url, server.kubeconfig, kubeconfig, latency_s=0.15)
    cfg = _device_plugin_only_config(root, kubeconfig)
    sock = harness.plugin_dir / "nvidia-gpu.sock"
    args = ["run", "--config", str(cfg), "--simulate", "a30x4", "--sim-state", str(root / "sim.json"),
            "--node-name", node]
    try:
        with running_agent(tmp_path, root, args) as agent:
            seen: list[str] = []
            reason = ""
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and reason != "GpuOperatorDevicePlugin":
                if sock.exists():
                    seen.append("socket")
                if "nvidia.com/gpu" in harness.resources():
                    seen.append("registered")
                reason = str(_condition(server, node, "nodeagent.io/GPUReady").get("reason"))
                time.sleep(0.02)
            assert reason == "GpuOperatorDevicePlugin", agent.log()
            settle = time.monotonic() + 2.0  # two resyncs more
            while time.monotonic() < settle:
                if sock.exists():
                    seen.append("socket")
                time.sleep(0.02)
            assert seen == [], (seen, agent.log())
            assert "nvidia.com/gpu" not in harness.resources()

            status, body = server.request(
                "PATCH",
                f"/api/v1/nodes/{node}",
                {"metadata": {"labels": {"nvidia.com/gpu.deploy.device-plugin": "false"}}},
                content_type="application/merge-patch+json",
            )
            assert status == 200, body
            harness.wait("nvidia.com/gpu", total=4, registered=True, timeout=30)
            assert sock.exists()
    finally:
        slow.cut()
        server.request("DELETE", f"/api/v1/nodes/{node}")


def test_an_api_that_does_not_answer_does_not_hold_up_the_kubelet_side(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness, root: Path
) -> None:
    """The API server accepts connections but answers nothing (a forwarder holding every answer back for
    120 s): the conflict detection's look at the API waits in the background, and the device plugin
    registers with the kubelet within seconds of the start all the same."""
    server, harness = kube_apiserver, kubelet_harness
    kubeconfig = tmp_path / "kubeconfig"
    mute = forwarded(server.url, server.kubeconfig, kubeconfig, latency_s=120.0)
    cfg = _device_plugin_only_config(root, kubeconfig)
    args = ["run", "--config", str(cfg), "--simulate", "a30x4", "--sim-state", str(root / "sim.json"),
            "--node-name", "e2e-adopt-mute"]
    try:
        with running_agent(tmp_path, root, args) as agent:
            started = time.monotonic()
            harness.wait("nvidia.com/gpu", total=4, registered=True, timeout=20)
            took = time.monotonic() - started
            assert took < 10, (took, agent.log())
            assert "component device-plugin started" in agent.log()
    finally:
        mute.cut()
