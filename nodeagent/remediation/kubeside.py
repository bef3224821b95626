"""The Kubernetes side of remediation: evictions through the Eviction API (policy/v1), the Node's events,
its remediation conditions and (when configured) its cordon. Plain JSON requests through ``KubeClient``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nodeagent.errors import KubeError
from nodeagent.kube.client import KubeClient
from nodeagent.kube.conditions import one_line
from nodeagent.kube.node import NodeClient
from nodeagent.remediation.pipeline import EvictResult

MERGE_PATCH = "application/merge-patch+json"


def _split(pod: str) -> tuple[str, str]:
    ns, _, name = pod.partition("/")
    if not ns or not name:
        raise ValueError(f"pod must be namespace/name, got {pod!r}")
    return ns, name


class KubePods:
    """Evicts pods and tells when they are gone."""

    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube
        self._uids: dict[str, str] = {}

    def _evict(self, pod: str, grace_s: float) -> EvictResult:
        ns, name = _split(pod)
        if pod not in self._uids:
            try:
                got = self.kube.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}", action=f"read pod {pod}",
                                        subject=pod)
            except KubeError as e:
                if e.status == 404:
                    return "gone"
                raise
            self._uids[pod] = str((got.get("metadata") or {}).get("uid", ""))
        body: dict[str, Any] = {
            "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns},
            # the UID precondition: a pod of the same name created since is never evicted by mistake
            "deleteOptions": {"gracePeriodSeconds": int(grace_s), "preconditions": {"uid": self._uids[pod]}},
        }
        try:
            self.kube.request("POST", f"/api/v1/namespaces/{ns}/pods/{name}/eviction", body=body,
                              action=f"evict pod {pod}", subject=pod)
        except KubeError as e:
            if e.status == 429:  # a PodDisruptionBudget does not allow it now
                return "blocked"
            if e.status in (404, 409):  # gone, or replaced by a new pod of the same name (UID precondition)
                return "gone"
            raise
        return "evicted"

    async def evict(self, pod: str, grace_s: float) -> EvictResult:
        return await asyncio.to_thread(self._evict, pod, grace_s)

    def _gone(self, pod: str) -> bool:
        ns, name = _split(pod)
        try:
            got = self.kube.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}", action=f"read pod {pod}",
                                    subject=pod)
        except KubeError as e:
            if e.status == 404:
                return True
            raise
        uid = str((got.get("metadata") or {}).get("uid", ""))
        return pod in self._uids and uid != self._uids[pod]

    async def gone(self, pod: str) -> bool:
        return await asyncio.to_thread(self._gone, pod)


class KubeNodeSide:
    """Events and conditions about the own Node, and its cordon."""

    def __init__(self, node: NodeClient, *, events: bool = True) -> None:
        self.node = node
        self.events = events

    async def event(self, reason: str, message: str, warning: bool = False) -> None:
        if not self.events:
            return
        try:
            await asyncio.to_thread(self.node.create_event, reason, one_line(message, 1024),
                                    "Warning" if warning else "Normal")
        except KubeError:  # an event is a report: the step it reports still counts
            return

    async def condition(self, type: str, status: bool, reason: str, message: str) -> None:
        from datetime import datetime, timezone

        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        cond = {"type": type, "status": "True" if status else "False", "reason": reason,
                "message": one_line(message), "lastTransitionTime": now, "lastHeartbeatTime": now}
        await asyncio.to_thread(self.node.patch_status_conditions, [cond])

    async def cordon(self, reason: str) -> None:
        await asyncio.to_thread(
            self.node.kube.request, "PATCH", self.node.path, body={"spec": {"unschedulable": True}},
            content_type=MERGE_PATCH, action=f"cordon node {self.node.name}", subject=self.node.name)
