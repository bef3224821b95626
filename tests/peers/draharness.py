"""Typed client for tests/testbin/dra-harness (the kubelet's own DRA manager and plugin watcher).

Calls block until the harness answers; a test whose DRA driver runs on the same asyncio loop must call
them through ``asyncio.to_thread`` (the harness calls back into the driver while the test waits).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.peers._proc import exchange, quit_peer, tail
from tests.peers._resolve import peer_binary


class DraHarnessError(RuntimeError):
    """A harness command failed (the kubelet code's error message)."""


@dataclass(frozen=True)
class Pod:
    """A pod using ResourceClaims by name: ``claims`` maps the pod's claim name to the ResourceClaim name;
    ``containers`` maps each container to the pod claim names it uses. ``templates`` maps a pod claim name
    to the ResourceClaimTemplate its claim was generated from: the pod then carries it as the API server
    does (the template in its spec, the generated claim's name in ``status.resourceClaimStatuses``), and
    the claim must be owned by the pod."""

    namespace: str
    name: str
    uid: str
    claims: dict[str, str]
    containers: dict[str, list[str]]
    templates: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace, "name": self.name, "uid": self.uid,
            "claims": [{"name": n, "claim": c, **({"template": self.templates[n]} if n in self.templates else {})}
                       for n, c in self.claims.items()],
            "containers": [{"name": n, "claims": cs} for n, cs in self.containers.items()],
        }


@dataclass
class DraHarness:
    registry_dir: Path
    state_dir: Path
    workdir: Path
    pod_resources_socket: Path | None
    _proc: subprocess.Popen[str] = field(repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        with self._lock:
            reply = exchange(self._proc, {"cmd": cmd, **args}, "DRA harness", self.log_tail, DraHarnessError)
        if not reply.get("ok"):
            raise DraHarnessError(str(reply.get("error")))
        return reply

    def wait_registered(self, driver: str, timeout: float = 15.0) -> None:
        self.call("wait_registered", driver=driver, timeout=timeout)

    def prepare(self, pod: Pod) -> dict[str, list[str]]:
        """The kubelet's PrepareResources for the pod; the CDI device IDs per container."""
        cdi: dict[str, list[str]] = self.call("prepare", pod=pod.to_json())["cdi"]
        return cdi

    def prepare_timed(self, pod: Pod) -> tuple[dict[str, list[str]], float]:
        """Like ``prepare``, with the seconds PrepareResources took inside the kubelet code."""
        r = self.call("prepare", pod=pod.to_json())
        return r["cdi"], float(r["seconds"])

    def unprepare(self, pod: Pod) -> None:
        self.call("unprepare", pod=pod.to_json())

    def health(self, pod: Pod) -> dict[str, list[dict[str, Any]]]:
        """``containerStatuses[].allocatedResourcesStatus`` as the kubelet would fill them, per container."""
        status: dict[str, list[dict[str, Any]]] = {
            k: v or [] for k, v in self.call("health", pod=pod.to_json())["status"].items()
        }
        return status

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.workdir / "dra-harness.log", lines)

    def stop(self) -> None:
        quit_peer(self._proc)


def start_dra_harness(workdir: Path, kubeconfig: Path, registry_dir: Path, node_name: str,
                      verbosity: int = 0, binary: Path | None = None, host_root: Path | None = None,
                      pod_resources_socket: Path | None = None) -> DraHarness:
    """``binary`` is another build of the harness (default: NODEAGENT_DRA_HARNESS, the peers' release).
    ``host_root``: the kubelet's host filesystem is this directory, so a plugin's registered endpoint (a
    host path) is dialled under it (default: the real filesystem). ``pod_resources_socket``: the harness
    also serves the kubelet's PodResources v1 API there (the socket exists once the harness answers its
    first command): List reports the pods prepared and not yet unprepared, each container with the claims
    the DRA manager holds for it; no devices, CPUs or memory (no such managers run)."""
    binary = binary or peer_binary("NODEAGENT_DRA_HARNESS", "nodeagent_peers_dra_harness", "kubelet DRA harness")
    state_dir = workdir / "dra-state"
    with (workdir / "dra-harness.log").open("wb") as log:
        proc = subprocess.Popen(
            [str(binary), f"--kubeconfig={kubeconfig}", f"--registry-dir={registry_dir}",
             f"--state-dir={state_dir}", f"--node-name={node_name}", f"--v={verbosity}",
             *([f"--host-root={host_root}"] if host_root is not None else []),
             *([f"--pod-resources-socket={pod_resources_socket}"] if pod_resources_socket is not None else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
        )
    return DraHarness(registry_dir, state_dir, workdir, pod_resources_socket, proc)


@contextmanager
def running_dra_harness(kubeconfig: Path, registry_dir: Path, node_name: str,
                        binary: Path | None = None, host_root: Path | None = None,
                        pod_resources_socket: Path | None = None) -> Iterator[DraHarness]:
    wd = Path(tempfile.mkdtemp(prefix="nodeagent-dra-kubelet-"))
    try:
        harness = start_dra_harness(wd, kubeconfig, registry_dir, node_name, verbosity=4, binary=binary,
                                    host_root=host_root, pod_resources_socket=pod_resources_socket)
        try:
            yield harness
        finally:
            harness.stop()
    finally:
        shutil.rmtree(wd, ignore_errors=True)
