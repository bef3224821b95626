"""One DevicePlugin gRPC server per resource, on its own Unix socket (mode 0600), answering on the event loop of
the gRPC servers' own thread (grpc.aio's server, set up by ``nodeagent.grpcadapter.server``).

The server holds the current ``Resource`` and per-device health; every change bumps a version and
every open ListAndWatch stream re-sends the full list at once. Allocate answers are kept per requested
device sets until the next change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from nodeagent import fileio
from nodeagent.deviceplugin.allocate import AllocationError, ContainerAllocation, allocate
from nodeagent.deviceplugin.api import pb2 as api_pb2
from nodeagent.deviceplugin.api import pb2_grpc as api_pb2_grpc
from nodeagent.deviceplugin.probe import peer_pid
from nodeagent.errors import InputError, KubeletError
from nodeagent.gpu.topology import best_gpu_set, spread_pick
from nodeagent.grpcadapter.server import (
    INVALID_ARGUMENT,
    AioServicerContext,
    LoopThreadServer,
    RefusalLog,
    StreamSlots,
    arefuse,
)
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
# ListAndWatch streams open at once on one server (each is sent every change of the list; the kubelet keeps
# one).
MAX_LIST_AND_WATCH = 8


class ForeignPluginError(KubeletError):
    """Our socket's name is held by a live socket of another process."""


def foreign_listener(path: Path, timeout_s: float = 1.0) -> int | None:
    """The pid of another process accepting connections on the Unix socket ``path`` (0: one the kernel cannot
    name here, in another pid namespace); None when nobody accepts them (a stale file) or this process does
    (an earlier server of its own, stopping or not: never another plugin). The kernel names the listener
    (``SO_PEERCRED`` of a connection), so no socket of this process is ever taken for a foreign one."""
    pid = peer_pid(path, timeout_s)
    return None if pid == os.getpid() else pid


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


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
            api_pb2.DeviceSpec(
                container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
            )
            for d in alloc.devices
        ],
        cdi_devices=[api_pb2.CDIDevice(name=n) for n in alloc.cdi_devices],
    )


DeviceSets = tuple[tuple[str, ...], ...]  # the device IDs of each container of an AllocateRequest


class _Served:
    """What a server answers from: one resource and its settings, never changed in place (a change brings a
    new one, so the answers kept for the old device list go with it)."""

    __slots__ = ("answers", "flags", "policy", "resource", "scores")

    def __init__(
        self, resource: Resource, flags: PluginFlags, scores: Mapping[tuple[int, int], int], policy: str
    ) -> None:
        self.resource = resource
        self.flags = flags
        self.scores = scores
        self.policy = policy
        self.answers: dict[DeviceSets, Any] = {}  # requested device sets → AllocateResponse (never changed)

    def answer(self, sets: DeviceSets) -> Any:
        """The AllocateResponse for the requested device sets, validated in full; kept for the same sets
        again. Raises ``AllocationError`` (never kept) for anything this resource cannot give."""
        allocs = allocate(self.resource, self.flags, [list(c) for c in sets])
        response = api_pb2.AllocateResponse(container_responses=[_to_proto(a) for a in allocs])
        if len(self.answers) < ALLOCATION_CACHE_SIZE:
            self.answers[sets] = response
        return response


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


class _Servicer:
    """The DevicePlugin methods (registered with the generated ``add_DevicePluginServicer_to_server``). They
    run on the server's own event loop, never on the daemon's: they read only the server's current
    ``_Served`` (replaced whole on a change) and its prebuilt device list. Requests arrive parsed: bytes that
    are no such message were refused before (INVALID_ARGUMENT naming it)."""

    _OPTIONS = api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
    _PRE_START = api_pb2.PreStartContainerResponse()

    def __init__(self, owner: ResourceServer) -> None:
        self._owner = owner

    async def GetDevicePluginOptions(self, request: Any, context: AioServicerContext) -> Any:
        return self._OPTIONS

    async def ListAndWatch(self, request: Any, context: AioServicerContext) -> AsyncIterator[Any]:
        """The device list now and after every change (a cancelled call ends the wait at once)."""
        owner = self._owner
        slot = await owner.watches.ahold(context)  # past MAX_LIST_AND_WATCH: a stuck stream's slot, or refused
        sent = -1
        while True:
            version, message, closing = owner.current()
            if closing:
                return
            if version == sent:
                await owner.next_change()
                continue
            sent = version
            owner.list_sent_at = time.monotonic()
            slot.sending()
            yield message
            slot.sent()

    async def GetPreferredAllocation(self, request: Any, context: AioServicerContext) -> Any:
        served = self._owner.served
        responses = []
        for creq in request.container_requests:
            ids = preferred(
                served.resource,
                list(creq.available_deviceIDs),
                list(creq.must_include_deviceIDs),
                int(creq.allocation_size),
                served.scores,
                served.policy,
            )
            responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request: Any, context: AioServicerContext) -> Any:
        """Device sets already answered since the last change get the kept answer again; any others are
        validated and answered."""
        served = self._owner.served
        sets: DeviceSets = tuple(tuple(c.devices_ids) for c in request.container_requests)
        answer = served.answers.get(sets)
        if answer is not None:
            self._owner.count_allocate(True)
            return answer
        try:
            answer = served.answer(sets)
        except AllocationError as e:
            reason = str(e)
        else:
            self._owner.count_allocate(True)
            return answer
        del request, sets  # not kept with the refusal (grpc.aio holds an aborted call's error for a while)
        self._owner.count_allocate(False)
        self._owner.refusals.refused("allocate", reason)
        await arefuse(context, INVALID_ARGUMENT, reason)

    async def PreStartContainer(self, request: Any, context: AioServicerContext) -> Any:
        return self._PRE_START


class ResourceServer:
    """The DevicePlugin server of one resource.

    Its gRPC server is grpc.aio's on the loop of the gRPC servers' own thread: an Allocate neither waits for
    the daemon's other coroutines nor hops through the daemon's loop (measured: tests/bench/bench_deviceplugin.py),
    and a call waiting for its client holds no thread. The daemon's loop changes what is served
    (``set_resource``, ``health_changed``); the server's loop reads it.
    """

    def __init__(
        self,
        plugin_dir: Path,
        resource: Resource,
        flags: PluginFlags,
        *,
        scores: Mapping[tuple[int, int], int],
        policy: str,
        health_of: Callable[[AdvertisedDevice], bool],
        take_over: bool = False,
        on_allocate: Callable[[str, bool], None] | None = None,
        root: fileio.Root | None = None,
    ) -> None:
        self.plugin_dir = plugin_dir.absolute()
        self._root = root  # the directory is resolved inside it whenever the socket is made or removed
        # told of every Allocate answered (resource, True) or refused (resource, False), from the server's threads
        self._on_allocate = on_allocate
        # a live socket of another process at our socket's name is replaced only when this is set
        self.take_over = take_over
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file this server made
        self.served = _Served(resource, flags, scores, policy)
        self._health_of = health_of
        self.version = 0
        self.closing = False
        self._lock = threading.Lock()  # guards version, device_list and closing
        self._wakeup: asyncio.Event | None = None  # on the server's loop: set (and dropped) at a change
        self.refusals = RefusalLog(log)
        self.watches = StreamSlots(MAX_LIST_AND_WATCH, "ListAndWatch", self.refusals)
        self._server: LoopThreadServer | None = None
        self._published = self._visible()  # what device_list shows
        self.device_list: Any = self._build_list(self._published)  # a ListAndWatchResponse, never changed
        self.list_sent_at: float = 0.0

    def count_allocate(self, ok: bool) -> None:
        if self._on_allocate is not None:
            self._on_allocate(self.served.resource.name, ok)

    @property
    def resource(self) -> Resource:
        return self.served.resource

    @property
    def flags(self) -> PluginFlags:
        return self.served.flags

    @property
    def name(self) -> str:
        return self.resource.name

    @property
    def endpoint(self) -> str:
        return socket_name(self.resource.name)

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / self.endpoint

    def _visible(self) -> tuple[tuple[str, str, int | None], ...]:
        """What the kubelet sees of each device: ID, health, NUMA node."""
        return tuple(
            (d.id, HEALTHY if self._health_of(d) else UNHEALTHY, d.numa_node) for d in self.resource.devices
        )

    @staticmethod
    def _build_list(visible: tuple[tuple[str, str, int | None], ...]) -> Any:
        devices = []
        for dev_id, health, numa in visible:
            topo = api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=numa)]) if numa is not None else None
            devices.append(api_pb2.Device(ID=dev_id, health=health, topology=topo))
        return api_pb2.ListAndWatchResponse(devices=devices)

    def current(self) -> tuple[int, Any, bool]:
        """The list's version, the list and whether the server is closing (from any thread)."""
        with self._lock:
            return self.version, self.device_list, self.closing

    async def next_change(self) -> None:
        """Wait (on the server's loop) for the next ``_wake_streams``."""
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        await self._wakeup.wait()

    def _wake_streams(self) -> None:
        """Wake every waiting ListAndWatch stream (on the server's loop; each then reads ``current``)."""
        event, self._wakeup = self._wakeup, None
        if event is not None:
            event.set()

    def _changed(self) -> None:
        server = self._server
        if server is not None:
            server.call_soon(self._wake_streams)

    def _publish(self) -> bool:
        """Rebuild the device list and wake every stream to re-send it, if what the kubelet sees changed
        since the list was last built (on the daemon's loop; the streams only read the built list)."""
        visible = self._visible()
        if visible == self._published:
            return False
        device_list = self._build_list(visible)
        with self._lock:
            self._published, self.device_list = visible, device_list
            self.version += 1
        self._changed()
        return True

    async def set_resource(
        self, resource: Resource, flags: PluginFlags, scores: Mapping[tuple[int, int], int], policy: str
    ) -> bool:
        """Swap in a new device list / settings (the kept Allocate answers go with the old ones); re-sends
        the list if anything visible changed."""
        self.served = _Served(resource, flags, scores, policy)
        return self._publish()

    async def health_changed(self) -> bool:
        """Re-send the list if any device's health flipped."""
        return self._publish()

    def _socket_now(self) -> Path:
        """The socket's path with its directory resolved inside the root now."""
        directory = self.plugin_dir if self._root is None else self._root.within(self.plugin_dir)
        return directory / self.endpoint

    async def start(self) -> None:
        """Serve on the socket path. A live socket of another process there is left alone (``ForeignPluginError``)
        unless ``take_over``; one of this process (this server's last, or any server of the agent's) is
        replaced. Cancelling the caller never leaves a server running unknown to this object: a start under way
        in the servers' thread is waited for and kept (``stop`` ends it)."""
        fileio.makedirs(self.plugin_dir, root=self._root)
        path = self._socket_now()
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise InputError(
                f"device-plugin socket path {path} is {len(os.fsencode(path))} bytes, more than a Unix "
                f"socket allows ({MAX_SOCKET_PATH}); use a shorter --root or --kubelet-dir",
                subject=str(path),
            )
        if self._server is not None:  # already serving: a new start replaces it
            await self.stop()
        if path.is_dir() and not path.is_symlink():
            raise KubeletError(
                f"cannot serve {self.name}: {path} is a directory, not a socket; remove it", subject=str(path)
            )
        if path.is_socket() and not self.take_over:
            pid = await asyncio.to_thread(foreign_listener, path)
            if pid is not None:
                # Another device plugin (NVIDIA's uses the same name) serves here: replacing its socket would
                # make the kubelet flip between the two. Left alone until it is gone (or take_over is set).
                who = f"process {pid}" if pid else "a process of another pid namespace"
                raise ForeignPluginError(
                    f"{path} is served by another process ({who}; another device plugin?): nodeagent does not "
                    f"replace it and does not register {self.name} until it is gone; stop that plugin, or set "
                    "[adopt] take_over = true",
                    subject=str(path),
                )
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise KubeletError(
                f"cannot serve {self.name}: cannot remove {path}: {e.strerror}", subject=str(path)
            ) from e
        with self._lock:
            self.closing = False
        self._publish()
        server = LoopThreadServer(
            path,
            [(api_pb2_grpc.add_DevicePluginServicer_to_server, _Servicer(self))],
            refusals=self.refusals,
        )
        # The start runs on in its thread whatever happens to this coroutine: shielded, and when this one is
        # cancelled (a kubelet restart while serving again after the last one) the server it brings up is
        # still recorded here, so that the caller's ``stop`` ends it and its socket is known as ours.
        starting = asyncio.ensure_future(asyncio.to_thread(server.start))
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            while not starting.done():  # a second cancel must not leave it unknown either
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(starting)
            if starting.exception() is None:
                self._started(server)
            raise
        except OSError as e:
            raise KubeletError(
                f"cannot serve {self.name} on {path}: {e.strerror or e}", subject=str(path)
            ) from e
        self._started(server)
        log.info("serving %s on %s (%d devices)", self.name, path, len(self.resource.devices))

    def _started(self, server: LoopThreadServer) -> None:
        self._server = server
        self._socket_id = server.socket_id

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        with self._lock:
            self.closing = True
        server.call_soon(self._wake_streams)
        await asyncio.to_thread(server.stop, STOP_GRACE_S)
        path = self._socket_now()
        mine, self._socket_id = self._socket_id, None
        # only the socket file this server made: another plugin that replaced it meanwhile (NVIDIA's removes
        # the file at its socket name when it starts) keeps its own
        if mine is not None and _file_id(path) == mine:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        elif path.exists():
            log.warning("%s: left in place, it is not the socket nodeagent made (another device plugin's?)", path)
        log.info("stopped serving %s", self.name)

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    @property
    def running(self) -> bool:
        return self._server is not None
