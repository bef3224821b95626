"""Typed client for tests/testbin/peers/cmd/kubelet-harness (the kubelet's own device manager)."""

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


class HarnessError(RuntimeError):
    """A harness command failed. ``code``/``message`` hold the plugin's gRPC status when there was one."""

    def __init__(self, error: str, code: str | None = None, message: str | None = None,
                 state: dict[str, Any] | None = None) -> None:
        super().__init__(error)
        self.code = code
        self.message = message
        self.state = state


@dataclass(frozen=True)
class Device:
    """``health`` is the kubelet's view (Unhealthy also when the plugin went away); ``reported`` is
    what the plugin last said in ListAndWatch."""

    id: str
    health: str
    numa: tuple[int, ...]
    reported: str = ""


@dataclass(frozen=True)
class Resource:
    """One resource as the kubelet's manager sees it. ``allocatable`` counts healthy devices;
    ``registered`` means the manager still lists it in the node capacity (true from registration until
    5 minutes after the plugin goes away; a disconnected plugin shows as allocatable 0)."""

    name: str
    devices: tuple[Device, ...]
    capacity: int
    allocatable: int
    registered: bool

    def device(self, device_id: str) -> Device:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise KeyError(device_id)

    @classmethod
    def from_json(cls, name: str, raw: dict[str, Any]) -> Resource:
        devices = tuple(Device(d["id"], d["health"], tuple(d.get("numa") or ()), d.get("reported", ""))
                        for d in raw.get("devices") or ())
        return cls(name, devices, int(raw.get("capacity", 0)), int(raw.get("allocatable", 0)),
                   bool(raw.get("registered")))


@dataclass(frozen=True)
class Allocation:
    """What the container runtime would be given for one container (merged over its resources)."""

    pod_uid: str
    container: str
    device_ids: tuple[str, ...]
    envs: dict[str, str]
    mounts: tuple[dict[str, Any], ...]
    devices: tuple[dict[str, Any], ...]
    annotations: dict[str, str]
    cdi_devices: tuple[str, ...]


@dataclass(frozen=True)
class Update:
    """A change of a resource's state, with the wall-clock time (``time.time()`` scale) it was seen."""

    seq: int
    time: float
    resource: Resource


@dataclass(frozen=True)
class PodHealth:
    """``containers``: container → resource → device ID → ``Healthy``/``Unhealthy`` (the pod status'
    ``allocatedResourcesStatus``); ``updates``: how many times the manager asked for this pod's status to be
    synced after a device health change."""

    containers: dict[str, dict[str, dict[str, str]]]
    updates: int


@dataclass
class KubeletHarness:
    """A running harness. ``plugin_dir`` is where plugins find ``kubelet.sock`` and put their sockets."""

    plugin_dir: Path
    pod_resources_socket: Path
    workdir: Path
    _proc: subprocess.Popen[str] = field(repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _next_id: int = 0

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / "kubelet.sock"

    def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        """Send one raw command; returns the answer or raises ``HarnessError``."""
        with self._lock:
            self._next_id += 1
            request = {"cmd": cmd, "id": self._next_id, **args}
            reply = exchange(self._proc, request, "kubelet harness", self.log_tail, HarnessError)
        if not reply.get("ok"):
            raise HarnessError(str(reply.get("error")), reply.get("code"), reply.get("message"), reply.get("state"))
        return reply

    def resources(self) -> dict[str, Resource]:
        raw = self.call("list")["resources"] or {}
        return {name: Resource.from_json(name, r) for name, r in raw.items()}

    def resource(self, name: str) -> Resource:
        found = self.resources().get(name)
        if found is None:
            raise HarnessError(f"resource {name} is not known to the device manager")
        return found

    def allocate(self, resource: str, count: int, *, pod: str = "pod", namespace: str = "default",
                 pod_uid: str | None = None, container: str = "main") -> Allocation:
        """Admit a container asking for ``count`` devices: the kubelet's allocation path (preferred
        allocation when the plugin offers it, Allocate, PreStartContainer when required)."""
        r = self.call("allocate", resource=resource, count=count, pod=pod, namespace=namespace,
                      pod_uid=pod_uid or f"{namespace}/{pod}", container=container)
        return Allocation(r["pod_uid"], r["container"], tuple(r["device_ids"]), dict(r["envs"]),
                          tuple(r["mounts"]), tuple(r["devices"]), dict(r["annotations"]), tuple(r["cdi_devices"]))

    def release(self, pod_uid: str) -> None:
        """Delete the pod; the manager frees its devices."""
        self.call("release", pod_uid=pod_uid)

    def restart(self) -> None:
        """Kubelet restart: stop, remove every socket in ``plugin_dir``, start again."""
        self.call("restart")

    def wait(self, resource: str, *, device: str | None = None, health: str | None = None,
             total: int | None = None, healthy: int | None = None, registered: bool | None = None,
             timeout: float = 10.0) -> tuple[float, Resource]:
        """Block until the resource matches; returns (time the matching state was seen, state).

        ``device``+``health``: that device reports that health; ``total``: number of devices listed;
        ``healthy``: allocatable count; ``registered``: plugin connected (False also matches "gone").
        """
        args: dict[str, Any] = {"resource": resource, "timeout": timeout}
        for key, value in (("device", device), ("health", health), ("total", total), ("healthy", healthy),
                           ("registered", registered)):
            if value is not None:
                args[key] = value
        r = self.call("wait", **args)
        return float(r["time"]), Resource.from_json(resource, r["state"])

    def updates(self, resource: str | None = None, since: int = 0) -> list[Update]:
        """Every observed state change (after sequence number ``since``)."""
        r = self.call("updates", resource=resource or "", since=since)
        return [Update(u["seq"], float(u["time"]), Resource.from_json(u["resource"], u["state"]))
                for u in r["updates"]]

    def plugin(self, socket: str, method: str, *, devices: list[str] | None = None,
               available: list[str] | None = None, must_include: list[str] | None = None,
               size: int = 0) -> dict[str, Any]:
        """Call one DevicePlugin method directly with explicit arguments (e.g. Allocate of given IDs,
        GetPreferredAllocation); returns the response as JSON (Go field names)."""
        r = self.call("plugin", socket=socket, method=method, devices=devices or [],
                      available=available or [], must_include=must_include or [], size=size)
        response: dict[str, Any] = r["response"] or {}
        return response

    def pod_health(self, pod_uid: str) -> PodHealth:
        """The device manager's ``UpdateAllocatedResourcesStatus`` for the pod (the ResourceHealthStatus
        gate is on): what the kubelet would write as each container's ``allocatedResourcesStatus``."""
        r = self.call("pod_health", pod_uid=pod_uid)
        containers = {c: {res: dict(devs) for res, devs in (by_res or {}).items()}
                      for c, by_res in (r["containers"] or {}).items()}
        return PodHealth(containers, int(r["updates"]))

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.workdir / "harness.log", lines)

    def stop(self) -> None:
        quit_peer(self._proc)


def start_harness(workdir: Path, verbosity: int = 0) -> KubeletHarness:
    binary = peer_binary("NODEAGENT_KUBELET_HARNESS", "nodeagent_peers_harness", "kubelet device-manager harness")
    plugin_dir = workdir / "device-plugins"
    plugin_dir.mkdir(parents=True, exist_ok=True)
    pr_socket = workdir / "pod-resources.sock"
    with (workdir / "harness.log").open("wb") as log:
        proc = subprocess.Popen(
            [str(binary), f"--dir={plugin_dir}", f"--pod-resources-socket={pr_socket}", f"--v={verbosity}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
        )
    harness = KubeletHarness(plugin_dir, pr_socket, workdir, proc)
    try:
        harness.call("list")  # answers once the manager has started
    except BaseException:
        harness.stop()
        raise
    return harness


@contextmanager
def running_harness(workdir: Path | None = None) -> Iterator[KubeletHarness]:
    own = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="nodeagent-kubelet-")) if workdir is None else workdir
    try:
        harness = start_harness(wd)
        try:
            yield harness
        finally:
            harness.stop()
    finally:
        if own:
            shutil.rmtree(wd, ignore_errors=True)
