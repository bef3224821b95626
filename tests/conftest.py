"""Shared pytest configuration: the real-peer fixtures (see tests/peers/__init__.py for their API)."""

from tests.peers.fixtures import containerd, containerd2, kube_apiserver, kubelet_harness

__all__ = ["containerd", "containerd2", "kube_apiserver", "kubelet_harness"]
