"""Extended resources that no device plugin serves, published by JSON-patching the Node status (pure).

The kubelet owns every name a device plugin serves (it overwrites them), so those are never written
here. Names nodeagent wrote are remembered in the annotation ``nodeagent.io/managed-resources``; a name
listed there that is no longer configured is removed, and a value the kubelet (or anybody) reset is
written again on the next pass. Capacity and allocatable are written together.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nodeagent.gpu.inventory import Inventory
from nodeagent.kube.labels import DOMAIN, format_managed, parse_managed

MANAGED_RESOURCES_ANNOTATION = DOMAIN + "managed-resources"
GPU_MEMORY = "nvidia.com/gpu-memory"  # MiB over all GPUs
GPUSHARE_MEMORY = "aliyun.com/gpu-mem"  # GiB over all GPUs (gpushare scheduler extender)
MIB_PER_GIB = 1024


@dataclass(frozen=True)
class ResourceSettings:
    """Which unserved extended resources to publish."""

    gpu_memory: str | None = GPU_MEMORY  # None = do not publish
    gpushare_memory: str | None = None  # e.g. "aliyun.com/gpu-mem"
    extra: Mapping[str, str] = field(default_factory=dict)  # fixed name → quantity


@dataclass(frozen=True)
class StatusPlan:
    """JSON-patch ops for ``/status`` plus the ownership annotation before and after them."""

    ops: list[dict[str, Any]] = field(default_factory=list)
    annotation_before: str | None = None  # value to write before the status patch (None = keep)
    annotation_after: str | None = None  # value to write after it (None = keep; "" = remove)
    refused: tuple[str, ...] = ()  # configured names a device plugin serves (never written)


def json_pointer_escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def desired_resources(inv: Inventory, settings: ResourceSettings) -> dict[str, str]:
    """Name → quantity for the unserved resources this inventory offers (pure)."""
    total_mib = sum(g.memory_mib for g in inv.gpus)
    out: dict[str, str] = {}
    if not inv.gpus:
        return dict(settings.extra)
    if settings.gpu_memory:
        out[settings.gpu_memory] = str(total_mib)
    if settings.gpushare_memory:
        # per-GPU whole GiB, summed: what gpushare's extender expects for splitting per card
        out[settings.gpushare_memory] = str(sum(g.memory_mib // MIB_PER_GIB for g in inv.gpus))
    out.update(settings.extra)
    return out


def plan_status(
    capacity: Mapping[str, str],
    allocatable: Mapping[str, str],
    annotations: Mapping[str, str],
    desired: Mapping[str, str],
    served: Iterable[str],
    *,
    has_capacity: bool = True,
    has_allocatable: bool = True,
) -> StatusPlan:
    """What to write so the Node's unserved extended resources equal ``desired`` (pure)."""
    served_set = set(served)
    refused = tuple(sorted(n for n in desired if n in served_set))
    want = {n: q for n, q in desired.items() if n not in served_set}
    owned = parse_managed(annotations.get(MANAGED_RESOURCES_ANNOTATION))
    # a name the device plugin now serves belongs to the kubelet: forget it, never remove it
    stale = {n for n in owned - set(want) if n not in served_set and (n in capacity or n in allocatable)}
    ops: list[dict[str, Any]] = []
    if want and not has_capacity:
        ops.append({"op": "add", "path": "/status/capacity", "value": {}})
    if want and not has_allocatable:
        ops.append({"op": "add", "path": "/status/allocatable", "value": {}})
    for name, qty in sorted(want.items()):
        ptr = json_pointer_escape(name)
        if capacity.get(name) != qty:
            ops.append({"op": "add", "path": f"/status/capacity/{ptr}", "value": qty})
        if allocatable.get(name) != qty:
            ops.append({"op": "add", "path": f"/status/allocatable/{ptr}", "value": qty})
    for name in sorted(stale):
        ptr = json_pointer_escape(name)
        if name in capacity:
            ops.append({"op": "remove", "path": f"/status/capacity/{ptr}"})
        if name in allocatable:
            ops.append({"op": "remove", "path": f"/status/allocatable/{ptr}"})
    current = annotations.get(MANAGED_RESOURCES_ANNOTATION)
    before_keys = format_managed(set(want) | stale)
    after_keys = format_managed(want)
    before: str | None = None
    after: str | None = None
    if ops and before_keys != (current or ""):
        before = before_keys
    # after the patch the annotation must list exactly what we keep
    expected_now = before if before is not None else (current or "")
    if after_keys != expected_now:
        after = after_keys
    return StatusPlan(ops=ops, annotation_before=before, annotation_after=after, refused=refused)


def merge_fields(ops: list[dict[str, Any]]) -> dict[str, dict[str, str | None]]:
    """The same change as ``plan_status``'s JSON-patch ops, as ``status`` fields of a merge patch: field
    (``capacity``/``allocatable``) -> name -> quantity, or None to remove the name. Lets the resource
    values travel in one status patch together with other status fields (the Node conditions)."""
    out: dict[str, dict[str, str | None]] = {}
    for op in ops:
        parts = str(op["path"]).split("/")  # "", "status", field[, escaped name]
        if len(parts) < 3 or parts[1] != "status":
            raise ValueError(f"not a status op: {op!r}")
        fields = out.setdefault(parts[2], {})
        if len(parts) == 3:
            continue  # the map itself, created empty: a merge patch creates it with its first key
        name = "/".join(parts[3:]).replace("~1", "/").replace("~0", "~")
        fields[name] = None if op["op"] == "remove" else str(op["value"])
    return out
