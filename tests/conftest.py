"""Shared pytest configuration: the real-peer fixtures (see tests/peers/__init__.py for their API)."""

import nodeagent  # noqa: F401  # first: the tests load grpc with the daemon's gRPC settings
from tests.peers.fixtures import containerd, containerd2, kube_apiserver, kubelet_harness

__all__ = ["containerd", "containerd2", "kube_apiserver", "kubelet_harness"]
