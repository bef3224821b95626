"""The fleet's objects in the API server: the budget ConfigMap and the Leases the agents take and release.

All Leases live in the agent's namespace and carry ``nodeagent.io/fleet-pool`` and ``nodeagent.io/fleet-role``:

- ``nf-slot-<pool>-<i>`` (role ``slot``, i < the pool's slots): held by ``spec.holderIdentity`` (a node)
  until ``renewTime + leaseDurationSeconds``; taken by a create, or by a replace (PUT) carrying the
  resourceVersion read, so the API server lets exactly one of two racing nodes have it (409 for the other).
  Released by a replace with no holder.
- ``nf-q-<pool>-<p>-<ms>-<node>`` (role ``queue``): a node's request while it waits; its name is its place
  in line (``budget.queue_name``), so a list with ``limit=n`` returns the first n in line.
- ``nf-pool-<pool>`` (role ``pool``): the pool's size and slots as last counted, the failures of the
  rollout and the brake (annotations).

Every method is blocking (one or a few requests); ``writes`` counts the write requests sent.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from nodeagent.errors import KubeError
from nodeagent.fleet.budget import (
    CONFIGMAP,
    CONFIGMAP_KEY,
    PoolState,
    SlotView,
    pool_lease_name,
)
from nodeagent.kube.client import MERGE_PATCH, KubeClient

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
POOL_LABEL = "nodeagent.io/fleet-pool"
ROLE_LABEL = "nodeagent.io/fleet-role"
A_REASON = "nodeagent.io/fleet-reason"
A_SIZE = "nodeagent.io/fleet-size"
A_SLOTS = "nodeagent.io/fleet-slots"
A_FAILURES = "nodeagent.io/fleet-failures"
A_FAILED = "nodeagent.io/fleet-failed"
A_BRAKE = "nodeagent.io/fleet-brake"
A_BRAKE_REASON = "nodeagent.io/fleet-brake-reason"
A_ROLLOUT = "nodeagent.io/fleet-rollout"
A_GPU_PODS = "nodeagent.io/fleet-gpu-pods"
FAILED_KEPT = 20  # failed nodes named on the pool Lease (the count goes on)


def micro(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(value, fmt).replace(tzinfo=timezone.utc)
        except ValueError:
            continue
    return None


def slot_view(obj: Mapping[str, Any]) -> SlotView:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    return SlotView(
        name=str(meta.get("name", "")),
        holder=str(spec.get("holderIdentity") or ""),
        renewed=parse_time(spec.get("renewTime")),
        duration_s=int(spec.get("leaseDurationSeconds") or 0),
        resource_version=str(meta.get("resourceVersion", "")),
        transitions=int(spec.get("leaseTransitions") or 0),
        reason=str((meta.get("annotations") or {}).get(A_REASON, "")),
    )


def pool_state(obj: Mapping[str, Any]) -> PoolState:
    meta = obj.get("metadata") or {}
    ann = meta.get("annotations") or {}

    def num(key: str) -> int:
        try:
            return int(ann.get(key, "0"))
        except ValueError:
            return 0

    return PoolState(
        size=num(A_SIZE), slots=num(A_SLOTS), sized_at=parse_time((obj.get("spec") or {}).get("renewTime")),
        failures=num(A_FAILURES), failed=tuple(n for n in str(ann.get(A_FAILED, "")).split(",") if n),
        brake=ann.get(A_BRAKE) == "on", brake_reason=str(ann.get(A_BRAKE_REASON, "")),
        rollout=str(ann.get(A_ROLLOUT, "")), resource_version=str(meta.get("resourceVersion", "")), exists=True,
    )


class FleetApi:
    """The fleet's requests for one agent (or the operator's command) in namespace ``namespace``."""

    def __init__(self, kube: KubeClient, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.path = LEASES.format(ns=namespace)
        self._lock = threading.Lock()
        self.writes = 0

    def _write(self, method: str, path: str, body: Any, action: str) -> dict[str, Any]:
        with self._lock:
            self.writes += 1
        return self.kube.request(method, path, body=body, action=action, subject=path.rpartition("/")[2])

    # -- the budget ----------------------------------------------------------------------------------
    def read_budget(self) -> str | None:
        """The text of ``budget.yaml`` in the ConfigMap (None: no ConfigMap or no such key)."""
        try:
            cm = self.kube.request("GET", f"/api/v1/namespaces/{self.namespace}/configmaps/{CONFIGMAP}",
                                   action=f"read ConfigMap {self.namespace}/{CONFIGMAP}", subject=CONFIGMAP)
        except KubeError as e:
            if e.status == 404:
                return None
            raise
        value = (cm.get("data") or {}).get(CONFIGMAP_KEY)
        return value if isinstance(value, str) else None

    # -- reading a pool --------------------------------------------------------------------------------
    def pool(self, pool: str) -> tuple[PoolState, list[SlotView]]:
        """The pool Lease and the slot Leases (from the API server's cache: a take still compares the
        resourceVersion, so a stale view costs a retry, never a second holder)."""
        out = self.kube.request("GET", self.path, query={
            "labelSelector": f"{POOL_LABEL}={pool},{ROLE_LABEL} in (slot,pool)", "resourceVersion": "0"},
            action=f"list the Leases of pool {pool}")
        state = PoolState()
        slots: list[SlotView] = []
        for item in out.get("items") or []:
            role = ((item.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL)
            if role == "pool":
                state = pool_state(item)
            elif role == "slot":
                slots.append(slot_view(item))
        return state, sorted(slots, key=lambda s: s.name)

    def queue(self, pool: str, limit: int = 0) -> list[str]:
        """The names of the requests waiting in ``pool``, first in line first (``limit``: only that many)."""
        query: dict[str, str | int] = {"labelSelector": f"{POOL_LABEL}={pool},{ROLE_LABEL}=queue"}
        names: list[str] = []
        cont = ""
        while True:
            if limit:
                query["limit"] = limit - len(names)
            if cont:
                query["continue"] = cont
            out = self.kube.request("GET", self.path, query=query, action=f"list the requests of pool {pool}")
            now = datetime.now(timezone.utc)
            for item in out.get("items") or []:
                entry = slot_view(item)  # a request expires like a slot: its node stopped renewing it
                if entry.renewed is None or entry.live(now):
                    names.append(entry.name)
            cont = str((out.get("metadata") or {}).get("continue") or "")
            if not cont or (limit and len(names) >= limit):
                return sorted(names)

    # -- requests ---------------------------------------------------------------------------------------
    def request_slot(self, name: str, pool: str, node: str, reason: str, gpu_pods: int, duration_s: int,
                     now: datetime) -> None:
        """Enter the line (an existing request of this name, from before a restart, keeps its place)."""
        body = _lease(name, pool, "queue", node, {A_REASON: reason[:500], A_GPU_PODS: str(gpu_pods)})
        body["spec"].update(leaseDurationSeconds=duration_s, renewTime=micro(now))
        try:
            self._write("POST", self.path, body, f"create request {name}")
        except KubeError as e:
            if e.status != 409:
                raise

    def renew_request(self, name: str, now: datetime) -> None:
        """Keep the own request in line (one merge patch of its renewTime)."""
        with self._lock:
            self.writes += 1
        self.kube.request("PATCH", f"{self.path}/{name}", body={"spec": {"renewTime": micro(now)}},
                          content_type=MERGE_PATCH, action=f"renew request {name}", subject=name)

    def leave_queue(self, name: str) -> None:
        try:
            self._write("DELETE", f"{self.path}/{name}", None, f"delete request {name}")
        except KubeError as e:
            if e.status != 404:
                raise

    # -- slots ------------------------------------------------------------------------------------------
    def take(self, name: str, pool: str, node: str, duration_s: int, reason: str, now: datetime,
             seen: SlotView | None) -> SlotView | None:
        """Take slot ``name``: create it (``seen`` None) or replace the free/expired one seen (its
        resourceVersion). None when another node was faster (409) or the slot changed meanwhile."""
        body = _lease(name, pool, "slot", node, {A_REASON: reason[:500]})
        body["spec"].update(leaseDurationSeconds=duration_s, acquireTime=micro(now), renewTime=micro(now),
                            leaseTransitions=(seen.transitions + 1) if seen is not None else 0)
        try:
            if seen is None:
                out = self._write("POST", self.path, body, f"take slot {name}")
            else:
                body["metadata"]["resourceVersion"] = seen.resource_version
                out = self._write("PUT", f"{self.path}/{name}", body, f"take slot {name}")
        except KubeError as e:
            if e.status in (409, 404):
                return None
            raise
        return slot_view(out)

    def renew(self, slot: SlotView, pool: str, node: str, now: datetime) -> SlotView | None:
        """Extend the own slot; None when it is no longer this node's (taken over after it expired)."""
        body = self._slot_body(slot, pool, node)
        body["spec"]["renewTime"] = micro(now)
        try:
            return slot_view(self._write("PUT", f"{self.path}/{slot.name}", body, f"renew slot {slot.name}"))
        except KubeError as e:
            if e.status not in (409, 404):
                raise
        current = self.get_slot(slot.name)  # a 409 may only be a stale resourceVersion of our own
        if current is None or current.holder != node:
            return None
        return self.renew(current, pool, node, now)

    def release(self, slot: SlotView, pool: str, node: str) -> None:
        """Give the slot back (holder cleared); nothing when it is not this node's any more."""
        current: SlotView | None = slot
        for _ in range(3):
            if current is None or current.holder != node:
                return
            body = self._slot_body(current, pool, "")
            try:
                self._write("PUT", f"{self.path}/{current.name}", body, f"release slot {current.name}")
                return
            except KubeError as e:
                if e.status not in (409, 404):
                    raise
            current = self.get_slot(slot.name)

    def get_slot(self, name: str) -> SlotView | None:
        try:
            return slot_view(self.kube.request("GET", f"{self.path}/{name}", action=f"read slot {name}"))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def _slot_body(self, slot: SlotView, pool: str, holder: str) -> dict[str, Any]:
        body = _lease(slot.name, pool, "slot", holder, {A_REASON: slot.reason} if holder else {})
        body["metadata"]["resourceVersion"] = slot.resource_version
        spec = body["spec"]
        spec["leaseDurationSeconds"] = slot.duration_s
        spec["leaseTransitions"] = slot.transitions
        if slot.renewed is not None:
            spec["renewTime"] = micro(slot.renewed)
            spec["acquireTime"] = micro(slot.renewed)
        if not holder:
            spec.pop("holderIdentity", None)
        return body

    # -- the pool Lease ---------------------------------------------------------------------------------
    def get_pool(self, pool: str) -> PoolState:
        try:
            return pool_state(self.kube.request("GET", f"{self.path}/{pool_lease_name(pool)}",
                                                action=f"read pool {pool}"))
        except KubeError as e:
            if e.status == 404:
                return PoolState()
            raise

    def put_pool(self, pool: str, state: PoolState, now: datetime, *, sized: bool) -> bool:
        """Write the pool Lease (create when it does not exist; else a replace on ``state``'s
        resourceVersion). False when another writer was first (409): read again and retry."""
        name = pool_lease_name(pool)
        ann = {A_SIZE: str(state.size), A_SLOTS: str(state.slots), A_FAILURES: str(state.failures),
               A_FAILED: ",".join(state.failed[-FAILED_KEPT:]), A_BRAKE: "on" if state.brake else "off",
               A_BRAKE_REASON: state.brake_reason[:500], A_ROLLOUT: state.rollout[:200]}
        body = _lease(name, pool, "pool", "", ann)
        del body["spec"]["holderIdentity"]
        when = now if sized or state.sized_at is None else state.sized_at
        body["spec"]["renewTime"] = micro(when)
        try:
            if not state.exists:
                self._write("POST", self.path, body, f"create pool {name}")
            else:
                body["metadata"]["resourceVersion"] = state.resource_version
                self._write("PUT", f"{self.path}/{name}", body, f"update pool {name}")
        except KubeError as e:
            if e.status == 409:
                return False
            raise
        return True

    # -- nodes and pods ---------------------------------------------------------------------------------
    def nodes(self, selector: str) -> list[dict[str, Any]]:
        """The Nodes the selector picks (paged)."""
        items: list[dict[str, Any]] = []
        query: dict[str, str | int] = {"labelSelector": selector, "limit": 500}
        while True:
            out = self.kube.request("GET", "/api/v1/nodes", query=query, action="list the nodes of a pool")
            items += list(out.get("items") or [])
            cont = str((out.get("metadata") or {}).get("continue") or "")
            if not cont:
                return items
            query["continue"] = cont

    def count_nodes(self, selector: str) -> int:
        return len(self.nodes(selector))

    def blocking_pods(self, node: str, selector: str) -> list[str]:
        """``namespace/name`` of this node's running pods that the selector picks (at most 5 named)."""
        out = self.kube.request("GET", "/api/v1/pods", query={
            "labelSelector": selector, "limit": 5,
            "fieldSelector": f"spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed"},
            action=f"list the blocking pods on node {node}")
        return [f"{(i.get('metadata') or {}).get('namespace')}/{(i.get('metadata') or {}).get('name')}"
                for i in out.get("items") or []]


def _lease(name: str, pool: str, role: str, holder: str, annotations: Mapping[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "labels": {POOL_LABEL: pool, ROLE_LABEL: role},
                     "annotations": dict(annotations)},
        "spec": {"holderIdentity": holder},
    }
