"""RuntimeClass objects (node.k8s.io/v1) that point pods at the nvidia runtime handlers.

``ensure_runtime_classes`` is idempotent: an existing class with the right handler is left alone (labels
are merged in), a missing one is created. A RuntimeClass's handler cannot be changed in place, so a class
with a different handler is deleted and created again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from nodeagent.kube.client import KubeClient, kube_error

MANAGED_BY = {"app.kubernetes.io/managed-by": "nodeagent"}
Action = Literal["created", "updated", "replaced", "unchanged"]


def desired_classes(*, name: str = "nvidia", handler: str = "nvidia", cdi: bool = False,
                    cdi_name: str = "nvidia-cdi", cdi_handler: str = "nvidia-cdi") -> dict[str, str]:
    """RuntimeClass name -> handler for the runtimes ``runtime configure`` wires into containerd."""
    out = {name: handler}
    if cdi:
        out[cdi_name] = cdi_handler
    return out


def _body(name: str, handler: str) -> k8s.V1RuntimeClass:
    return k8s.V1RuntimeClass(
        api_version="node.k8s.io/v1",
        kind="RuntimeClass",
        metadata=k8s.V1ObjectMeta(name=name, labels=dict(MANAGED_BY)),
        handler=handler,
    )


def ensure_runtime_class(kube: KubeClient, name: str, handler: str) -> Action:
    api = kube.node_api
    try:
        current = api.read_runtime_class(name)
    except ApiException as e:
        if e.status != 404:
            raise kube_error(f"read RuntimeClass {name}", e, subject=name) from e
        current = None
    try:
        if current is None:
            try:
                api.create_runtime_class(_body(name, handler))
                return "created"
            except ApiException as e:
                if e.status != 409:
                    raise
                current = api.read_runtime_class(name)  # created concurrently by another node
        if current.handler != handler:
            api.delete_runtime_class(name)
            api.create_runtime_class(_body(name, handler))
            return "replaced"
        labels = (current.metadata.labels if current.metadata is not None else None) or {}
        if any(labels.get(k) != v for k, v in MANAGED_BY.items()):
            api.patch_runtime_class(name, {"metadata": {"labels": dict(MANAGED_BY)}})
            return "updated"
        return "unchanged"
    except ApiException as e:
        raise kube_error(f"write RuntimeClass {name}", e, subject=name) from e


def ensure_runtime_classes(kube: KubeClient, classes: Mapping[str, str]) -> dict[str, Action]:
    """Create or update every ``name -> handler``; returns what happened to each."""
    return {name: ensure_runtime_class(kube, name, handler) for name, handler in classes.items()}
