"""Remediation against the REAL kube-apiserver, the NVML simulator as the GPUs: XID 48 on GPU 3 evicts the pod
on GPU 3 through the Eviction API only once its PodDisruptionBudget allows it, never the pod on GPU 5; the
Node carries the remediation condition while it runs and an Event per step; a failure sets the
reboot-required condition and (when configured) cordons the node.

There is no kubelet: the test plays its part for the two pods (status Running/Ready; a terminating pod is
finalised and its simulated GPU process ended) and the disruption controller's (the PDB status).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.errors import KubeError
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient
from nodeagent.kube.node import NodeClient
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.remediation.kubeside import KubeNodeSide, KubePods
from nodeagent.remediation.pipeline import (
    CONDITION_REBOOT,
    CONDITION_RUNNING,
    Fault,
    PipelineSettings,
    Remediator,
)
from nodeagent.remediation.planner import facts_from_inventory
from nodeagent.remediation.policy import load_catalog
from nodeagent.remediation.record import RecordStore
from nodeagent.simulator import inject
from nodeagent.simulator.open import open_sim
from nodeagent.simulator.reset import SimGroupResetter
from tests.integration._kube import wait_for

pytestmark = pytest.mark.peers


@pytest.fixture
def namespace(kube: KubeClient) -> Iterator[str]:
    ns = f"remediation-{uuid.uuid4().hex[:6]}"
    kube.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": ns}})
    yield ns
    kube.request("DELETE", f"/api/v1/namespaces/{ns}")


def _pod(kube: KubeClient, ns: str, name: str, node: str) -> None:
    kube.request("POST", f"/api/v1/namespaces/{ns}/pods", body={
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "stand-in"}]}})
    now = "2026-01-01T00:00:00Z"
    kube.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", content_type="application/merge-patch+json",
                 body={"status": {"phase": "Running", "conditions": [
                     {"type": "Ready", "status": "True", "lastTransitionTime": now}]}})


def _pdb(kube: KubeClient, ns: str, app: str) -> None:
    kube.request("POST", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", body={
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": app},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": app}}}})


def _allow(kube: KubeClient, ns: str, app: str, allowed: int) -> None:
    """The disruption controller's part: the budget's status."""
    path = f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{app}"
    gen = kube.request("GET", path)["metadata"]["generation"]
    kube.request("PATCH", path + "/status", content_type="application/merge-patch+json", body={"status": {
        "observedGeneration": gen, "disruptionsAllowed": allowed, "currentHealthy": 1 + allowed,
        "desiredHealthy": 1, "expectedPods": 1 + allowed}})


class KubeletStandIn:
    """Finalises the node's terminating pods and ends their GPU processes (what a kubelet and the container
    runtime would do after an eviction)."""

    def __init__(self, kube: KubeClient, ns: str, store: Any, pids: dict[str, tuple[int, int]]) -> None:
        self.kube, self.ns, self.store, self.pids = kube, ns, store, pids
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            for pod in self.kube.request("GET", f"/api/v1/namespaces/{self.ns}/pods").get("items", []):
                meta = pod["metadata"]
                if meta.get("deletionTimestamp"):
                    gpu, pid = self.pids[meta["name"]]
                    inject.kill_process(self.store, gpu, pid)
                    with contextlib.suppress(KubeError):
                        self.kube.request("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{meta['name']}",
                                          body={"gracePeriodSeconds": 0})

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def _conditions(kube: KubeClient, node: str) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in kube.request("GET", f"/api/v1/nodes/{node}")["status"].get("conditions", [])}


def test_xid_48_evicts_only_the_gpus_own_pod_when_its_budget_allows(
        kube: KubeClient, node_name: str, namespace: str, tmp_path: Path) -> None:
    sim = open_sim("dgx-h100")
    nvml = adapter_for_sim(sim, HostPaths(tmp_path))
    inv = nvml.discover()
    gpus = facts_from_inventory(inv)
    uuid_of = {g.index: g.uuid for g in inv.gpus}
    pids = {"on-3": (3, 3003), "on-5": (5, 5005)}
    for name, (gpu, pid) in pids.items():
        _pod(kube, namespace, name, node_name)
        inject.inject_process(sim.store, gpu, pid, "python")
    _pdb(kube, namespace, "on-3")
    holders = {uuid_of[3]: [f"{namespace}/on-3"], uuid_of[5]: [f"{namespace}/on-5"]}
    node = NodeClient(kube, node_name)
    rem = Remediator(PipelineSettings(eviction_grace_s=30, eviction_timeout_s=20, step_timeout_s=10, poll_s=0.05),
                     load_catalog(), nvml, SimGroupResetter(sim), KubePods(kube), KubeNodeSide(node),
                     store=RecordStore(tmp_path / "remediation.json"))
    kubelet = KubeletStandIn(kube, namespace, sim.store, pids)
    try:
        inject.inject_xid(sim.store, 3, 48)

        async def scenario() -> Any:
            task = asyncio.create_task(rem.handle(Fault(uuid_of[3], 48), gpus, holders))
            # the budget has not been computed yet: the eviction is refused and retried, the pod stays
            await asyncio.to_thread(wait_for, lambda: _conditions(kube, node_name).get(CONDITION_RUNNING, {})
                                    .get("status") == "True")
            await asyncio.sleep(0.5)
            assert not task.done()
            kube.request("GET", f"/api/v1/namespaces/{namespace}/pods/on-3")  # still there
            await asyncio.to_thread(_allow, kube, namespace, "on-3", 1)
            return await task

        out = asyncio.run(scenario())
    finally:
        kubelet.close()
    assert out.result == "done", out.detail
    names = [p["metadata"]["name"] for p in kube.request("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]]
    assert names == ["on-5"]
    assert nvml.process_count(uuid_of[5]) == 1
    conds = _conditions(kube, node_name)
    assert conds[CONDITION_RUNNING]["status"] == "False" and CONDITION_REBOOT not in conds
    reasons = [e["reason"] for e in node.list_events()]
    assert reasons.count("GPURemediationStep") == 8 and "GPURemediated" in reasons


def test_a_gpu_that_cannot_be_reset_stays_out_and_the_node_is_cordoned_when_configured(
        kube: KubeClient, node_name: str, tmp_path: Path) -> None:
    sim = open_sim("dgx-h100")
    nvml = adapter_for_sim(sim, HostPaths(tmp_path))
    gpus = facts_from_inventory(nvml.discover())
    target = next(u for u, g in gpus.items() if g.index == 2)
    node = NodeClient(kube, node_name)
    rem = Remediator(PipelineSettings(step_timeout_s=5, cordon_on_failure=True), load_catalog(), nvml,
                     SimGroupResetter(sim), KubePods(kube), KubeNodeSide(node))
    inject.fail_next(sim.store, "simResetGpu", 999)
    out = asyncio.run(rem.handle(Fault(target, 95), gpus, {}))
    assert out.result == "failed"
    conds = _conditions(kube, node_name)
    assert conds[CONDITION_REBOOT]["status"] == "True" and conds[CONDITION_REBOOT]["reason"] == "GPURecoveryFailed"
    assert kube.request("GET", f"/api/v1/nodes/{node_name}")["spec"].get("unschedulable") is True
    events = {e["reason"]: e for e in node.list_events()}
    assert events["NodeRebootRequired"]["type"] == "Warning" and target in events["NodeRebootRequired"]["message"]
