"""The pytest fixtures (re-exported by tests/conftest.py). A missing peer FAILS the test, never skips."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

import pytest

from tests.peers._resolve import PeerMissingError
from tests.peers.apiserver import KubeApiServer, running_apiserver
from tests.peers.containerd import Containerd, containerd_peer
from tests.peers.containerd2 import Containerd2
from tests.peers.harness import KubeletHarness, running_harness

T = TypeVar("T")


@contextmanager
def _required(peer: AbstractContextManager[T]) -> Iterator[T]:
    """Enter a peer; a missing one fails the test with what to install or build (never a skip)."""
    try:
        with peer as running:
            yield running
    except PeerMissingError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def kube_apiserver() -> Iterator[KubeApiServer]:
    """One etcd + kube-apiserver per test session; tests isolate by object names."""
    with _required(running_apiserver()) as server:
        yield server


@pytest.fixture
def kubelet_harness() -> Iterator[KubeletHarness]:
    """A fresh kubelet device manager; its plugin directory is a short temp path (socket paths must stay
    under 108 bytes), removed at the end."""
    with _required(running_harness()) as harness:
        yield harness


@pytest.fixture
def containerd() -> Iterator[Containerd]:
    """Debian's containerd: ``config_dump(path)`` and ``start(path)``; started instances stop at the end."""
    with _required(containerd_peer()) as peer:
        yield peer


@pytest.fixture
def containerd2() -> Iterator[Containerd2]:
    """containerd 2 built from source (config versions 3/4): the ``containerd`` API plus ``cri_status``."""
    with _required(containerd_peer(Containerd2)) as peer:
        assert isinstance(peer, Containerd2)
        yield peer
