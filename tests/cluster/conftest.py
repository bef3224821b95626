"""The single-node cluster of tests/peers/cluster.py, one per test module: it owns host paths (the kubelet's
fixed plugin directories, containerd's default socket and config, the driver library), so it holds the
host-wide test lock (tests/peers/hostlock.py) from its start to its teardown. A module's ``CLUSTER_IMPORTS``
names the images its containerd imports (default: pause, base and agent; see tests.peers.cluster.start_cluster).
The several-node cluster of tests/peers/multinode.py (fixture ``several_nodes``, its module's ``CLUSTER_NODES``
nodes) holds the same lock: it is that cluster with further nodes beside it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.peers._resolve import PeerMissingError
from tests.peers.cluster import Cluster, running_cluster
from tests.peers.hostlock import host_owned
from tests.peers.multinode import SeveralNodes, running_nodes


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    imported = getattr(request.module, "CLUSTER_IMPORTS", ("pause", "base", "agent"))
    try:
        with host_owned("the whole-node cluster"), running_cluster(imported) as c:
            yield c
    except PeerMissingError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module")
def several_nodes(request: pytest.FixtureRequest) -> Iterator[SeveralNodes]:
    count = getattr(request.module, "CLUSTER_NODES", 2)
    try:
        with host_owned("the several-node cluster"), running_nodes(count) as nodes:
            yield nodes
    except PeerMissingError as e:
        pytest.fail(str(e), pytrace=False)
