"""``nodeagent controller``'s remediation part: it executes the eviction requests node agents write on their own
Nodes (``evictreq``), after checking each against the pod itself, and writes the outcome back on the Node.

A request is executed only when the pod runs on the requesting node (``spec.nodeName``) and holds a GPU there:
a device-plugin GPU resource (``nvidia.com/*``) or a ResourceClaim reserved for it and allocated from that
node's pool of nodeagent's DRA driver. Anything else is refused, so a node's agent can disturb no pod but its
own node's GPU pods. Evictions go through the Eviction API with the pod's UID as precondition: a
PodDisruptionBudget's refusal (HTTP 429) is "blocked" and retried every pass until the request's deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nodeagent.errors import ConfigError, KubeError
from nodeagent.kube.client import MERGE_PATCH, KubeClient
from nodeagent.remediation import evictreq as er

log = logging.getLogger(__name__)


@dataclass
class BrokerPass:
    """What one pass did (for logs and tests): ``pod → result`` per node."""

    results: dict[str, dict[str, str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def outstanding(self) -> bool:
        """A request not decided for good (pending, blocked, evicted and not gone yet): the next pass is due
        after the controller's interval, whether a Node changes or not."""
        return any(r not in er.RESULTS_FINAL for pods in self.results.values() for r in pods.values())


class EvictionBroker:
    def __init__(self, kube: KubeClient, *, clock: Callable[[], float] = time.time) -> None:
        self.kube = kube
        self.clock = clock
        self._complaints: set[str] = set()

    def _complain(self, text: str, out: BrokerPass) -> None:
        out.problems.append(text)
        if text not in self._complaints:
            self._complaints.add(text)
            log.warning("%s", text)

    def pass_once(self, nodes: list[Mapping[str, Any]] | None = None) -> BrokerPass:
        out = BrokerPass()
        if nodes is None:
            nodes = self.kube.request("GET", "/api/v1/nodes", action="list Nodes").get("items") or []
        for node in nodes:
            ann = er.node_annotations(node)
            if er.REQUESTS not in ann and er.RESULTS not in ann:
                continue
            name = str(node["metadata"]["name"])
            try:
                self._node(name, ann, out)
            except KubeError as e:
                self._complain(f"evictions for Node {name}: {e}", out)
        return out

    def _node(self, node: str, ann: Mapping[str, str], out: BrokerPass) -> None:
        try:
            reqs = er.decode_requests(node, ann.get(er.REQUESTS, "{}") or "{}")
        except ConfigError as e:
            self._complain(str(e), out)
            return
        before = er.decode_results(ann.get(er.RESULTS, "{}") or "{}")
        results: dict[str, er.Outcome] = {}
        for pod, req in reqs.items():
            results[pod] = self._one(node, req, before.get(pod))
        if results:
            out.results[node] = {p: o.result for p, o in results.items()}
        value = er.encode_results(results) if results else None
        if value != ann.get(er.RESULTS):
            self.kube.request("PATCH", f"/api/v1/nodes/{node}", content_type=MERGE_PATCH,
                              body={"metadata": {"annotations": {er.RESULTS: value}}},
                              action=f"report evictions on Node {node}", subject=node)

    def _one(self, node: str, req: er.Request, last: er.Outcome | None) -> er.Outcome:
        out = self._decide(node, req, last if last is not None and last.deadline == round(req.deadline) else None)
        return dataclasses.replace(out, deadline=round(req.deadline))

    def _decide(self, node: str, req: er.Request, last: er.Outcome | None) -> er.Outcome:
        if last is not None and last.result in er.RESULTS_FINAL:
            return last  # decided: kept until the agent withdraws or renews its request
        ns, name = er.split_pod(req.pod)
        try:
            pod = self.kube.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}", action=f"read pod {req.pod}",
                                    subject=req.pod)
        except KubeError as e:
            if e.status == 404:
                return er.Outcome("gone", last.uid if last else req.uid, "the pod no longer exists")
            raise
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        wanted = (last.uid if last is not None and last.uid else "") or req.uid
        if wanted and uid != wanted:
            return er.Outcome("gone", wanted, "the requested pod no longer exists (a new one has its name)")
        if last is not None and last.result == "evicted":
            return last  # deleted with a grace period: waiting for it to go
        why = er.check_pod(pod, node, req) or self._gpu_refusal(pod, node, req, uid)
        if why:
            log.warning("eviction request of Node %s refused: %s", node, why)
            return er.Outcome("refused", uid, why)
        if self.clock() > req.deadline:
            return er.Outcome("expired", uid, "the request's deadline passed before the pod could be evicted")
        body: dict[str, Any] = {
            "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns},
            "deleteOptions": {"gracePeriodSeconds": req.grace_s, "preconditions": {"uid": uid}},
        }
        try:
            self.kube.request("POST", f"/api/v1/namespaces/{ns}/pods/{name}/eviction", body=body,
                              action=f"evict pod {req.pod}", subject=req.pod)
        except KubeError as e:
            if e.status == 429:
                return er.Outcome("blocked", uid, "a PodDisruptionBudget does not allow it now")
            if e.status in (404, 409):
                return er.Outcome("gone", uid, "the pod no longer exists")
            raise
        log.info("evicted pod %s (UID %s) for GPU %s of Node %s", req.pod, uid, ",".join(req.gpus), node)
        return er.Outcome("evicted", uid, "")

    def _gpu_refusal(self, pod: Mapping[str, Any], node: str, req: er.Request, uid: str) -> str:
        if er.holds_device_plugin_gpu(pod):
            return ""
        ns = req.pod.split("/", 1)[0]
        for claim in er.claim_names(pod):
            try:
                obj = self.kube.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{claim}",
                                        action=f"read ResourceClaim {ns}/{claim}", subject=req.pod)
            except KubeError as e:
                if e.status == 404:
                    continue
                raise
            if er.claim_holds_gpu_on(obj, node, uid):
                return ""
        return f"pod {req.pod} holds no GPU of node {node}"
