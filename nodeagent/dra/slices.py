"""ResourceSlice bodies (``resource.k8s.io/v1``) for the node's pool (pure).

One pool per node, named after the node. Devices are split into slices of at most ``MAX_DEVICES``
(the API limit is 128); the slices are named ``<node>-gpu.nodeagent.io-<i>`` so every rewrite replaces
the same objects. Every slice carries a hash of the whole pool's content (without the generation) in an
annotation: a restarted agent that finds the same hash on all slices writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.devices import DraDevice

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES = 128
MAX_TAINT_VALUE = 63
CONTENT_ANNOTATION = f"{DRIVER_NAME}/content-hash"
UNHEALTHY_TAINT_KEY = f"{DRIVER_NAME}/unhealthy"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"

_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9._-]")


def taint_value(reason: str) -> str:
    """A health reason as a label value (the taint value's syntax): ``XID 79`` → ``XID-79``."""
    v = _LABEL_VALUE_BAD.sub("-", reason)[:MAX_TAINT_VALUE].strip("-._")
    return v


def device_body(dev: DraDevice, unhealthy_reason: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": dev.name,
        "attributes": dict(dev.attributes),
        "capacity": dict(dev.capacity),
    }
    if unhealthy_reason is not None:
        body["taints"] = [{"key": UNHEALTHY_TAINT_KEY, "value": taint_value(unhealthy_reason),
                           "effect": "NoSchedule"}]
    return body


@dataclass(frozen=True)
class PoolContent:
    """What the pool publishes, independent of its generation."""

    devices: tuple[dict[str, Any], ...]

    @property
    def digest(self) -> str:
        raw = json.dumps(self.devices, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()[:32]


def pool_content(devices: Sequence[DraDevice], unhealthy: Mapping[str, str] | None = None) -> PoolContent:
    """``unhealthy``: device name → reason; those devices carry the unhealthy taint."""
    bad = unhealthy or {}
    return PoolContent(tuple(device_body(d, bad.get(d.name)) for d in devices))


def slice_name(node_name: str, i: int, driver: str = DRIVER_NAME) -> str:
    return f"{node_name}-{driver}-{i}"


def build_slices(
    node_name: str,
    content: PoolContent,
    generation: int,
    *,
    driver: str = DRIVER_NAME,
    max_devices: int = MAX_DEVICES,
) -> list[dict[str, Any]]:
    """The ResourceSlice objects for one pool generation (at least one slice, maybe without devices)."""
    if not 1 <= max_devices <= MAX_DEVICES:
        raise ValueError(f"max_devices must be within 1..{MAX_DEVICES}: {max_devices}")
    devs = list(content.devices)
    chunks = [devs[i:i + max_devices] for i in range(0, len(devs), max_devices)] or [[]]
    out: list[dict[str, Any]] = []
    for i, chunk in enumerate(chunks):
        out.append({
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {
                "name": slice_name(node_name, i, driver),
                "labels": {MANAGED_BY_LABEL: "nodeagent"},
                "annotations": {CONTENT_ANNOTATION: content.digest},
            },
            "spec": {
                "driver": driver,
                "nodeName": node_name,
                "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(chunks)},
                "devices": chunk,
            },
        })
    return out
