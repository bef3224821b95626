"""The two Kubernetes releases the dynamic MIG tests run against: v1.34.4 (partitionable devices alpha,
counters in the slice of their devices) and v1.37.2 (beta, counter sets in slices of their own). A module
that defines ``kube_apiserver = release_apiserver`` runs every test once per release; a missing peer
fails the test (built on first use through tests/testbin/setup.sh), never skips."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.peers._resolve import PeerMissingError, peer_binary
from tests.peers.apiserver import KubeApiServer, start_apiserver

# release → suffix of the NODEAGENT_* variables
RELEASES = {"v1.34.4": "", "v1.37.2": "_1_37"}
_SETUP_134 = {"kube-apiserver": "nodeagent_peers_apiserver", "kube-scheduler": "nodeagent_peers_kube_control_plane"}


def _build_137(component: str, env: str) -> str:
    """A setup.sh snippet building (or finding in the cache) one 1.37.2 component of tests/testbin/peers,
    as nodeagent_peers_k8s137 does, without the rest of that release's peers."""
    return (f'_m=$NODEAGENT_TESTBIN/peers; _v=$(_go_mod_version "$_m" k8s.io/kubernetes go-1.37.mod); '
            f'build_go_binary {component} "$_m" ./cmd/{component} "$_v" "$(_kube_version_ldflags "$_v")" '
            f'go-1.37.mod && export {env}=$NODEAGENT_GO_BINARY')


def release_binary(release: str, component: str) -> Path:
    suffix = RELEASES[release]
    env = "NODEAGENT_" + component.upper().replace("-", "_") + suffix
    fn = _SETUP_134[component] if not suffix else _build_137(component, env)
    try:
        return peer_binary(env, fn, f"{component} {release}")
    except PeerMissingError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module", params=sorted(RELEASES))
def release_apiserver(request: pytest.FixtureRequest) -> Iterator[KubeApiServer]:
    binary = release_binary(request.param, "kube-apiserver")
    if RELEASES[request.param]:  # 1.37: partitionable devices are on by default; no loopback endpoints
        server = start_apiserver(binary=binary, feature_gates="", extra_args=["--endpoint-reconciler-type=none"])
    else:
        server = start_apiserver(binary=binary)
    assert server.version == request.param, server.version
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)
