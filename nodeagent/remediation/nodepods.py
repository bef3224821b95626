"""The agent's side of controller-executed evictions (``evictreq``): the pipeline's ``Pods`` port, asking on the
own Node and reading the controller's outcome from it. The agent's token needs nothing beyond its own Node.

``evict`` writes (or keeps) the request and answers from the controller's latest outcome: "blocked" while
none is there yet or a PodDisruptionBudget refuses (the pipeline asks again until its eviction deadline);
a refusal or an expired request raises. ``gone`` is the controller's "gone", after which the request is
withdrawn. ``withdraw_all`` clears what a run leaves (the pipeline's end, a new agent's start).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence

from nodeagent.errors import OperationError
from nodeagent.kube.client import MERGE_PATCH, KubeClient
from nodeagent.remediation import evictreq as er
from nodeagent.remediation.pipeline import EvictResult


class EvictionRefused(OperationError):
    """The controller refused (or gave up on) an eviction request; the message says why."""


class ControllerPods:
    def __init__(self, kube: KubeClient, node_name: str, *, timeout_s: float = 300.0,
                 gpus_of: Callable[[str], Sequence[str]] = lambda pod: (),
                 uid_of: Callable[[str], str] = lambda pod: "",
                 clock: Callable[[], float] = time.time, read_every_s: float = 0.5) -> None:
        self.kube = kube
        self.node = node_name
        self.timeout_s = timeout_s
        self.gpus_of = gpus_of
        self.uid_of = uid_of
        self.clock = clock
        self.read_every_s = read_every_s
        self._lock = threading.Lock()
        self._requests: dict[str, er.Request] = {}
        self._results: dict[str, er.Outcome] = {}
        self._read_at = -1e9

    @property
    def _path(self) -> str:
        return f"/api/v1/nodes/{self.node}"

    def _write(self) -> None:
        value = er.encode_requests(self._requests) if self._requests else None
        self.kube.request("PATCH", self._path, content_type=MERGE_PATCH,
                          body={"metadata": {"annotations": {er.REQUESTS: value}}},
                          action=f"request evictions on Node {self.node}", subject=self.node)

    def _read(self, force: bool = False) -> dict[str, er.Outcome]:
        now = time.monotonic()
        if force or now - self._read_at >= self.read_every_s:
            node = self.kube.request("GET", self._path, action=f"read node {self.node}", subject=self.node)
            self._results = er.decode_results(er.node_annotations(node).get(er.RESULTS, "{}") or "{}")
            self._read_at = now
        return self._results

    def _evict(self, pod: str, grace_s: float) -> EvictResult:
        er.split_pod(pod)
        with self._lock:
            req = self._requests.get(pod)
            if req is None or self.clock() > req.deadline:  # new, or left by an earlier run that gave up
                req = self._requests[pod] = er.Request(pod, self.uid_of(pod), tuple(self.gpus_of(pod)),
                                                       int(grace_s), float(round(self.clock() + self.timeout_s)))
                self._write()
            got = self._current(pod, req)
        if got is None or got.result in ("pending", "blocked"):
            return "blocked"
        if got.result == "evicted":
            return "evicted"
        if got.result == "gone":
            return "gone"
        raise EvictionRefused(f"eviction of pod {pod}: {got.result} by nodeagent controller: {got.message}",
                              subject=pod)

    async def evict(self, pod: str, grace_s: float) -> EvictResult:
        return await asyncio.to_thread(self._evict, pod, grace_s)

    def _current(self, pod: str, req: er.Request | None) -> er.Outcome | None:
        """The controller's outcome for this very request (one for an earlier request of the pod is none)."""
        got = self._read().get(pod)
        if got is None or req is None or got.deadline != round(req.deadline):
            return None
        return got

    def _gone(self, pod: str) -> bool:
        with self._lock:
            got = self._current(pod, self._requests.get(pod))
            if got is None or got.result != "gone":
                if got is not None and got.result in er.RESULTS_FINAL:
                    raise EvictionRefused(f"eviction of pod {pod}: {got.result}: {got.message}", subject=pod)
                return False
            if self._requests.pop(pod, None) is not None:
                self._write()
            return True

    async def gone(self, pod: str) -> bool:
        return await asyncio.to_thread(self._gone, pod)

    def withdraw_all(self) -> None:
        """Remove every request of this node (blocking). ``KubeError`` when the Node cannot be written."""
        with self._lock:
            self._requests.clear()
            self._write()

    def pending(self) -> list[str]:
        with self._lock:
            return sorted(self._requests)

