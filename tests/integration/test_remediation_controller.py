"""Controller-executed evictions against the REAL kube-apiserver: the agent's pipeline asks on its own Node
(``ControllerPods``), ``nodeagent controller``'s broker (``EvictionBroker``) checks and evicts.

- XID 48 on GPU 3, ``nodeagent controller --no-computedomains --remediation`` running as a process: the pod
  holding GPU 3 through the device plugin is evicted only once its
  PodDisruptionBudget allows it, the pod holding GPU 5 never; the request is withdrawn when the pod is gone;
- a pod holding a GPU through a DRA claim allocated from the node's pool is found by the controller too;
- requests naming a pod of another node, or a pod without a GPU of the node, are refused and change nothing.

The RBAC and admission side (which token may write what) is tests/e2e/test_kube_confinement.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import MERGE_PATCH, KubeClient
from nodeagent.kube.node import NodeClient
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.remediation import evictreq as er
from nodeagent.remediation.broker import EvictionBroker
from nodeagent.remediation.kubeside import KubeNodeSide
from nodeagent.remediation.nodepods import ControllerPods, EvictionRefused
from nodeagent.remediation.pipeline import Fault, PipelineSettings, Remediator
from nodeagent.remediation.planner import facts_from_inventory
from nodeagent.remediation.policy import load_catalog
from nodeagent.simulator import inject
from nodeagent.simulator.open import open_sim
from nodeagent.simulator.reset import SimGroupResetter
from tests.integration._kube import throwaway_node, wait_for
from tests.integration.test_remediation_eviction import KubeletStandIn, _allow, _pdb
from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers


@pytest.fixture
def namespace(kube: KubeClient) -> Iterator[str]:
    ns = f"remctl-{uuid.uuid4().hex[:6]}"
    kube.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": ns}})
    yield ns
    kube.request("DELETE", f"/api/v1/namespaces/{ns}")


def _pod(kube: KubeClient, ns: str, name: str, node: str, *, gpu: bool = True,
         claim: str = "") -> dict[str, Any]:
    container: dict[str, Any] = {"name": "c", "image": "stand-in"}
    spec: dict[str, Any] = {"nodeName": node, "containers": [container]}
    if gpu:
        container["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    if claim:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    pod = kube.request("POST", f"/api/v1/namespaces/{ns}/pods", body={
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}}, "spec": spec})
    now = "2026-01-01T00:00:00Z"
    kube.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", content_type=MERGE_PATCH,
                 body={"status": {"phase": "Running", "conditions": [
                     {"type": "Ready", "status": "True", "lastTransitionTime": now}]}})
    return pod


def _claim(kube: KubeClient, ns: str, name: str, pool: str, pod: dict[str, Any]) -> None:
    """A claim as the scheduler leaves it: allocated a GPU of nodeagent's driver from ``pool``, reserved for
    ``pod``."""
    base = f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
    kube.request("POST", base, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nodeagent.io"}}]}}})
    kube.request("PATCH", f"{base}/{name}/status", content_type=MERGE_PATCH, body={"status": {
        "allocation": {"devices": {"results": [
            {"request": "gpu", "driver": er.DRA_DRIVER, "pool": pool, "device": "gpu-3"}]}},
        "reservedFor": [{"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}]}})


class ControllerProcess:
    """``nodeagent controller --no-computedomains --remediation`` as a process (the Deployment's command), with
    a short Lease and interval so the test is quick."""

    def __init__(self, kubeconfig: Path, namespace: str, log: Path) -> None:
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", "controller", "--no-computedomains", "--remediation",
             "--kubeconfig", str(kubeconfig), "--lease-namespace", namespace, "--lease-name", "remediation",
             "--identity", "test", "--lease-duration", "2", "--renew-deadline", "1.5", "--retry-period", "0.1",
             "--interval", "0.1"],
            stdout=subprocess.DEVNULL, stderr=self._out, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._out.close()


def _pods(kube: KubeClient, ns: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in kube.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"])


def _annotations(kube: KubeClient, node: str) -> dict[str, str]:
    return dict(er.node_annotations(kube.request("GET", f"/api/v1/nodes/{node}")))


def test_the_controller_evicts_the_requested_gpu_pod_of_the_node_within_its_budget(
        kube_apiserver: KubeApiServer, kube: KubeClient, node_name: str, namespace: str, tmp_path: Path) -> None:
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
    pods = ControllerPods(kube, node_name, timeout_s=20, gpus_of=lambda p: [uuid_of[3]], read_every_s=0.05)
    rem = Remediator(PipelineSettings(eviction_grace_s=30, eviction_timeout_s=20, step_timeout_s=10, poll_s=0.05),
                     load_catalog(), nvml, SimGroupResetter(sim), pods, KubeNodeSide(NodeClient(kube, node_name)))
    kubelet = KubeletStandIn(kube, namespace, sim.store, pids)
    controller = ControllerProcess(kube_apiserver.kubeconfig, namespace, tmp_path / "controller.log")
    try:
        inject.inject_xid(sim.store, 3, 48)

        async def scenario() -> Any:
            task = asyncio.create_task(rem.handle(Fault(uuid_of[3], 48), gpus, holders))
            # the request is on the Node; the budget refuses until the disruption controller's status allows
            await asyncio.to_thread(wait_for, lambda: controller.proc.poll() is not None or
                                    _annotations(kube, node_name).get(er.RESULTS, "").find('"blocked"') >= 0,
                                    timeout=30)
            assert controller.proc.poll() is None, controller.log.read_text()[-2000:]
            assert not task.done() and _pods(kube, namespace) == ["on-3", "on-5"]
            request = er.decode_requests(node_name, _annotations(kube, node_name)[er.REQUESTS])
            assert list(request) == [f"{namespace}/on-3"] and request[f"{namespace}/on-3"].gpus == (uuid_of[3],)
            await asyncio.to_thread(_allow, kube, namespace, "on-3", 1)
            return await task

        out = asyncio.run(scenario())
    finally:
        controller.close()
        kubelet.close()
    assert out.result == "done", out.detail
    assert _pods(kube, namespace) == ["on-5"] and nvml.process_count(uuid_of[5]) == 1
    # the request was withdrawn once the pod was gone; the controller's next pass drops its outcome
    assert er.REQUESTS not in _annotations(kube, node_name)
    EvictionBroker(kube).pass_once()
    assert er.RESULTS not in _annotations(kube, node_name)


def test_requests_for_other_nodes_pods_or_pods_without_its_gpus_are_refused_dra_pods_are_found(
        kube: KubeClient, node_name: str, namespace: str) -> None:
    with throwaway_node(kube, "remctl-other") as other:
        _pod(kube, namespace, "elsewhere", other)
        _pod(kube, namespace, "cpu-only", node_name, gpu=False)
        dra = _pod(kube, namespace, "dra", node_name, gpu=False, claim="dra-gpu")
        _claim(kube, namespace, "dra-gpu", node_name, dra)
        foreign = _pod(kube, namespace, "dra-foreign", node_name, gpu=False, claim="foreign-gpu")
        _claim(kube, namespace, "foreign-gpu", other, foreign)  # its GPU is in the other node's pool
        pods = ControllerPods(kube, node_name, timeout_s=20, read_every_s=0)
        for p in ("elsewhere", "cpu-only", "dra", "dra-foreign"):
            assert pods._evict(f"{namespace}/{p}", 0) == "blocked"  # asked; no outcome yet
        res = EvictionBroker(kube).pass_once()
        got = res.results[node_name]
        assert got == {f"{namespace}/elsewhere": "refused", f"{namespace}/cpu-only": "refused",
                       f"{namespace}/dra": "evicted", f"{namespace}/dra-foreign": "refused"}, got
        with pytest.raises(EvictionRefused, match=f"does not run on node {node_name}"):
            pods._evict(f"{namespace}/elsewhere", 0)
        with pytest.raises(EvictionRefused, match="holds no GPU"):
            pods._evict(f"{namespace}/cpu-only", 0)
        assert pods._evict(f"{namespace}/dra", 0) == "evicted"
        # only the DRA pod of this node's pool was evicted (grace 0: deleted at once)
        left = {p["metadata"]["name"]: p["metadata"].get("deletionTimestamp")
                for p in kube.request("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]}
        assert set(left) == {"elsewhere", "cpu-only", "dra-foreign"} and not any(left.values())
        EvictionBroker(kube).pass_once()
        assert pods._gone(f"{namespace}/dra") and pods.pending() == [f"{namespace}/{p}" for p in
                                                                   ("cpu-only", "dra-foreign", "elsewhere")]
        pods.withdraw_all()
        assert er.REQUESTS not in _annotations(kube, node_name)
