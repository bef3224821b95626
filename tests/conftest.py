"""Shared pytest configuration: the real-peer fixtures (see tests/peers/__init__.py for their API), and the
grouping of test files for the two pytest-xdist workers of tests/run.sh (``--dist loadfile``)."""

from typing import Any

import pytest

import nodeagent  # noqa: F401  # first: the tests load grpc with the daemon's gRPC settings
from tests.integration._releases import release_apiserver_pool
from tests.peers.fixtures import containerd, containerd2, kube_apiserver, kubelet_harness
from tests.unit._grpc_fixtures import served, service, short_dir

__all__ = ["containerd", "containerd2", "kube_apiserver", "kubelet_harness", "release_apiserver_pool", "served",
           "service", "short_dir"]

# Test files that own host paths (tests/peers/hostlock.py: the whole-node cluster, the booted Debian roots, the
# host's NVML library): one scope, run one file after the other on ONE worker, so none of them waits for the
# host lock while the other worker holds it (a wait would count against the test's timeout and leave a worker
# idle). Every other file is a scope of its own: it runs whole on one worker and its module fixtures start once.
HOST_OWNED = "host-owned"
HOST_OWNED_FILES = (
    "tests/cluster/",
    "tests/e2e/test_systemd_boot.py",
    "tests/e2e/test_distros.py",
    "tests/e2e/test_doctor_findings.py",
    "tests/unit/test_discover_cli.py",
)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with the host-owned files as one scope (pytest-xdist's scheduler hook)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]

    class HostOwnedTogether(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return HOST_OWNED if path.startswith(HOST_OWNED_FILES) else path

    return HostOwnedTogether(config, log)
