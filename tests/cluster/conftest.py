"""The single-node cluster of tests/peers/cluster.py, one per test module: it owns host paths (the kubelet's
fixed plugin directories, containerd's default socket and config, the driver library), so it holds the
host-wide test lock (tests/peers/hostlock.py) from its start to its teardown. A module's ``CLUSTER_IMPORTS``
names the images its containerd imports (default: pause, base and agent; see tests.peers.cluster.start_cluster).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.peers._resolve import PeerMissingError
from tests.peers.cluster import Cluster, running_cluster
from tests.peers.hostlock import host_owned


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    imported = getattr(request.module, "CLUSTER_IMPORTS", ("pause", "base", "agent"))
    try:
        with host_owned("the whole-node cluster"), running_cluster(imported) as c:
            yield c
    except PeerMissingError as e:
        pytest.fail(str(e), pytrace=False)
