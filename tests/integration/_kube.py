"""Helpers shared by the integration tests that talk to the REAL kube-apiserver: throwaway Nodes and polling."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from nodeagent.kube.client import KubeClient


@contextmanager
def throwaway_node(
    kube: KubeClient, prefix: str, labels: Callable[[str], dict[str, str]] | None = None
) -> Iterator[str]:
    """Create a Node named ``<prefix>-<random>``, yield its name, delete it after.

    ``labels``, if given, builds the Node's labels from its name (e.g. ``kubernetes.io/hostname``)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    metadata: dict[str, Any] = {"name": name}
    if labels is not None:
        metadata["labels"] = labels(name)
    kube.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node", "metadata": metadata})
    try:
        yield name
    finally:
        kube.request("DELETE", f"/api/v1/nodes/{name}")


def wait_for(cond: Callable[[], Any], timeout: float = 15.0, interval: float = 0.05) -> Any:
    """Poll ``cond`` until it returns something truthy and return that; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (v := cond()):
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)
    return v
