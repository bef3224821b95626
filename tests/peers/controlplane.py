"""kube-scheduler and kube-controller-manager (its resourceclaim controller) beside the test kube-apiserver,
for four Kubernetes releases: the DRA scheduling tests run the same pods through each.

Releases (``RELEASES``), all built by tests/testbin/setup.sh from one set of Go sources:

``v1.34.4`` (tests/testbin/peers/go.mod, the release of the other peers; the DRA v1 API floor)
    kube-apiserver (NODEAGENT_KUBE_APISERVER), kube-scheduler (NODEAGENT_KUBE_SCHEDULER),
    kube-controller-manager (NODEAGENT_KUBE_CONTROLLER_MANAGER), dra-harness (NODEAGENT_DRA_HARNESS).
    Feature gates: DRADeviceTaints=true (alpha; taints on unhealthy devices) and DRAExtendedResource=true
    (alpha; DeviceClass.extendedResourceName), on every component; the API server also serves
    resource.k8s.io/v1alpha3 (DeviceTaintRule, which the scheduler watches once DRADeviceTaints is on).
``v1.35.4`` (go-1.35.mod), ``v1.36.3`` (go-1.36.mod)
    NODEAGENT_KUBE_APISERVER_1_35, ..._KUBE_SCHEDULER_1_35, ..._KUBE_CONTROLLER_MANAGER_1_35,
    ..._DRA_HARNESS_1_35 (and _1_36). Feature gates: 1.35 turns on DRADeviceTaints and DRAExtendedResource
    (still alpha there; its resourceclaim controller reads DRAAdminAccess and DRAPrioritizedList, beta and
    on) and serves resource.k8s.io/v1alpha3; 1.36 runs with its defaults (DRADeviceTaints,
    DRAExtendedResource, consumable capacity and partitionable devices beta and on; admin access and
    prioritized lists GA).
``v1.37.2`` (go-1.37.mod beside each go.mod)
    NODEAGENT_KUBE_APISERVER_1_37, NODEAGENT_KUBE_SCHEDULER_1_37, NODEAGENT_KUBE_CONTROLLER_MANAGER_1_37,
    NODEAGENT_DRA_HARNESS_1_37. Feature gates: none, the release's defaults (DRAExtendedResource and
    DRADeviceTaints are GA, DRAPartitionableDevices and DRAConsumableCapacity beta, all on); the API
    server runs with --endpoint-reconciler-type=none (1.37 rejects the loopback advertise address otherwise).

``running_control_plane(release)`` starts etcd + kube-apiserver, the controller manager (only
``resourceclaim-controller``: ResourceClaims from pod templates, reservations released when pods go; from
1.37 also the device-taint eviction controller) and the scheduler (default profile, DynamicResources plugin
included), each serving /healthz on a loopback port; it returns once all answer. Missing binaries are built on first use (setup.sh functions).
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tests.peers._proc import stop_process, tail
from tests.peers._resolve import peer_binary
from tests.peers.apiserver import KubeApiServer, free_port, start_apiserver

READY_TIMEOUT = 90.0


@dataclass(frozen=True)
class KubeRelease:
    """Where one release's control-plane binaries come from, and the feature gates the tests turn on."""

    version: str
    env_suffix: str  # "" or e.g. "_1_37": NODEAGENT_KUBE_SCHEDULER<suffix>
    setup_function: str  # the setup.sh function building the scheduler and controller manager
    apiserver_setup: str
    harness_setup: str
    feature_gates: str
    apiserver_args: tuple[str, ...] = ()

    @property
    def minor(self) -> int:
        return int(self.version.split(".")[1])

    def binary(self, component: str, setup_function: str) -> Path:
        env = f"NODEAGENT_{component.upper().replace('-', '_')}{self.env_suffix}"
        return peer_binary(env, setup_function, f"{component} {self.version}")

    def apiserver(self) -> Path:
        return self.binary("kube-apiserver", self.apiserver_setup)

    def scheduler(self) -> Path:
        return self.binary("kube-scheduler", self.setup_function)

    def controller_manager(self) -> Path:
        return self.binary("kube-controller-manager", self.setup_function)

    def dra_harness(self) -> Path:
        return self.binary("dra-harness", self.harness_setup)


RELEASES = (
    KubeRelease("v1.34.4", "", "nodeagent_peers_kube_control_plane", "nodeagent_peers_apiserver",
                "nodeagent_peers_dra_harness", "DRADeviceTaints=true,DRAExtendedResource=true",
                ("--runtime-config=resource.k8s.io/v1alpha3=true",)),
    KubeRelease("v1.35.4", "_1_35", "nodeagent_peers_k8s135", "nodeagent_peers_k8s135", "nodeagent_peers_k8s135",
                "DRADeviceTaints=true,DRAExtendedResource=true",
                ("--runtime-config=resource.k8s.io/v1alpha3=true", "--endpoint-reconciler-type=none")),
    KubeRelease("v1.36.3", "_1_36", "nodeagent_peers_k8s136", "nodeagent_peers_k8s136", "nodeagent_peers_k8s136",
                "", ("--endpoint-reconciler-type=none",)),
    KubeRelease("v1.37.2", "_1_37", "nodeagent_peers_k8s137", "nodeagent_peers_k8s137",
                "nodeagent_peers_k8s137", "",
                # 1.37 refuses a loopback advertise address while it reconciles the kubernetes Endpoints
                ("--endpoint-reconciler-type=none",)),
)


@dataclass
class ControlPlane:
    release: KubeRelease
    apiserver: KubeApiServer
    workdir: Path
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    _logs: list[IO[bytes]] = field(default_factory=list, repr=False)

    def log_tail(self, component: str, lines: int = 40) -> str:
        if component == "kube-apiserver":
            return self.apiserver.log_tail(lines=lines)
        return tail(self.workdir / f"{component}.log", lines)

    def check_running(self) -> None:
        """Raise with the log of a component that has exited."""
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def stop(self) -> None:
        for proc in reversed(list(self._procs.values())):
            stop_process(proc)
        self._procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()
        self.apiserver.stop()


def _start(plane: ControlPlane, name: str, args: list[str]) -> int:
    port = free_port()
    log = (plane.workdir / f"{name}.log").open("wb")
    plane._logs.append(log)
    kubeconfig = plane.apiserver.kubeconfig
    common = [f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
              f"--authorization-kubeconfig={kubeconfig}", "--bind-address=127.0.0.1", f"--secure-port={port}",
              f"--cert-dir={plane.workdir / name}", "--leader-elect=false", "--v=2"]
    gates = [f"--feature-gates={plane.release.feature_gates}"] if plane.release.feature_gates else []
    plane._procs[name] = subprocess.Popen([*args, *common, *gates], stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT)
    return port


def _wait_healthy(plane: ControlPlane, ports: dict[str, int]) -> None:
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE  # self-signed serving certificates in the components' cert dirs
    deadline = time.monotonic() + READY_TIMEOUT
    waiting = dict(ports)
    last = ""
    while waiting:
        plane.check_running()
        for name, port in list(waiting.items()):
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=insecure, timeout=2) as r:
                    if r.status == 200:
                        del waiting[name]
            except (OSError, urllib.error.URLError) as e:
                last = f"{name}: {e}"
        if time.monotonic() > deadline:
            name = next(iter(waiting))
            raise RuntimeError(f"{name} not healthy after {READY_TIMEOUT:.0f}s ({last}):\n{plane.log_tail(name)}")
        time.sleep(0.2)


def start_control_plane(release: KubeRelease) -> ControlPlane:
    scheduler = release.scheduler()
    manager = release.controller_manager()
    server = start_apiserver(binary=release.apiserver(), feature_gates=release.feature_gates,
                             extra_args=release.apiserver_args)
    plane = ControlPlane(release, server, Path(tempfile.mkdtemp(prefix="nodeagent-control-plane-")))
    try:
        assert server.version == release.version, (server.version, release.version)
        ports = {"kube-scheduler": _start(plane, "kube-scheduler", [str(scheduler)])}
        # from 1.37 (device taints GA) also the eviction of pods whose devices carry a NoExecute taint
        controllers = "resourceclaim-controller" + (",device-taint-eviction-controller" if release.minor >= 37 else "")
        ports["kube-controller-manager"] = _start(plane, "kube-controller-manager", [
            str(manager), f"--controllers={controllers}", "--use-service-account-credentials=false"])
        _wait_healthy(plane, ports)
    except BaseException:
        plane.stop()
        shutil.rmtree(plane.workdir, ignore_errors=True)
        shutil.rmtree(server.workdir, ignore_errors=True)
        raise
    return plane


@contextmanager
def running_control_plane(release: KubeRelease) -> Iterator[ControlPlane]:
    plane = start_control_plane(release)
    try:
        yield plane
    finally:
        plane.stop()
        shutil.rmtree(plane.workdir, ignore_errors=True)
        shutil.rmtree(plane.apiserver.workdir, ignore_errors=True)
