"""Fixtures shared by the integration tests that talk to the REAL kube-apiserver."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nodeagent.kube.client import KubeClient, connect
from tests.integration._kube import throwaway_node
from tests.peers.apiserver import KubeApiServer


@pytest.fixture(scope="module")
def kube(kube_apiserver: KubeApiServer) -> Iterator[KubeClient]:
    """One API client per test module, closed when the module is done."""
    k = KubeClient(connect(kube_apiserver.kubeconfig))
    yield k
    k.close()


@pytest.fixture
def node_name(kube: KubeClient, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, empty Node per test, named after the test module (``test_kube_audit`` -> ``kube-audit-…``)."""
    prefix = request.module.__name__.rpartition(".")[2].removeprefix("test_").replace("_", "-")
    with throwaway_node(kube, prefix) as name:
        yield name
