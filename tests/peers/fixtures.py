"""The pytest fixtures (re-exported by tests/conftest.py). A missing peer FAILS the test, never skips."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.peers._resolve import PeerMissingError
from tests.peers.apiserver import KubeApiServer, running_apiserver
from tests.peers.containerd import Containerd, containerd_peer
from tests.peers.containerd2 import Containerd2
from tests.peers.harness import KubeletHarness, running_harness


@pytest.fixture(scope="session")
def kube_apiserver() -> Iterator[KubeApiServer]:
    """One etcd + kube-apiserver per test session; tests isolate by object names."""
    try:
        with running_apiserver() as server:
            yield server
    except PeerMissingError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture
def kubelet_harness() -> Iterator[KubeletHarness]:
    """A fresh kubelet device manager; its plugin directory is a short temp path (socket paths must stay
    under 108 bytes), removed at the end."""
    try:
        with running_harness() as harness:
            yield harness
    except PeerMissingError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture
def containerd() -> Iterator[Containerd]:
    """Debian's containerd: ``config_dump(path)`` and ``start(path)``; started instances stop at the end."""
    try:
        with containerd_peer() as peer:
            yield peer
    except PeerMissingError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture
def containerd2() -> Iterator[Containerd2]:
    """containerd 2 built from source (config versions 3/4): the ``containerd`` API plus ``cri_status``."""
    try:
        with containerd_peer(Containerd2) as peer:
            assert isinstance(peer, Containerd2)
            yield peer
    except PeerMissingError as e:
        pytest.fail(str(e), pytrace=False)
