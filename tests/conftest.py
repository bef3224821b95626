"""Shared pytest configuration: the real-peer fixtures (see tests/peers/__init__.py for their API), and the
grouping of test files for the two pytest-xdist workers of tests/run.sh (``--dist loadfile``)."""

import json
import logging
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import pytest

import nodeagent  # noqa: F401  # first: the tests load grpc with the daemon's gRPC settings
from tests.integration._releases import release_apiserver_pool, stop_release_apiservers
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


# Test files on the API servers of every Kubernetes release (``shared_release_apiserver``, started on first use
# and kept by the worker that started them): one scope too, so only one worker ever starts the servers of 1.35
# and later, and stops them once the scope's last test is done (``pytest_runtest_teardown`` below) instead of
# keeping them, idle but never free of CPU, to the end of the session. tests/unit/test_test_groups.py checks
# that this list names every file that uses them.
RELEASES = "every-release"
RELEASES_FILES = (
    "tests/e2e/test_kube_confinement.py",
    "tests/e2e/test_run_dra.py",
    "tests/e2e/test_run_dra_dynamic_mig.py",
    "tests/e2e/test_run_dra_kubelet.py",
    "tests/e2e/test_run_planes.py",
    "tests/integration/test_dra_dynamic_mig_api.py",
    "tests/integration/test_dra_slices_outage.py",
    "tests/integration/test_podresources_dra.py",
    "tests/integration/test_remediation_dra.py",
)


def scope_of(nodeid: str) -> str:
    """The scope a test (``path::name``) runs in on the workers: its group's, else its file's."""
    path = nodeid.split("::", 1)[0]
    if path.startswith(HOST_OWNED_FILES):
        return HOST_OWNED
    return RELEASES if path in RELEASES_FILES else path


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with the grouped files as one scope each (pytest-xdist's scheduler hook)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]

    class GroupsTogether(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return GroupsTogether(config, log)


# NODEAGENT_TEST_CPU_LOG=path: each worker appends one JSON line per test file when it is done: the file's wall
# seconds and the CPU seconds of the worker and of the children it waited for (a module's peers, stopped by its
# teardown, count with its last test), to see where a run's CPU goes.
_CPU_LOG = os.environ.get("NODEAGENT_TEST_CPU_LOG", "")
_cpu_by_file: dict[str, list[float]] = {}


def _cpu_now() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _CPU_LOG:
        yield
        return
    wall, cpu = time.monotonic(), _cpu_now()
    yield
    spent = _cpu_by_file.setdefault(item.nodeid.split("::", 1)[0], [0.0, 0.0])
    spent[0] += time.monotonic() - wall
    spent[1] += _cpu_now() - cpu


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _CPU_LOG and _cpu_by_file:
        with open(_CPU_LOG, "a", encoding="utf-8") as f:
            for path, (wall, cpu) in sorted(_cpu_by_file.items()):
                f.write(json.dumps({"file": path, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}) + "\n")


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs the CLI in this process gets the daemon's ``setup_logging``: a root handler on the
    test's captured stderr. It goes with the test, so a thread logging later writes to pytest's handlers, not
    to a closed stream."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:  # pytest's own handlers (module _pytest.logging) are pytest's to manage
        if handler not in before and type(handler).__module__ == "logging":
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test of the every-release group on this worker (its module fixtures finalized by then),
    the release API servers it started stop."""
    yield
    if scope_of(item.nodeid) == RELEASES and (nextitem is None or scope_of(nextitem.nodeid) != RELEASES):
        stop_release_apiservers()
