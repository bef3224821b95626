"""The eviction hand-off between a node's agent and ``nodeagent controller`` (pure: encode, decode, decide).

The agent's token cannot evict pods, and no RBAC rule or admission policy can confine ``pods/eviction`` to one
node's pods (an Eviction names a pod, never a node). So the agent asks and the controller evicts:

- the agent writes its requests on its OWN Node, annotation ``REQUESTS`` (the agents' admission policy lets it
  change no other Node): per pod ``namespace/name`` the pod's UID when known, the GPUs it holds there, the
  grace period and a deadline;
- the controller checks each request against the pod itself (on this very node, ``spec.nodeName``, and holding
  a GPU there), calls the Eviction API, and writes the outcome on the same Node, annotation ``RESULTS`` (the
  controller's admission policy lets it change nothing else of a Node).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from nodeagent.errors import ConfigError

REQUESTS = "nodeagent.io/eviction-requests"
RESULTS = "nodeagent.io/eviction-results"
MAX_REQUESTS = 64  # one node's pods holding its GPUs; more is a malformed request

Result = Literal["pending", "evicted", "blocked", "gone", "refused", "expired"]
RESULTS_FINAL: frozenset[str] = frozenset({"gone", "refused", "expired"})
RESULT_VALUES: frozenset[str] = frozenset({"pending", "evicted", "blocked", "gone", "refused", "expired"})


@dataclass(frozen=True)
class Request:
    pod: str  # namespace/name
    uid: str  # "" when the agent does not know it (PodResources names pods without UIDs)
    gpus: tuple[str, ...]
    grace_s: int
    deadline: float  # Unix seconds: the controller gives up (result "expired") after it


@dataclass(frozen=True)
class Outcome:
    result: Result
    uid: str = ""  # the UID of the pod the controller evicted
    message: str = ""
    deadline: float = 0.0  # the deadline of the request it answers (a renewed request is decided anew)


def split_pod(pod: str) -> tuple[str, str]:
    ns, _, name = pod.partition("/")
    if not ns or not name or "/" in name:
        raise ConfigError(f"eviction request: pod must be namespace/name, got {pod!r}")
    return ns, name


def encode_requests(reqs: Mapping[str, Request]) -> str:
    return json.dumps({p: {"uid": r.uid, "gpus": list(r.gpus), "grace": r.grace_s, "deadline": round(r.deadline)}
                       for p, r in sorted(reqs.items())}, separators=(",", ":"), sort_keys=True)


def decode_requests(node: str, value: str) -> dict[str, Request]:
    """The requests of ``node``'s annotation; ``ConfigError`` naming the node and the fault when malformed."""
    where = f"Node {node} annotation {REQUESTS}"
    try:
        raw = json.loads(value)
    except ValueError as e:
        raise ConfigError(f"{where}: not JSON: {e}") from None
    if not isinstance(raw, dict) or len(raw) > MAX_REQUESTS:
        raise ConfigError(f"{where}: must be an object of at most {MAX_REQUESTS} pods")
    out: dict[str, Request] = {}
    for pod, r in raw.items():
        try:
            split_pod(pod)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        if not isinstance(r, dict):
            raise ConfigError(f"{where}: pod {pod}: must be an object")
        uid, gpus, grace, deadline = r.get("uid", ""), r.get("gpus", []), r.get("grace", 30), r.get("deadline")
        if not isinstance(uid, str) or not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus) \
                or isinstance(grace, bool) or not isinstance(grace, int) or grace < 0 \
                or isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
            raise ConfigError(f"{where}: pod {pod}: wants uid (string), gpus (strings), grace (seconds >= 0) "
                              "and deadline (Unix seconds)")
        out[pod] = Request(pod, uid, tuple(gpus), grace, float(deadline))
    return out


def encode_results(results: Mapping[str, Outcome]) -> str:
    return json.dumps({p: {"result": o.result, "uid": o.uid, "message": o.message, "deadline": round(o.deadline)}
                       for p, o in sorted(results.items())}, separators=(",", ":"), sort_keys=True)


def decode_results(value: str) -> dict[str, Outcome]:
    """The controller's outcomes; entries the agent cannot read are left out (it then keeps waiting)."""
    try:
        raw = json.loads(value)
    except ValueError:
        return {}
    out: dict[str, Outcome] = {}
    if not isinstance(raw, dict):
        return out
    for pod, o in raw.items():
        if isinstance(o, dict) and o.get("result") in RESULT_VALUES:
            deadline = o.get("deadline", 0)
            out[pod] = Outcome(o["result"], str(o.get("uid", "")), str(o.get("message", "")),
                               float(deadline) if isinstance(deadline, (int, float)) else 0.0)
    return out


def node_annotations(node: Mapping[str, Any]) -> Mapping[str, str]:
    return (node.get("metadata") or {}).get("annotations") or {}


def node_relevance(node: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """What the controller reads of a Node for evictions (a change there is acted on at once)."""
    ann = node_annotations(node)
    return ann.get(REQUESTS), ann.get(RESULTS)


# -- what the controller checks of a pod ------------------------------------------------------------------

GPU_RESOURCE_PREFIXES = ("nvidia.com/",)  # the device plugin's resources: nvidia.com/gpu, nvidia.com/mig-*
DRA_DRIVER = "gpu.nodeagent.io"


def holds_device_plugin_gpu(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    for c in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
        res = c.get("resources") or {}
        for kind in ("limits", "requests"):
            if any(str(k).startswith(GPU_RESOURCE_PREFIXES) for k in (res.get(kind) or {})):
                return True
    return False


def claim_names(pod: Mapping[str, Any]) -> list[str]:
    """The ResourceClaims the pod uses (its own, and those generated from templates)."""
    names = [str(s["resourceClaimName"]) for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
             if s.get("resourceClaimName")]
    names += [str(c["resourceClaimName"]) for c in (pod.get("spec") or {}).get("resourceClaims") or []
              if c.get("resourceClaimName")]
    return sorted(set(names))


def claim_holds_gpu_on(claim: Mapping[str, Any], node: str, pod_uid: str) -> bool:
    """The claim is reserved for the pod and allocated a device of nodeagent's driver from ``node``'s pool."""
    status = claim.get("status") or {}
    reserved = any(r.get("resource") == "pods" and r.get("uid") == pod_uid for r in status.get("reservedFor") or [])
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
    return reserved and any(r.get("driver") == DRA_DRIVER and r.get("pool") == node for r in results)


def check_pod(pod: Mapping[str, Any], node: str, req: Request) -> str:
    """Why the controller refuses to evict ``pod`` for ``node``'s request ("" when it may; whether it holds a
    GPU is checked by the caller, which reads its claims)."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName") != node:
        return f"pod {req.pod} does not run on node {node} (it is on {spec.get('nodeName') or 'no node'})"
    return ""
