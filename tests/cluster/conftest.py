"""The single-node cluster of tests/peers/cluster.py, one per test session: it owns host paths (the kubelet's
fixed plugin directories, containerd's default socket and config), so every test of this directory shares it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.peers._resolve import PeerMissingError
from tests.peers.cluster import Cluster, running_cluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    try:
        with running_cluster() as c:
            yield c
    except PeerMissingError as e:
        pytest.fail(str(e), pytrace=False)
