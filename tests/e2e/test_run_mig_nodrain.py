"""``nodeagent run`` on a simulated DGX A100 (mixed MIG strategy) with the real kube-apiserver and the real
kubelet device manager (PodResources v1, ResourceHealthStatus on): a MIG change by label touches only the
GPUs whose layout changes, waits for the pods holding them (bounded by ``mig.release_timeout``), never
touches a GPU a pod holds, and the device health reaches the container that holds the device.

One agent and one harness serve the whole module; every test picks GPUs no other test uses."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from nodeagent.kube.conditions import GPU_READY, MIG_CONFIGURED
from nodeagent.simulator.inject import inject_process, inject_xid, kill_process, set_recovery_action
from nodeagent.simulator.state import SimStore
from tests.e2e._agent import Agent, eventually, fresh_node_with_gpu_crd, node_root, running_agent
from tests.peers.apiserver import KubeApiServer
from tests.peers.harness import KubeletHarness, running_harness

pytestmark = pytest.mark.peers

MACHINE = "dgx-a100-40gb"
NODE = "e2e-mig-nodrain"
GPU = "nvidia.com/gpu"
MIG_RESOURCE = "nvidia.com/mig-3g.20gb"
RELEASE_TIMEOUT_S = 8.0
MIXED = "version: v1\nflags:\n  migStrategy: mixed\n"


def mig_configs() -> str:
    """One config per GPU: that GPU alone into 2 x 3g.20gb, every other GPU not selected (left alone)."""
    lines = ["version: v1", "mig-configs:"]
    for i in range(8):
        lines += [f"  gpu{i}-3g:", f"    - devices: [{i}]", "      mig-enabled: true", "      mig-devices:",
                  '        "3g.20gb": 2']
    return "\n".join(lines) + "\n"


@dataclass
class Node:
    server: KubeApiServer
    harness: KubeletHarness
    agent: Agent
    store: SimStore

    def uuid(self, gpu: int) -> str:
        return self.store.machine.gpus[gpu].uuid

    def index(self, uuid: str) -> int:
        (found,) = [i for i, g in enumerate(self.store.machine.gpus) if g.uuid == uuid]
        return found

    def gpu_state(self, gpu: int) -> dict[str, Any]:
        state: dict[str, Any] = self.store.read()["gpus"][gpu]
        return state

    def labels(self) -> dict[str, str]:
        status, body = self.server.get(f"/api/v1/nodes/{NODE}")
        assert status == 200, body
        found: dict[str, str] = json.loads(body)["metadata"].get("labels") or {}
        return found

    def state(self) -> str | None:
        return self.labels().get("nvidia.com/mig.config.state")

    def request(self, config: str) -> None:
        """Select ``config``; a new generation makes even the value of an earlier request apply again."""
        meta = {"labels": {"nvidia.com/mig.config": config},
                "annotations": {"nodeagent.io/mig.config.generation": str(time.time_ns())}}
        status, body = self.server.request("PATCH", f"/api/v1/nodes/{NODE}", {"metadata": meta},
                                           content_type="application/merge-patch+json")
        assert status == 200, body

    def condition(self, type_: str) -> tuple[str, str, str]:
        status, body = self.server.get(f"/api/v1/nodes/{NODE}")
        assert status == 200, body
        for c in json.loads(body).get("status", {}).get("conditions") or []:
            if c["type"] == type_:
                return c["status"], c.get("reason", ""), c.get("message", "")
        return "", "", ""

    def events(self, reason: str) -> list[dict[str, Any]]:
        status, body = self.server.get(
            f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{NODE}")
        assert status == 200, body
        return [e for e in json.loads(body)["items"] if e["reason"] == reason]

    def listed(self, resource: str = GPU) -> set[str]:
        found = self.harness.resources().get(resource)
        return {d.id for d in found.devices} if found is not None else set()

    def hold(self, pod: str) -> tuple[str, int]:
        """A pod of namespace ``ml`` admitted with one whole GPU (one still in MIG-less mode: only those
        are listed as nvidia.com/gpu); (pod UID, GPU index)."""
        alloc = self.harness.allocate(GPU, 1, pod=pod, namespace="ml", container="main")
        (device,) = alloc.device_ids
        return alloc.pod_uid, self.index(device)

    def free_gpu(self) -> int:
        """A MIG-less GPU no pod holds."""
        held = {self.index(d) for a in self.harness_assignments() for d in a}
        return min(i for i in range(8) if i not in held and not self.gpu_state(i)["mig_current"])

    def harness_assignments(self) -> list[tuple[str, ...]]:
        from nodeagent.kube.podresources import PodResourcesClient

        client = PodResourcesClient(self.harness.pod_resources_socket)
        try:
            return [a.device_ids for a in client.list() if a.resource == GPU]
        finally:
            client.close()


@pytest.fixture(scope="module")
def node(kube_apiserver: KubeApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("mig-nodrain")
    fresh_node_with_gpu_crd(kube_apiserver, NODE)
    with running_harness() as harness, node_root(harness) as root:
        etc = root / "etc/nodeagent"
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "dp.yaml").write_text(MIXED)
        (etc / "mig-config.yaml").write_text(mig_configs())
        cfg = etc / "config.toml"
        cfg.write_text(f'kubeconfig = "{kube_apiserver.kubeconfig}"\nresync_interval = 1.0\n'
                       '[device_plugin]\nconfig = "/etc/nodeagent/dp.yaml"\n'
                       f'[mig]\nconfig_file = "/etc/nodeagent/mig-config.yaml"\nrelease_timeout = {RELEASE_TIMEOUT_S}\n'
                       "[runtime]\nenabled = false\n"
                       "[health]\nwindow = 2.0\npoll_interval = 1.0\n"
                       '[kubelet]\npod_resources_socket = "/var/lib/kubelet/pod-resources.sock"\n')
        sim_state = tmp / "sim.json"
        args = ["run", "--config", str(cfg), "--simulate", MACHINE, "--sim-state", str(sim_state),
                "--node-name", NODE]
        with running_agent(tmp, root, args) as agent:
            agent.wait_notify("READY=1", timeout=30)
            harness.wait(GPU, registered=True, total=8, healthy=8, timeout=20)
            eventually(lambda: gpu_ready(kube_apiserver), 20, "GPUReady True")
            yield Node(kube_apiserver, harness, agent, SimStore.open(MACHINE, sim_state))


def gpu_ready(server: KubeApiServer) -> bool:
    status, body = server.get(f"/api/v1/nodes/{NODE}")
    return status == 200 and any(c["type"] == GPU_READY and c["status"] == "True"
                                 for c in json.loads(body).get("status", {}).get("conditions") or [])


def test_busy_gpu_keeps_serving_while_another_gpu_is_reconfigured(node: Node) -> None:
    uid, busy = node.hold("keep")
    inject_process(node.store, busy, 4242, "python train.py")  # the pod's process on its GPU
    target = node.free_gpu()
    seq0 = max((u.seq for u in node.harness.updates()), default=0)
    untouched = {node.uuid(i) for i in range(8) if i != target}

    node.request(f"gpu{target}-3g")
    eventually(lambda: node.state() == "success", 30, "mig.config.state=success")
    _, mig = node.harness.wait(MIG_RESOURCE, registered=True, total=2, timeout=20)

    # GPU `target` is done: MIG on, two 3g.20gb devices listed; its whole-GPU device gone
    assert node.gpu_state(target)["mig_current"] is True
    assert len(node.gpu_state(target)["gis"]) == 2
    assert len(mig.devices) == 2
    assert node.uuid(target) not in node.listed()
    # every whole-GPU list the kubelet received since the request still had the other 7 GPUs, the busy one
    # included: the busy GPU never left ListAndWatch
    gpu_updates = [u for u in node.harness.updates(GPU, since=seq0)]
    assert gpu_updates, "the kubelet saw no change of nvidia.com/gpu"
    for u in gpu_updates:
        ids = {d.id for d in u.resource.devices}
        assert untouched <= ids, (u.seq, sorted(untouched - ids))
        assert u.resource.device(node.uuid(busy)).health == "Healthy"
    # the busy GPU was never reset (a reset ends its processes) and is as it was
    busy_state = node.gpu_state(busy)
    assert [p["pid"] for p in busy_state["processes"]] == [4242]
    assert busy_state["mig_current"] is False and busy_state["gis"] == []
    assert node.harness.pod_health(uid).containers == {"main": {GPU: {node.uuid(busy): "Healthy"}}}
    assert node.condition(GPU_READY)[0] == "True"
    eventually(lambda: node.condition(MIG_CONFIGURED)[:2] == ("True", "MigConfigApplied"), 10,
               "MIGConfigured True")
    kill_process(node.store, busy)
    node.harness.release(uid)


def test_held_gpu_times_out_failed_naming_the_pod_and_nothing_changes(node: Node) -> None:
    uid, held = node.hold("hold")
    inject_process(node.store, held, 4343, "python serve.py")
    before = node.gpu_state(held)
    others = node.listed() - {node.uuid(held)}
    waiting_before = len(node.events("MigWaitingForPods"))
    failed_before = len(node.events("MigConfigFailed"))

    started = time.monotonic()
    node.request(f"gpu{held}-3g")
    # withdrawn at once: its device leaves the kubelet's list, the others stay; GPUReady stays True
    node.harness.wait(GPU, total=len(others), timeout=20)
    assert node.listed() == others
    assert node.state() == "pending"
    eventually(lambda: node.condition(MIG_CONFIGURED)[:2] == ("False", "MigConfigPending"), 10,
               "MIGConfigured MigConfigPending")
    assert node.condition(GPU_READY)[0] == "True"  # withdrawn for a MIG change is not unready
    eventually(lambda: len(node.events("MigWaitingForPods")) > waiting_before, 10, "MigWaitingForPods event")

    eventually(lambda: node.state() == "failed", RELEASE_TIMEOUT_S + 20, "mig.config.state=failed")
    assert time.monotonic() - started >= RELEASE_TIMEOUT_S
    (event,) = node.events("MigConfigFailed")[failed_before:]
    assert event["type"] == "Warning"
    message = event["message"]
    assert f"GPU {held} is held by pod ml/hold" in message and "nothing was changed" in message, message
    assert f"(processes: GPU {held}: pid 4343 (python serve.py))" in message, message  # NVML's view too
    eventually(lambda: node.condition(MIG_CONFIGURED)[:2] == ("False", "MigConfigFailed"), 10,
               "MIGConfigured MigConfigFailed")
    assert "ml/hold" in node.condition(MIG_CONFIGURED)[2]
    # nothing applied, nothing reset; the GPU is advertised again as it was and the pod still holds it
    assert node.gpu_state(held) == before
    node.harness.wait(GPU, total=len(others) + 1, timeout=10)
    assert node.uuid(held) in node.listed()
    assert node.harness.pod_health(uid).containers == {"main": {GPU: {node.uuid(held): "Healthy"}}}
    assert node.condition(GPU_READY)[0] == "True"
    kill_process(node.store, held)
    node.harness.release(uid)


def test_pod_released_within_the_timeout_then_applied(node: Node) -> None:
    uid, held = node.hold("brief")
    inject_process(node.store, held, 4444, "python batch.py")
    t0 = time.monotonic()
    node.request(f"gpu{held}-3g")
    try:
        eventually(lambda: node.uuid(held) not in node.listed(), 20, "the held GPU withdrawn")
    except AssertionError as e:
        raise AssertionError(f"{e}; GPU {held}, state {node.state()}\n{node.agent.log()[-6000:]}") from e
    withdrawn_s = time.monotonic() - t0
    time.sleep(1.0)
    assert node.state() == "pending"
    assert node.gpu_state(held)["mig_current"] is False  # not touched while the pod holds it
    # the pod ends: its process exits, the kubelet frees the device
    kill_process(node.store, held)
    node.harness.release(uid)
    t1 = time.monotonic()
    eventually(lambda: node.state() == "success", RELEASE_TIMEOUT_S + 20, "mig.config.state=success")
    figures = {"label_to_withdrawn_s": round(withdrawn_s, 3), "release_to_success_s": round(time.monotonic() - t1, 3)}
    print("mig no-drain:", json.dumps(figures))
    assert node.gpu_state(held)["mig_current"] is True and len(node.gpu_state(held)["gis"]) == 2
    # in MIG mode now: never listed as a whole GPU again (a stale resync once listed it after success)
    assert node.uuid(held) not in node.listed(), node.agent.log()[-6000:]


def test_xid_reaches_the_container_holding_the_device_and_the_event_names_the_pod(node: Node) -> None:
    uid, gpu = node.hold("xid")
    device = node.uuid(gpu)
    assert node.harness.pod_health(uid).containers == {"main": {GPU: {device: "Healthy"}}}
    unhealthy_before = len(node.events("GpuUnhealthy"))

    inject_xid(node.store, gpu, 48, recovery_action=1)  # double-bit ECC; the driver asks for a GPU reset
    node.harness.wait(GPU, device=device, health="Unhealthy", timeout=20)
    health = node.harness.pod_health(uid)
    assert health.containers == {"main": {GPU: {device: "Unhealthy"}}}
    # the manager asked (on its Updates channel, read by the harness as the kubelet's sync loop reads it)
    # for the pod's status to be synced
    eventually(lambda: node.harness.pod_health(uid).updates >= 1, 5, "a status update asked for the pod")
    health = node.harness.pod_health(uid)
    eventually(lambda: len(node.events("GpuUnhealthy")) > unhealthy_before, 20, "GpuUnhealthy event")
    event = node.events("GpuUnhealthy")[-1]
    assert event["type"] == "Warning"
    assert f"GPU {gpu} ({device}" in event["message"] and "ml/xid" in event["message"], event["message"]

    set_recovery_action(node.store, gpu, 0)  # reset done; healthy again after the recovery window
    node.harness.wait(GPU, device=device, health="Healthy", timeout=30)
    assert node.harness.pod_health(uid).containers == {"main": {GPU: {device: "Healthy"}}}
    eventually(lambda: node.harness.pod_health(uid).updates > health.updates, 5,
               "a status update asked for the pod after the recovery")
    node.harness.release(uid)
