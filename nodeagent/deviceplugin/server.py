"""One grpc.aio DevicePlugin server per resource, on its own Unix socket (mode 0600).

The server holds the current ``Resource`` and per-device health; every change bumps a version and
every open ListAndWatch stream re-sends the full list at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from nodeagent.deviceplugin.allocate import AllocationError, ContainerAllocation, allocate
from nodeagent.deviceplugin.api import pb2 as api_pb2
from nodeagent.deviceplugin.api import pb2_grpc as api_pb2_grpc
from nodeagent.errors import InputError, KubeletError
from nodeagent.gpu.topology import best_gpu_set, spread_pick
from nodeagent.sharing.devices import AdvertisedDevice, Resource
from nodeagent.sharing.spec import PluginFlags

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
STOP_GRACE_S = 0.2
MAX_SOCKET_PATH = 107  # bytes of sun_path (108) less the terminating NUL
# Allocate answers are a pure function of the device list and settings: the answers given since the last
# change are kept (the kubelet asks for the same few sets again and again), up to this many.
ALLOCATION_CACHE_SIZE = 1024


def socket_name(resource_name: str) -> str:
    """``nvidia.com/mig-1g.10gb`` → ``nvidia-mig-1g.10gb.sock``; another domain keeps its domain:
    ``example.com/gpu`` → ``nvidia--example.com_gpu.sock``.

    Distinct valid resource names get distinct sockets: a name under nvidia.com cannot begin with ``-``, and
    a domain cannot contain ``_``. Anything unsafe in a file name becomes ``-``.
    """
    domain, _, short = resource_name.rpartition("/")
    name = short if domain in ("", "nvidia.com") else f"-{domain}_{short}"
    return "nvidia-" + re.sub(r"[^A-Za-z0-9._-]", "-", name) + ".sock"


def _to_proto(alloc: ContainerAllocation) -> Any:
    return api_pb2.ContainerAllocateResponse(
        envs=alloc.envs,
        annotations=alloc.annotations,
        mounts=[
            api_pb2.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in alloc.mounts
        ],
        devices=[
            api_pb2.DeviceSpec(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
            for d in alloc.devices
        ],
        cdi_devices=[api_pb2.CDIDevice(name=n) for n in alloc.cdi_devices],
    )


def preferred(
    resource: Resource,
    available: list[str],
    must_include: list[str],
    size: int,
    scores: Mapping[tuple[int, int], int],
    policy: str,
) -> list[str]:
    """The preferred device IDs for one container (pure; used by the servicer and the bench)."""
    known = resource.by_id()
    avail = [i for i in available if i in known]
    must = [i for i in must_include if i in known]
    if size <= 0:
        return []
    whole_gpus = all(d.physical.mig is None and d.replica is None for d in resource.devices)
    if whole_gpus:
        by_index = {known[i].physical.gpu_index: i for i in [*avail, *must]}
        picked = best_gpu_set(
            dict(scores),
            [known[i].physical.gpu_index for i in avail],
            [known[i].physical.gpu_index for i in must],
            size,
        )
        return [by_index[g] for g in picked]

    def group(dev_id: str) -> str:
        d = known[dev_id]
        # Replicas spread over their physical device; unshared MIG devices over their parent GPU.
        return d.physical.uuid if d.replica is not None else d.physical.gpu.uuid

    free = set(avail) | set(must)
    used: dict[str, int] = {}
    for d in resource.devices:
        if d.id not in free:
            used[group(d.id)] = used.get(group(d.id), 0) + 1
    return spread_pick(avail, must, size, group, used, policy)


class _Servicer(api_pb2_grpc.DevicePluginServicer):  # type: ignore[misc]
    def __init__(self, owner: ResourceServer) -> None:
        self._owner = owner

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        owner = self._owner
        sent = -1
        while not owner.closing:
            if owner.version != sent:
                sent = owner.version
                yield owner.list_response()
                continue
            await owner.wait_change(sent)

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        owner = self._owner
        responses = []
        for creq in request.container_requests:
            ids = preferred(
                owner.resource,
                list(creq.available_deviceIDs),
                list(creq.must_include_deviceIDs),
                int(creq.allocation_size),
                owner.scores,
                owner.policy,
            )
            responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request: Any, context: Any) -> Any:
        owner = self._owner
        key = tuple(tuple(c.devices_ids) for c in request.container_requests)
        cached = owner.allocations.get(key)
        if cached is not None:
            return cached
        try:
            allocs = allocate(owner.resource, owner.flags, [list(ids) for ids in key])
        except AllocationError as e:
            log.warning("allocate refused: %s", e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        response = api_pb2.AllocateResponse(container_responses=[_to_proto(a) for a in allocs])
        if len(owner.allocations) < ALLOCATION_CACHE_SIZE:
            owner.allocations[key] = response
        return response

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        return api_pb2.PreStartContainerResponse()


class ResourceServer:
    """The DevicePlugin server of one resource."""

    def __init__(
        self,
        plugin_dir: Path,
        resource: Resource,
        flags: PluginFlags,
        *,
        scores: Mapping[tuple[int, int], int],
        policy: str,
        health_of: Callable[[AdvertisedDevice], bool],
    ) -> None:
        self.plugin_dir = plugin_dir.absolute()  # gRPC needs unix:///abs/path
        self.resource = resource
        self.flags = flags
        self.scores = scores
        self.policy = policy
        self._health_of = health_of
        self.version = 0
        self.closing = False
        self._changed = asyncio.Condition()
        self._server: Any = None
        self._last_list: tuple[tuple[str, str], ...] = ()
        self.list_sent_at: float = 0.0
        self.allocations: dict[tuple[tuple[str, ...], ...], Any] = {}  # request → AllocateResponse

    @property
    def name(self) -> str:
        return self.resource.name

    @property
    def endpoint(self) -> str:
        return socket_name(self.resource.name)

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / self.endpoint

    def _health_snapshot(self) -> tuple[tuple[str, str], ...]:
        return tuple((d.id, HEALTHY if self._health_of(d) else UNHEALTHY) for d in self.resource.devices)

    def list_response(self) -> Any:
        self.list_sent_at = time.monotonic()
        health = dict(self._health_snapshot())
        devices = []
        for d in self.resource.devices:
            topo = (
                api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=d.numa_node)]) if d.numa_node is not None else None
            )
            devices.append(api_pb2.Device(ID=d.id, health=health[d.id], topology=topo))
        return api_pb2.ListAndWatchResponse(devices=devices)

    async def wait_change(self, seen: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.version != seen or self.closing)

    async def _bump(self) -> None:
        async with self._changed:
            self.version += 1
            self._changed.notify_all()

    async def set_resource(
        self, resource: Resource, flags: PluginFlags, scores: Mapping[tuple[int, int], int], policy: str
    ) -> bool:
        """Swap in a new device list / settings; re-sends the list if anything visible changed."""
        before = self._visible()
        self.resource, self.flags, self.scores, self.policy = resource, flags, scores, policy
        self.allocations = {}
        self._last_list = self._health_snapshot()
        if before != self._visible():
            await self._bump()
            return True
        return False

    def _visible(self) -> tuple[tuple[str, str, int | None], ...]:
        return tuple(
            (d.id, HEALTHY if self._health_of(d) else UNHEALTHY, d.numa_node) for d in self.resource.devices
        )

    async def health_changed(self) -> bool:
        """Re-send the list if any device's health flipped."""
        snap = self._health_snapshot()
        if snap != self._last_list:
            self._last_list = snap
            await self._bump()
            return True
        return False

    async def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        path = self.socket_path
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise InputError(
                f"device-plugin socket path {path} is {len(os.fsencode(path))} bytes, more than a Unix socket "
                f"allows ({MAX_SOCKET_PATH}); use a shorter --root or --kubelet-dir",
                subject=str(path),
            )
        if path.is_dir() and not path.is_symlink():
            raise KubeletError(
                f"cannot serve {self.name}: {path} is a directory, not a socket; remove it", subject=str(path)
            )
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise KubeletError(f"cannot serve {self.name}: cannot remove {path}: {e.strerror}",
                               subject=str(path)) from e
        self.closing = False
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        api_pb2_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
        try:
            server.add_insecure_port(f"unix://{path}")
        except RuntimeError as e:
            raise KubeletError(f"cannot serve {self.name} on {path}: {e}", subject=str(path)) from e
        await server.start()
        os.chmod(path, 0o600)
        self._server = server
        self._last_list = self._health_snapshot()
        log.info("serving %s on %s (%d devices)", self.name, path, len(self.resource.devices))

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        async with self._changed:
            self.closing = True
            self._changed.notify_all()
        await server.stop(STOP_GRACE_S)
        path = self.socket_path
        if path.is_socket():  # only our own socket: whatever else took the path stays (start refuses it)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        log.info("stopped serving %s", self.name)

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    @property
    def running(self) -> bool:
        return self._server is not None
