"""The node's labels as Node Feature Discovery's ``NodeFeature`` object (``[publish] labels = "nodefeature"``).

NVIDIA's gpu-feature-discovery writes its labels this way by default since v0.19: one ``NodeFeature``
(``nfd.k8s-sigs.io/v1alpha1``) per node, labelled ``nfd.node.kubernetes.io/node-name=<node>``, whose
``spec.labels`` NFD's master applies to the Node. nodeagent writes the same keys and values it would write on
the Node into one such object:

- named ``nodeagent-<node>`` in the agent's namespace (``[publish] nodefeature_namespace``, default
  ``nodeagent``), labelled with the node name and ``app.kubernetes.io/managed-by=nodeagent``;
- owned by its Node (``ownerReferences``: the Node's name and UID), so it goes with the Node;
- written only when its labels (or its owner) differ from what the API holds; deleted when the agent publishes
  labels on the Node again.

NFD's master accepts label keys outside its own domains only when told (``-extra-label-ns nvidia.com,...``): a
cluster that runs gpu-feature-discovery through NFD already allows ``nvidia.com``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from nodeagent.errors import KubeError, LabelValueError
from nodeagent.kube.client import KubeClient

log = logging.getLogger(__name__)

API_VERSION = "nfd.k8s-sigs.io/v1alpha1"
PATH = "/apis/nfd.k8s-sigs.io/v1alpha1"
KIND = "NodeFeature"
NODE_NAME_LABEL = "nfd.node.kubernetes.io/node-name"
MANAGED_BY = "app.kubernetes.io/managed-by"
NAME_PREFIX = "nodeagent-"
MAX_NAME = 253


def object_name(node: str) -> str:
    """``nodeagent-<node>``; a node name too long for it is refused (one line naming it)."""
    name = NAME_PREFIX + node
    if len(name) > MAX_NAME:
        raise LabelValueError(f"node name {node[:60]!r}... is {len(node)} characters: a NodeFeature named "
                              f"{NAME_PREFIX}<node> would exceed {MAX_NAME}; publish labels on the Node instead "
                              '([publish] labels = "node")', subject="publish.labels")
    return name


def desired(node: str, node_uid: str, namespace: str, labels: Mapping[str, str]) -> dict[str, Any]:
    """The NodeFeature object for ``labels`` (pure)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": object_name(node),
            "namespace": namespace,
            "labels": {NODE_NAME_LABEL: node, MANAGED_BY: "nodeagent"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}],
        },
        "spec": {"labels": dict(sorted(labels.items()))},
    }


def _same(current: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    meta, wmeta = current.get("metadata") or {}, want["metadata"]
    labels = meta.get("labels") or {}
    return ((current.get("spec") or {}).get("labels") or {}) == want["spec"]["labels"] \
        and all(labels.get(k) == v for k, v in wmeta["labels"].items()) \
        and [(r.get("kind"), r.get("name"), r.get("uid")) for r in meta.get("ownerReferences") or []] == \
        [(r["kind"], r["name"], r["uid"]) for r in wmeta["ownerReferences"]]


class NodeFeatureWriter:
    """The one NodeFeature of a node (blocking calls)."""

    def __init__(self, kube: KubeClient, node: str, namespace: str) -> None:
        self.kube = kube
        self.node = node
        self.namespace = namespace
        self._written: dict[str, Any] | None = None  # what the API held after the last write or read

    def _path(self, name: str | None = None) -> str:
        base = f"{PATH}/namespaces/{quote(self.namespace)}/nodefeatures"
        return base if name is None else f"{base}/{quote(name)}"

    def sync(self, labels: Mapping[str, str], node_uid: str) -> bool:
        """Make the object hold ``labels``; whether anything was written."""
        want = desired(self.node, node_uid, self.namespace, labels)
        name = want["metadata"]["name"]
        current = self._written
        if current is None or not _same(current, want):
            try:
                current = self.kube.request("GET", self._path(name), subject=self.node)
            except KubeError as e:
                if e.status != 404:
                    raise
                current = None
        if current is not None and _same(current, want):
            self._written = current
            return False
        if current is None:
            self._written = self.kube.request("POST", self._path(), body=want,
                                              action=f"create NodeFeature {self.namespace}/{name}", subject=self.node)
        else:
            want["metadata"]["resourceVersion"] = (current.get("metadata") or {}).get("resourceVersion")
            self._written = self.kube.request("PUT", self._path(name), body=want,
                                              action=f"update NodeFeature {self.namespace}/{name}", subject=self.node)
        return True

    def remove(self) -> bool:
        """Delete the object if there is one; whether it was there."""
        self._written = None
        try:
            self.kube.request("DELETE", self._path(object_name(self.node)),
                              action=f"delete NodeFeature {self.namespace}/{object_name(self.node)}",
                              subject=self.node)
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True
