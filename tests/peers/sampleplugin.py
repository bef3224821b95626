"""A minimal device plugin in Python for exercising the kubelet harness (not nodeagent's plugin).

It speaks the v1beta1 protocol with the project's generated code (nodeagent.deviceplugin.api).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from nodeagent.deviceplugin.api import pb2, pb2_grpc


@dataclass
class SampleDevicePlugin:
    """Serves ``resource`` with ``devices`` (id -> health) on ``plugin_dir/socket_name``."""

    plugin_dir: Path
    resource: str
    devices: dict[str, str]
    socket_name: str = "test-plugin.sock"
    preferred: list[str] | None = None  # answer of GetPreferredAllocation (None: option off)
    pre_start_required: bool = False
    fail_allocate: tuple[grpc.StatusCode, str] | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    _server: Any = None
    _updates: queue.Queue[dict[str, str] | None] = field(default_factory=queue.Queue)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def socket(self) -> Path:
        return self.plugin_dir / self.socket_name

    # --- DevicePlugin service ----------------------------------------------------------------------
    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb2.DevicePluginOptions(pre_start_required=self.pre_start_required,
                                       get_preferred_allocation_available=self.preferred is not None)

    def _list(self, devices: dict[str, str]) -> Any:
        return pb2.ListAndWatchResponse(devices=[
            pb2.Device(ID=i, health=h, topology=pb2.TopologyInfo(nodes=[pb2.NUMANode(ID=0)]))
            for i, h in sorted(devices.items())
        ])

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        with self._lock:
            current = dict(self.devices)
        yield self._list(current)
        while context.is_active():
            try:
                devices = self._updates.get(timeout=0.1)
            except queue.Empty:
                continue
            if devices is None:
                return
            yield self._list(devices)

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        req = request.container_requests[0]
        self.calls.append(("GetPreferredAllocation", (list(req.available_deviceIDs), req.allocation_size)))
        chosen = [d for d in self.preferred or [] if d in req.available_deviceIDs][: req.allocation_size]
        return pb2.PreferredAllocationResponse(
            container_responses=[pb2.ContainerPreferredAllocationResponse(deviceIDs=chosen)])

    def Allocate(self, request: Any, context: Any) -> Any:
        ids = sorted(request.container_requests[0].devices_ids)
        self.calls.append(("Allocate", ids))
        if self.fail_allocate is not None:
            context.abort(*self.fail_allocate)
        resp = pb2.ContainerAllocateResponse(
            envs={"TEST_DEVICES": ",".join(ids)},
            mounts=[pb2.Mount(container_path="/opt/test", host_path="/tmp", read_only=True)],
            devices=[pb2.DeviceSpec(container_path=f"/dev/test{i}", host_path="/dev/null", permissions="rw")
                     for i in range(len(ids))],
            annotations={"example.com/devices": ",".join(ids)},
            cdi_devices=[pb2.CDIDevice(name=f"example.com/dongle={i}") for i in ids],
        )
        return pb2.AllocateResponse(container_responses=[resp])

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        self.calls.append(("PreStartContainer", sorted(request.devices_ids)))
        return pb2.PreStartContainerResponse()

    # --- control ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.socket.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb2_grpc.add_DevicePluginServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def register(self) -> None:
        with grpc.insecure_channel(f"unix://{self.plugin_dir / 'kubelet.sock'}") as channel:
            pb2_grpc.RegistrationStub(channel).Register(pb2.RegisterRequest(
                version="v1beta1", endpoint=self.socket_name, resource_name=self.resource,
                options=self.GetDevicePluginOptions(None, None)), timeout=10)

    def set_health(self, device: str, health: str) -> None:
        with self._lock:
            self.devices[device] = health
            self._updates.put(dict(self.devices))

    def stop(self) -> None:
        self._updates.put(None)
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None
