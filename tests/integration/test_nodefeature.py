"""``[publish] labels = "nodefeature"`` against the REAL kube-apiserver with NFD's own CRDs
(sigs.k8s.io/node-feature-discovery v0.18.2, tests/testbin/setup.sh): the labels nodeagent would write on the
Node go, with the same keys and values, into one NodeFeature per node, owned by the Node; an unchanged pass
writes nothing; the labels nodeagent had written on the Node are given up; back on "node" the object goes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from nodeagent.config import PublishSettings
from nodeagent.errors import KubeError
from nodeagent.kube.client import KubeClient
from nodeagent.kube.labels import MANAGED_LABELS_ANNOTATION, NetFacts, desired_labels, sharing_facts
from nodeagent.kube.nodefeature import NODE_NAME_LABEL, PATH
from nodeagent.kube.publisher import NodePublisher
from tests.integration._kube import throwaway_node, wait_for
from tests.integration.test_kube_publish import gpu, inventory
from tests.peers._resolve import PeerMissingError, peer_file

pytestmark = pytest.mark.peers

NS = "nodeagent"
NET = NetFacts(100000, 2)


def install_nfd_crds(kube: KubeClient) -> None:
    """NFD's CRDs as its release ships them, created once per API server (a second time: 409)."""
    try:
        crds = peer_file("NODEAGENT_NFD_CRD", "nodeagent_peers_nfd_crd", "NFD's CRDs (Go module proxy)")
    except PeerMissingError as e:
        pytest.fail(str(e), pytrace=False)
    for doc in yaml.safe_load_all(Path(crds).read_text()):
        if doc:
            with contextlib.suppress(KubeError):
                kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=doc)
    wait_for(lambda: _served(kube), 30)
    with contextlib.suppress(KubeError):
        kube.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                         "metadata": {"name": NS}})


def _served(kube: KubeClient) -> bool:
    try:
        kube.request("GET", f"{PATH}/nodefeatures")
    except KubeError:
        return False
    return True


@pytest.fixture
def node(kube: KubeClient) -> Iterator[str]:
    install_nfd_crds(kube)
    with throwaway_node(kube, "nf-node", lambda n: {"kubernetes.io/hostname": n}) as name:
        yield name


def test_the_labels_go_into_one_node_feature_owned_by_the_node(kube: KubeClient, node: str) -> None:
    started = time.monotonic()
    inv = inventory(gpu(0), gpu(1))
    on_node = NodePublisher(kube, node, PublishSettings(extended_resources=False, gpu_objects=False, events=False),
                            net=NET)
    on_node.publish(inv)
    wanted = desired_labels(inv, sharing_facts(None), NET)
    assert wanted and all(kube.request("GET", f"/api/v1/nodes/{node}")["metadata"]["labels"].get(k) == v
                          for k, v in wanted.items())

    nf = NodePublisher(kube, node, PublishSettings(labels="nodefeature", extended_resources=False,
                                                   gpu_objects=False, events=False), net=NET)
    res = nf.publish(inv)
    assert not res.errors, res.errors
    path = f"{PATH}/namespaces/{NS}/nodefeatures/nodeagent-{node}"
    obj = kube.request("GET", path)
    assert obj["spec"]["labels"] == wanted  # the same keys and values
    assert obj["metadata"]["labels"][NODE_NAME_LABEL] == node
    node_obj = kube.request("GET", f"/api/v1/nodes/{node}")
    assert [(r["kind"], r["name"], r["uid"]) for r in obj["metadata"]["ownerReferences"]] == [
        ("Node", node, node_obj["metadata"]["uid"])]
    # nodeagent gave the Node's labels up (NFD's master applies the object's)
    assert not set(wanted) & set(node_obj["metadata"].get("labels") or {}), node_obj["metadata"]["labels"]
    assert MANAGED_LABELS_ANNOTATION not in (node_obj["metadata"].get("annotations") or {})

    version = obj["metadata"]["resourceVersion"]
    again = nf.publish(inv)
    assert again.metadata_writes == 0 and kube.request("GET", path)["metadata"]["resourceVersion"] == version

    # a GPU more: the object follows, still one per node
    bigger = inventory(gpu(0), gpu(1), gpu(2))
    nf.publish(bigger)
    assert kube.request("GET", path)["spec"]["labels"] == desired_labels(bigger, sharing_facts(None), NET)
    listed = kube.request("GET", f"{PATH}/nodefeatures", query={"labelSelector": f"{NODE_NAME_LABEL}={node}"})
    assert [o["metadata"]["name"] for o in listed["items"]] == [f"nodeagent-{node}"]

    # back to the Node: the labels are on it again and the object is gone
    back = NodePublisher(kube, node, PublishSettings(extended_resources=False, gpu_objects=False, events=False),
                         net=NET)
    back.publish(bigger)
    labels = kube.request("GET", f"/api/v1/nodes/{node}")["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in desired_labels(bigger, sharing_facts(None), NET).items())
    with pytest.raises(KubeError) as gone:
        kube.request("GET", path)
    assert gone.value.status == 404
    print(f"nodefeature scenario: {time.monotonic() - started:.1f} s")
