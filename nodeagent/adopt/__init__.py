"""Hand a node over from NVIDIA's GPU Operator to nodeagent, and back, through the operator's own switches.

The GPU Operator deploys each operand on a node whose ``nvidia.com/gpu.deploy.<operand>`` label is
``true``; ``false`` takes that operand off the node (its DaemonSet's node selector no longer matches). The
operands nodeagent replaces are switched off, one Node patch for all of them; then nodeagent waits until
their pods have left the node. The driver (and, unless asked, dcgm-exporter) stays NVIDIA's. ``release``
puts ``true`` back on exactly the labels a hand-over set (recorded in an annotation on the Node), so the
operator redeploys its operands.

The daemon does the same with ``[adopt] gpu_operator = true`` (``switch_off``, then ``operand_pods`` until
none is left) before it serves the resources; ``nodeagent adopt`` is the same from an admin's shell.

Running GPU pods are not touched: they keep the devices they were given (same UUIDs, resource names and CDI
names under nodeagent).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from nodeagent.adopt.detect import Requests
from nodeagent.boundedyaml import shown
from nodeagent.errors import KubeError, LabelValueError, OperationError

DEPLOY_PREFIX = "nvidia.com/gpu.deploy."
# operand -> the pods it runs (their app label in the operator's DaemonSets)
REPLACED: Mapping[str, str] = {
    "device-plugin": "nvidia-device-plugin-daemonset",
    "gpu-feature-discovery": "gpu-feature-discovery",
    "mig-manager": "nvidia-mig-manager",
    "container-toolkit": "nvidia-container-toolkit-daemonset",
}
OPTIONAL: Mapping[str, str] = {"dcgm-exporter": "nvidia-dcgm-exporter"}
# The operator's DRA stack (GPU Operator 26.x, a node in allocation mode "dra"): switched off only where the node
# has them on (``true``), so ``release`` never deploys a stack the node did not run. NVIDIA's DRA driver
# (``gpu.nvidia.com``) is what nodeagent's DRA driver replaces; its validator proves that driver through an
# admin-access claim of it; dcgm-exporter's DRA variant goes with ``dcgm-exporter``. The app label of the DRA
# driver's kubelet plugin pods is the chart's (``nvidia-dra-driver-gpu``), the validator's the operator's.
DRA_REPLACED: Mapping[str, str] = {
    "dra-driver": "nvidia-dra-driver-gpu",
    "dra-validator": "nvidia-operator-validator",
}
DRA_OPTIONAL: Mapping[str, str] = {"dcgm-exporter-dra": "nvidia-dcgm-exporter"}
# Switches of the operator that adopt knows and leaves alone: nodeagent does not replace DCGM itself (nor its DRA
# variant), the sandbox (VM passthrough) device plugins of KubeVirt and Kata, nor the client operand.
LEFT_ALONE: tuple[str, ...] = ("dcgm", "dcgm-dra", "sandbox-device-plugin", "kata-sandbox-device-plugin", "client")
HANDED_OVER = "nodeagent.io/handed-over"  # annotation: the operand labels the hand-over switched off
MAX_RECORD_CHARS = 1024  # of that annotation: a JSON list of at most five operand names is ~100
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class Result:
    node: str
    labels: dict[str, str | None]  # what was written (None: removed)
    waited_s: float
    pods_left: tuple[str, ...]  # operand pods still on the node when the wait ended

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "labels": self.labels, "waited_seconds": round(self.waited_s, 1),
                "pods_left": list(self.pods_left)}


def operands(with_dcgm_exporter: bool) -> dict[str, str]:
    return {**REPLACED, **(OPTIONAL if with_dcgm_exporter else {})}


def dra_operands(with_dcgm_exporter: bool) -> dict[str, str]:
    return {**DRA_REPLACED, **(DRA_OPTIONAL if with_dcgm_exporter else {})}


def to_switch(labels: Mapping[str, str], with_dcgm_exporter: bool) -> list[str]:
    """The operands a hand-over switches off on a Node with ``labels``: the replaced ones not off yet, and those
    of the DRA stack that are on."""
    out = [op for op in operands(with_dcgm_exporter) if labels.get(DEPLOY_PREFIX + op) != "false"]
    out += [op for op in dra_operands(with_dcgm_exporter) if labels.get(DEPLOY_PREFIX + op) == "true"]
    return sorted(out)


def switch_off(kube: Requests, node: str, *, with_dcgm_exporter: bool = False) -> list[str]:
    """One Node patch: ``nvidia.com/gpu.deploy.<operand>=false`` for the replaced operands not yet off, and
    the annotation recording them (for ``release``). The operands switched now."""
    current = _node(kube, node)
    labels = (current.get("metadata") or {}).get("labels") or {}
    switched = to_switch(labels, with_dcgm_exporter)
    earlier = recorded(current, node)
    patch: dict[str, Any] = {"labels": {DEPLOY_PREFIX + op: "false" for op in switched}}
    if switched:
        patch["annotations"] = {HANDED_OVER: json.dumps(sorted(set(earlier) | set(switched)))}
        kube.request("PATCH", f"/api/v1/nodes/{quote(node)}", body={"metadata": patch},
                     content_type=MERGE_PATCH, action=f"hand over node {node}", subject=node)
    return switched


def operand_pods(kube: Requests, node: str, *, with_dcgm_exporter: bool = False) -> list[str]:
    """The replaced operands' pods still on ``node`` (namespace/name)."""
    return _operand_pods(kube, node, _apps(kube, node, with_dcgm_exporter))


def _apps(kube: Requests, node: str, with_dcgm_exporter: bool) -> set[str]:
    """The app labels of the operands a hand-over waits for: the replaced ones, and those of the DRA stack it
    switched off on ``node`` (its record)."""
    apps = set(operands(with_dcgm_exporter).values())
    dra = dra_operands(with_dcgm_exporter)
    switched = [op for op in handed_over(_node(kube, node)) if op in dra]
    return apps | {dra[op] for op in switched}


def operand_pods_by_name(pods: Iterable[tuple[str, str]], *, with_dcgm_exporter: bool = False) -> list[str]:
    """The replaced operands' pods among ``pods`` ((namespace, name) as the kubelet's PodResources API lists
    the pods of this node), by name: a DaemonSet's pod is ``<daemonset>-<5 characters>``, and the operator
    names each DaemonSet like its pods' app label. For a node agent whose credentials may not list pods."""
    apps = set(operands(with_dcgm_exporter).values()) | set(dra_operands(with_dcgm_exporter).values())
    out = []
    for namespace, name in pods:
        base, _, suffix = name.rpartition("-")
        if base in apps and len(suffix) == 5 and suffix.isalnum():
            out.append(f"{namespace}/{name}")
    return sorted(out)


def hand_over(kube: Requests, node: str, *, with_dcgm_exporter: bool = False, timeout_s: float = 300.0,
              poll_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> Result:
    """Switch the replaced operands off on ``node`` and wait until their pods are gone."""
    switched = switch_off(kube, node, with_dcgm_exporter=with_dcgm_exporter)
    start = clock()
    apps = _apps(kube, node, with_dcgm_exporter)
    left = _operand_pods(kube, node, apps)
    while left and clock() - start < timeout_s:
        sleep(poll_s)
        left = _operand_pods(kube, node, apps)
    waited = clock() - start
    if left:
        raise OperationError(
            f"node {node}: the GPU Operator's pods {', '.join(left)} are still on the node after "
            f"{timeout_s:g}s (labels set: {', '.join(DEPLOY_PREFIX + op for op in switched) or 'none'}); "
            "check the operator, then run the command again", subject=node)
    return Result(node, {DEPLOY_PREFIX + op: "false" for op in switched}, waited, ())


def release(kube: Requests, node: str) -> Result:
    """Give the operands a hand-over switched off back to the GPU Operator (labels ``true`` again)."""
    current = _node(kube, node)
    earlier = recorded(current, node)
    if not earlier:
        return Result(node, {}, 0.0, ())
    labels: dict[str, str | None] = {DEPLOY_PREFIX + op: "true" for op in earlier}
    kube.request("PATCH", f"/api/v1/nodes/{quote(node)}",
                 body={"metadata": {"labels": labels, "annotations": {HANDED_OVER: None}}},
                 content_type=MERGE_PATCH, action=f"release node {node}", subject=node)
    return Result(node, labels, 0.0, ())


def _node(kube: Requests, node: str) -> dict[str, Any]:
    try:
        found: dict[str, Any] = kube.request("GET", f"/api/v1/nodes/{quote(node)}", subject=node)
    except KubeError as e:
        raise OperationError(f"node {node} cannot be read: {e}", subject=node) from e
    return found


def handed_over(node: Mapping[str, Any]) -> list[str]:
    """The operands a hand-over switched off on ``node`` (its annotation); none when the annotation is not such a
    record (``recorded`` says why)."""
    return _record(node)[0]


def recorded(node: Mapping[str, Any], name: str) -> list[str]:
    """``handed_over``, for a command about to act on the record: an annotation that is not one is
    ``LabelValueError``, one line naming it and saying how to clear it, and nothing is changed."""
    operands, why = _record(node)
    if why:
        raw = ((node.get("metadata") or {}).get("annotations") or {}).get(HANDED_OVER)
        raise LabelValueError(
            f"node {name}: annotation {HANDED_OVER} {why} ({shown(raw)}); it records the GPU Operator operands a "
            f"hand-over switched off: correct it (e.g. '[\"device-plugin\"]') or remove it "
            f"(kubectl annotate node {name} {HANDED_OVER}-) and run again", subject=HANDED_OVER)
    return operands


def _record(node: Mapping[str, Any]) -> tuple[list[str], str]:
    """(the operands the annotation names, ""), or ([], why it is not a record of them)."""
    raw = ((node.get("metadata") or {}).get("annotations") or {}).get(HANDED_OVER)
    if raw is None:
        return [], ""
    if not isinstance(raw, str):
        return [], "is not a string"
    if len(raw) > MAX_RECORD_CHARS:  # parsed only when it is a record's size: never deep enough to recurse far
        return [], f"is {len(raw)} characters long, more than the {MAX_RECORD_CHARS} a record takes"
    try:
        names = json.loads(raw)
    except (ValueError, RecursionError):
        return [], "is not JSON"
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return [], "is not a JSON list of operand names"
    known = {**REPLACED, **OPTIONAL, **DRA_REPLACED, **DRA_OPTIONAL}
    return [n for n in names if n in known], ""


def _operand_pods(kube: Requests, node: str, apps: Iterable[str]) -> list[str]:
    """Names of the operator's operand pods still scheduled on ``node``."""
    selector = "app in (" + ",".join(sorted(apps)) + ")"
    found = kube.request("GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={node}",
                                                       "labelSelector": selector}, subject=node)
    return sorted(f"{(p.get('metadata') or {}).get('namespace', '')}/{(p.get('metadata') or {}).get('name', '')}"
                  for p in found.get("items") or [])
