"""The Kubernetes releases the dynamic MIG tests run against: v1.34.4 (partitionable devices alpha, counters
in the slice of their devices), v1.35.4 (alpha, counter sets in slices of their own), v1.36.3 and v1.37.2
(beta). A module
that defines ``kube_apiserver = release_apiserver`` runs every test once per release; a missing peer
fails the test (built on first use through tests/testbin/setup.sh), never skips.

``shared_release_apiserver`` also runs a module once per release, on API servers shared by every module of
the session that uses it (the one of 1.34 is the session's ``kube_apiserver``): for tests that isolate by
node and object names, so that each release's server starts once per pytest worker, not once per module.
``release_binary(release, "dra-harness")`` is the kubelet DRA harness built from that release's kubelet;
``release_binary(release, "kube-controller-manager")`` (also kube-apiserver, kube-scheduler) that release's
component."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.peers._resolve import PeerMissingError, peer_binary
from tests.peers.apiserver import KubeApiServer, start_apiserver

# release → suffix of the NODEAGENT_* variables
RELEASES = {"v1.34.4": "", "v1.35.4": "_1_35", "v1.36.3": "_1_36", "v1.37.2": "_1_37"}
_SETUP_134 = {"kube-apiserver": "nodeagent_peers_apiserver", "kube-scheduler": "nodeagent_peers_kube_control_plane",
              "kube-controller-manager": "nodeagent_peers_kube_control_plane",
              "dra-harness": "nodeagent_peers_dra_harness"}


def _build_release(component: str, suffix: str) -> str:
    """A setup.sh snippet building (or finding in the cache) one component of the release with that suffix
    (``_1_37``), as nodeagent_peers_k8s137 does, without the rest of its peers (the dra-harness with the build
    tag of that release's kubelet API, ``k8s137``)."""
    minor = suffix.rsplit("_", 1)[1]
    return f"_peers_k8s_release {minor} k8s1{minor} {component}"


def release_binary(release: str, component: str) -> Path:
    suffix = RELEASES[release]
    env = "NODEAGENT_" + component.upper().replace("-", "_") + suffix
    fn = _SETUP_134[component] if not suffix else _build_release(component, suffix)
    try:
        return peer_binary(env, fn, f"{component} {release}")
    except PeerMissingError as e:
        pytest.fail(str(e), pytrace=False)


def _apiserver(release: str) -> Iterator[KubeApiServer]:
    binary = release_binary(release, "kube-apiserver")
    if release >= "v1.36":  # partitionable devices are on by default; no loopback endpoints
        server = start_apiserver(binary=binary, feature_gates="", extra_args=["--endpoint-reconciler-type=none"])
    elif RELEASES[release]:  # 1.35: the gates of 1.34 (alpha), no loopback endpoints
        server = start_apiserver(binary=binary, extra_args=["--endpoint-reconciler-type=none"])
    else:
        server = start_apiserver(binary=binary)
    assert server.version == release, server.version
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.fixture(scope="module", params=sorted(RELEASES))
def release_apiserver(request: pytest.FixtureRequest) -> Iterator[KubeApiServer]:
    """The API server of every release."""
    yield from _apiserver(request.param)


class ApiServerPool:
    """The API servers of the releases after 1.34, each started on first use and stopped by ``close`` (at the
    latest at the end of the session); one asked for again after a close starts again."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._servers: dict[str, KubeApiServer] = {}

    def get(self, release: str) -> KubeApiServer:
        if release not in self._servers:
            self._servers[release] = self._stack.enter_context(contextlib.contextmanager(_apiserver)(release))
        return self._servers[release]

    def close(self) -> None:
        self._servers.clear()
        self._stack.close()


_pools: list[ApiServerPool] = []


@pytest.fixture(scope="session")
def release_apiserver_pool() -> Iterator[ApiServerPool]:
    pool = ApiServerPool()
    _pools.append(pool)
    try:
        yield pool
    finally:
        _pools.remove(pool)
        pool.close()


def stop_release_apiservers() -> None:
    """Stop the servers the session's pool started so far (tests/conftest.py: once the tests that share them
    are done)."""
    for pool in _pools:
        pool.close()


@pytest.fixture(scope="module", params=sorted(RELEASES))
def shared_release_apiserver(request: pytest.FixtureRequest, release_apiserver_pool: ApiServerPool) -> KubeApiServer:
    """The API server of every release, shared with the session's other modules (1.34: ``kube_apiserver``)."""
    if not RELEASES[request.param]:
        server: KubeApiServer = request.getfixturevalue("kube_apiserver")
        return server
    return release_apiserver_pool.get(request.param)
