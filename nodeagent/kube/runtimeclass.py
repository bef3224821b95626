"""RuntimeClass objects (node.k8s.io/v1) that point pods at the nvidia runtime handlers.

``ensure_runtime_classes`` is idempotent: an existing class with the right handler is left alone (labels
are merged in), a missing one is created. A RuntimeClass's handler cannot be changed in place, so a class
with a different handler is deleted and created again.

A whole fleet starting at once would all find the class missing and all create it (one 201, the rest
409s, each a write the apiserver handles). With ``spread`` an agent that finds it missing waits a random
moment within ``spread`` seconds and reads again before it creates: the first one to wake creates it, the
others find it made.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from typing import Any, Literal

from nodeagent.errors import KubeError
from nodeagent.kube.client import MERGE_PATCH, KubeClient

MANAGED_BY = {"app.kubernetes.io/managed-by": "nodeagent"}
Action = Literal["created", "updated", "replaced", "unchanged"]
_PATH = "/apis/node.k8s.io/v1/runtimeclasses"


def desired_classes(*, name: str = "nvidia", handler: str = "nvidia", cdi: bool = False,
                    cdi_name: str = "nvidia-cdi", cdi_handler: str = "nvidia-cdi") -> dict[str, str]:
    """RuntimeClass name -> handler for the runtimes ``runtime configure`` wires into containerd."""
    out = {name: handler}
    if cdi:
        out[cdi_name] = cdi_handler
    return out


def _body(name: str, handler: str) -> dict[str, Any]:
    return {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
            "metadata": {"name": name, "labels": dict(MANAGED_BY)}, "handler": handler}


def _read(kube: KubeClient, name: str) -> dict[str, Any] | None:
    try:
        return kube.request("GET", f"{_PATH}/{name}", action=f"read RuntimeClass {name}", subject=name)
    except KubeError as e:
        if e.status == 404:
            return None
        raise


def _create(kube: KubeClient, name: str, handler: str) -> None:
    kube.request("POST", _PATH, body=_body(name, handler), action=f"write RuntimeClass {name}", subject=name)


def ensure_runtime_class(kube: KubeClient, name: str, handler: str, *, spread: float = 0.0,
                         rng: random.Random | None = None) -> Action:
    current = _read(kube, name)
    write = f"write RuntimeClass {name}"
    if current is None and spread > 0:
        time.sleep((rng or random).uniform(0.0, spread))  # another agent of the fleet may make it meanwhile
        current = _read(kube, name)
    if current is None:
        try:
            _create(kube, name, handler)
            return "created"
        except KubeError as e:
            if e.status != 409:
                raise
            current = _read(kube, name)  # created concurrently by another node
            if current is None:
                raise
    if current.get("handler") != handler:
        kube.request("DELETE", f"{_PATH}/{name}", action=write, subject=name)
        _create(kube, name, handler)
        return "replaced"
    labels = (current.get("metadata") or {}).get("labels") or {}
    if any(labels.get(k) != v for k, v in MANAGED_BY.items()):
        kube.request("PATCH", f"{_PATH}/{name}", body={"metadata": {"labels": dict(MANAGED_BY)}},
                     content_type=MERGE_PATCH, action=write, subject=name)
        return "updated"
    return "unchanged"


def ensure_runtime_classes(kube: KubeClient, classes: Mapping[str, str], *, spread: float = 0.0,
                           rng: random.Random | None = None) -> dict[str, Action]:
    """Create or update every ``name -> handler``; returns what happened to each."""
    return {name: ensure_runtime_class(kube, name, handler, spread=spread, rng=rng)
            for name, handler in classes.items()}
