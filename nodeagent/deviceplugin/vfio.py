"""The device plugin of GPUs bound to a VFIO driver (the workload config ``vm-passthrough``): one DevicePlugin
server per resource named as NVIDIA's sandbox device plugin names it (``vfio.names``), the GPUs' bus ids as
device IDs, Allocate answered as that plugin answers (``vfio.allocate``: ``/dev/vfio/vfio``, the IOMMU
groups' devices, ``PCI_RESOURCE_NVIDIA_COM_<NAME>``). The list is fixed while the node stays in
vm-passthrough: a switch stops the servers (back to container) or starts them anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from nodeagent import fileio
from nodeagent.deviceplugin.api import pb2 as api_pb2
from nodeagent.deviceplugin.api import pb2_grpc as api_pb2_grpc
from nodeagent.deviceplugin.registrar import register
from nodeagent.deviceplugin.server import STOP_GRACE_S, socket_name
from nodeagent.errors import InputError, KubeletError
from nodeagent.grpcadapter.server import (
    INVALID_ARGUMENT,
    AioServicerContext,
    LoopThreadServer,
    RefusalLog,
    arefuse,
)
from nodeagent.vfio.allocate import VfioDevice, vfio_allocation

log = logging.getLogger(__name__)

HEALTHY = "Healthy"


class _VfioServicer:
    _OPTIONS = api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    def __init__(self, owner: VfioResourceServer) -> None:
        self._owner = owner

    async def GetDevicePluginOptions(self, request: Any, context: AioServicerContext) -> Any:
        return self._OPTIONS

    async def ListAndWatch(self, request: Any, context: AioServicerContext) -> AsyncIterator[Any]:
        """The list once; it never changes while this server runs (the call ends when the server stops)."""
        yield self._owner.device_list
        await asyncio.Event().wait()

    async def GetPreferredAllocation(self, request: Any, context: AioServicerContext) -> Any:
        return api_pb2.PreferredAllocationResponse()

    async def Allocate(self, request: Any, context: AioServicerContext) -> Any:
        owner = self._owner
        try:
            answers = [vfio_allocation(owner.resource, owner.devices, list(c.devices_ids), iommufd=owner.iommufd)
                       for c in request.container_requests]
        except InputError as e:
            reason = str(e)
        else:
            return api_pb2.AllocateResponse(container_responses=[
                api_pb2.ContainerAllocateResponse(
                    envs=a.envs,
                    devices=[api_pb2.DeviceSpec(container_path=c, host_path=h, permissions="rw") for c, h in a.devices])
                for a in answers])
        owner.refusals.refused("allocate", reason)
        await arefuse(context, INVALID_ARGUMENT, reason)

    async def PreStartContainer(self, request: Any, context: AioServicerContext) -> Any:
        return api_pb2.PreStartContainerResponse()


class VfioResourceServer:
    """One VFIO resource on its own socket in the kubelet's device-plugin directory."""

    def __init__(self, plugin_dir: Path, resource: str, devices: Mapping[str, VfioDevice], *,
                 iommufd: bool = False, root: fileio.Root | None = None) -> None:
        self.plugin_dir = plugin_dir.absolute()
        self.resource = resource
        self.devices = dict(devices)
        self.iommufd = iommufd
        self._root = root
        self.refusals = RefusalLog(log)
        self.device_list = api_pb2.ListAndWatchResponse(devices=[
            api_pb2.Device(ID=bdf, health=HEALTHY,
                           topology=None if d.numa is None or d.numa < 0
                           else api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=d.numa)]))
            for bdf, d in sorted(self.devices.items())])
        self._server: LoopThreadServer | None = None

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / socket_name(self.resource)

    async def start(self) -> None:
        fileio.makedirs(self.plugin_dir, root=self._root)
        path = self.socket_path
        path.unlink(missing_ok=True)
        server = LoopThreadServer(path, [(api_pb2_grpc.add_DevicePluginServicer_to_server, _VfioServicer(self))],
                                  refusals=self.refusals)
        try:
            await asyncio.to_thread(server.start)
        except OSError as e:
            raise KubeletError(f"cannot serve {self.resource} on {path}: {e.strerror or e}", subject=str(path)) from e
        self._server = server
        await register(self.plugin_dir, self.resource, path.name)
        log.info("serving %s on %s (%d VFIO devices)", self.resource, path, len(self.devices))

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.stop, STOP_GRACE_S)
            with contextlib.suppress(OSError):
                self.socket_path.unlink(missing_ok=True)


class VfioDevicePlugin:
    """The VFIO resources of the node: ``serve`` replaces whatever was served by the given groups."""

    def __init__(self, plugin_dir: Path, *, iommufd: bool = False, root: fileio.Root | None = None) -> None:
        self.plugin_dir = plugin_dir
        self.iommufd = iommufd
        self.root = root
        self.servers: dict[str, VfioResourceServer] = {}

    async def serve(self, resources: Mapping[str, Mapping[str, VfioDevice]]) -> None:
        await self.stop()
        for name, devices in sorted(resources.items()):
            server = VfioResourceServer(self.plugin_dir, name, devices, iommufd=self.iommufd, root=self.root)
            self.servers[name] = server
            await server.start()

    async def stop(self) -> None:
        servers, self.servers = self.servers, {}
        for server in servers.values():
            await server.stop()

    @property
    def served(self) -> dict[str, list[str]]:
        return {name: sorted(s.devices) for name, s in self.servers.items()}
