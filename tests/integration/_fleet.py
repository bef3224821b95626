"""Simulated agents of a fleet for the disruption-budget tests and the bench (tests/bench/bench_fleet.py).

A simulated agent is what the daemon does for one node's label-driven MIG change, with the GPU part replaced
by a pause: ``nvidia.com/mig.config.state=pending``, wait in ``FleetGate.slot`` (the real gate, Leases,
condition and Events through ``NodeReporter``), change for ``change_s`` (or fail), then ``success``/``failed``.
Every agent has its own ``FleetApi`` and ``NodeClient`` (its writes are counted apart) over one shared
connection pool, and runs as an asyncio task; blocking calls go to a thread pool.

``LeaseWatch`` watches the pool's Leases through the API server for the whole run: the most slots held at
once, the resourceVersion of every take and of the brake turning on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nodeagent.errors import KubeError, OperationError
from nodeagent.fleet.budget import FleetBudget
from nodeagent.fleet.gate import FleetGate, GateOptions
from nodeagent.fleet.leases import A_BRAKE, POOL_LABEL, ROLE_LABEL, FleetApi
from nodeagent.fleet.report import NodeReporter
from nodeagent.kube.client import KubeClient, connect
from nodeagent.kube.node import NodeClient

STATE_LABEL = "nvidia.com/mig.config.state"


def pooled_client(kubeconfig: Any, size: int = 64) -> KubeClient:
    """One API client whose connection pool serves ``size`` threads at once."""
    api = connect(kubeconfig)
    api.configuration.connection_pool_maxsize = size
    api.rest_client.pool_manager.connection_pool_kw["maxsize"] = size
    return KubeClient(api)


def make_namespace(kube: KubeClient, ns: str) -> None:
    try:
        kube.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                         "metadata": {"name": ns}})
    except KubeError as e:
        if e.status != 409:
            raise


def make_nodes(kube: KubeClient, names: list[str], labels: Mapping[str, str]) -> None:
    def one(name: str) -> None:
        kube.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node",
                                                    "metadata": {"name": name, "labels": dict(labels)}})

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, names))


def delete_nodes(kube: KubeClient, names: list[str]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> None:
        with contextlib.suppress(KubeError):
            kube.request("DELETE", f"/api/v1/nodes/{name}")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, names))


@dataclass
class Fleet:
    """What the simulated agents of one run did (in-process truth beside the watcher's view)."""

    inside: int = 0
    most_inside: int = 0
    starts: list[tuple[float, str]] = field(default_factory=list)
    results: dict[str, str] = field(default_factory=dict)
    writes: dict[str, int] = field(default_factory=dict)
    apis: list[FleetApi] = field(default_factory=list)


async def agent(kube: KubeClient, namespace: str, node: str, labels: Mapping[str, str], fleet: Fleet, *,
                budget: FleetBudget | None = None, change_s: float = 0.2, fail: bool = False, gpu_pods: int = 0,
                poll_s: float = 0.3, api: FleetApi | None = None) -> str:
    api = api or FleetApi(kube, namespace)
    fleet.apis.append(api)
    nodec = NodeClient(kube, node)

    async def own_labels() -> Mapping[str, str]:
        return labels

    gate = FleetGate(api, node, own_labels, budget=budget, reporter=NodeReporter(nodec),
                     options=GateOptions(poll_s=poll_s))
    await asyncio.to_thread(nodec.patch_labels, {STATE_LABEL: "pending"})
    result = "done"
    try:
        async with gate.slot("MIG config all-1g.10gb", rollout="nvidia.com/mig.config=all-1g.10gb",
                             gpu_pods=gpu_pods):
            fleet.starts.append((time.monotonic(), node))
            fleet.inside += 1
            fleet.most_inside = max(fleet.most_inside, fleet.inside)
            try:
                await asyncio.sleep(change_s)
                if fail:
                    raise OperationError("MIG config all-1g.10gb: simulated failure of the config")
            finally:
                fleet.inside -= 1
    except OperationError:
        result = "failed"
    await asyncio.to_thread(nodec.patch_labels, {STATE_LABEL: "success" if result == "done" else "failed"})
    fleet.results[node] = result
    fleet.writes[node] = api.writes
    return result


class LeaseWatch:
    """A watch on the Leases of a pool for a whole run (its own API client, its own thread)."""

    def __init__(self, kubeconfig: Any, namespace: str, pool: str) -> None:
        self.kube = KubeClient(connect(kubeconfig))
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.selector = f"{POOL_LABEL}={pool}"
        self.holders: dict[str, str] = {}
        self.most = 0
        self.samples = 0
        self.takes: list[tuple[int, str]] = []  # (resourceVersion, holder) of every slot taken
        self.brake_rv: int | None = None
        self._stop = threading.Event()
        out = self.kube.request("GET", self.path, query={"labelSelector": self.selector})
        for item in out.get("items") or []:
            self._apply(item)
        self._rv = str((out.get("metadata") or {}).get("resourceVersion", ""))
        self._stream: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _apply(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        role = (meta.get("labels") or {}).get(ROLE_LABEL)
        rv = int(meta.get("resourceVersion") or 0)
        if role == "pool" and (meta.get("annotations") or {}).get(A_BRAKE) == "on" and self.brake_rv is None:
            self.brake_rv = rv
        if role != "slot":
            return
        name = str(meta.get("name"))
        holder = str((obj.get("spec") or {}).get("holderIdentity") or "")
        if holder and self.holders.get(name) != holder:
            self.takes.append((rv, holder))
        self.holders[name] = holder
        self.samples += 1
        self.most = max(self.most, sum(1 for h in self.holders.values() if h))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._stream = self.kube.stream(self.path, query={
                    "labelSelector": self.selector, "resourceVersion": self._rv, "allowWatchBookmarks": False},
                                                 timeout=(5, 300))
                for ev in self._stream:
                    obj = ev.get("object") or {}
                    self._rv = str((obj.get("metadata") or {}).get("resourceVersion", self._rv))
                    if ev.get("type") in ("ADDED", "MODIFIED"):
                        self._apply(obj)
                    elif ev.get("type") == "DELETED":
                        self.holders.pop(str((obj.get("metadata") or {}).get("name")), None)
            except KubeError:
                time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        if self._stream is not None:
            self._stream.close()
        self.thread.join(10)
        self.kube.close()


def budget_configmap(kube: KubeClient, namespace: str, text: str) -> None:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "nodeagent-fleet"},
            "data": {"budget.yaml": text}}
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    try:
        kube.request("POST", path, body=body)
    except KubeError as e:
        if e.status != 409:
            raise
        kube.request("PUT", f"{path}/nodeagent-fleet", body=body)
