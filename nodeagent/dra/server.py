"""The kubelet-facing sockets of the DRA driver (Unix sockets, mode 0600, served by grpc.aio on the daemon's
event loop, set up by ``nodeagent.grpcadapter.server``).

- ``<kubelet>/plugins/<driver>/dra.sock``: ``v1.DRAPlugin``, ``v1beta1.DRAPlugin`` and
  ``v1alpha1.DRAResourceHealth``;
- ``<kubelet>/plugins_registry/<driver>-reg.sock``: the registration service the kubelet's plugin
  watcher finds; ``GetInfo`` names the DRA socket, ``NotifyRegistrationStatus`` tells the outcome.

The methods are coroutines on the daemon's event loop (they share the preparer, the health feed and the
component's state with it), which is where grpc.aio runs them. The DRA socket starts first so the kubelet
can dial it as soon as it learns about it; stopping removes the registration socket first (the kubelet then
deregisters the driver) and both sockets at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from nodeagent.deadline import within
from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.api import (
    health_pb2,
    health_pb2_grpc,
    reg_pb2,
    reg_pb2_grpc,
    v1_pb2,
    v1_pb2_grpc,
    v1beta1_pb2,
    v1beta1_pb2_grpc,
)
from nodeagent.dra.health import HealthFeed
from nodeagent.dra.service import ClaimPreparer, ClaimRef
from nodeagent.fileio import Root, makedirs
from nodeagent.grpcadapter.server import (
    DEADLINE_EXCEEDED,
    AioServer,
    AioServicerContext,
    RefusalLog,
    Servicers,
    StreamSlots,
    arefuse,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

PLUGIN_TYPE = "DRAPlugin"
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
STOP_GRACE_S = 0.2
MAX_SOCKET_PATH = 107
# The longest a call may take on the loop (a prepare reads the claim from the API, writes the CDI spec and
# the fsynced checkpoint, and for dynamic MIG creates the instance: milliseconds when all is well).
CALL_TIMEOUT_S = 60.0
# Health watches open at once on the DRA socket (the kubelet keeps one).
MAX_WATCHES = 8


def registration_socket(kubelet_dir: Path, driver: str = DRIVER_NAME) -> Path:
    return kubelet_dir / "plugins_registry" / f"{driver}-reg.sock"


def dra_socket(kubelet_dir: Path, driver: str = DRIVER_NAME) -> Path:
    return kubelet_dir / "plugins" / driver / "dra.sock"


async def _in_time(work: Awaitable[T], context: AioServicerContext) -> T:
    """``work`` awaited for at most ``CALL_TIMEOUT_S``; past it, cancelled and the call DEADLINE_EXCEEDED."""
    try:
        return await within(work, CALL_TIMEOUT_S)
    except TimeoutError:
        await arefuse(context, DEADLINE_EXCEEDED, f"no answer within {CALL_TIMEOUT_S:g} s")


class _DraServicer:
    """One implementation for both DRAPlugin versions: ``pb2`` picks the message module."""

    def __init__(
        self,
        preparer: ClaimPreparer,
        pb2: Any,
        on_claims_changed: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.preparer = preparer
        self.pb2 = pb2
        self.on_claims_changed = on_claims_changed

    @staticmethod
    def _refs(request: Any) -> list[ClaimRef]:
        return [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]

    async def NodePrepareResources(self, request: Any, context: AioServicerContext) -> Any:
        return await _in_time(self._prepare(request), context)

    async def _prepare(self, request: Any) -> Any:
        results = await self.preparer.prepare(self._refs(request))
        if self.on_claims_changed is not None:
            await self.on_claims_changed()
        resp = self.pb2.NodePrepareResourcesResponse()
        for uid, r in results.items():
            one = resp.claims[uid]
            if r.error:
                one.error = r.error
                continue
            for d in r.devices:
                dev = self.pb2.Device(
                    request_names=list(d.request_names),
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=list(d.cdi_device_ids),
                )
                if d.share_id is not None and self.pb2 is v1_pb2:  # v1beta1 has no share_id
                    dev.share_id = d.share_id
                one.devices.append(dev)
        return resp

    async def NodeUnprepareResources(self, request: Any, context: AioServicerContext) -> Any:
        return await _in_time(self._unprepare(request), context)

    async def _unprepare(self, request: Any) -> Any:
        results = await self.preparer.unprepare(self._refs(request))
        if self.on_claims_changed is not None:
            await self.on_claims_changed()
        resp = self.pb2.NodeUnprepareResourcesResponse()
        for uid, err in results.items():
            resp.claims[uid].error = err
        return resp


class _HealthServicer:
    def __init__(self, feed: HealthFeed, pool: str, watches: StreamSlots) -> None:
        self.feed = feed
        self.pool = pool
        self.watches = watches

    async def NodeWatchResources(self, request: Any, context: AioServicerContext) -> AsyncIterator[Any]:
        slot = await self.watches.ahold(context)  # past MAX_WATCHES: a stuck stream's slot, or refused
        async with contextlib.aclosing(self.feed.watch()) as snaps:  # closed on the loop when the call ends
            async for snap in snaps:
                answer = health_pb2.NodeWatchResourcesResponse(
                    devices=[
                        health_pb2.DeviceHealth(
                            device=health_pb2.DeviceIdentifier(pool_name=self.pool, device_name=s.name),
                            health=s.health,
                            last_updated_time=s.since,
                        )
                        for s in snap
                    ]
                )
                slot.sending()
                yield answer
                slot.sent()


class _RegistrationServicer:
    def __init__(self, owner: DraServer) -> None:
        self.owner = owner

    async def GetInfo(self, request: Any, context: AioServicerContext) -> Any:
        return reg_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.owner.driver,
            endpoint=str(self.owner.endpoint),
            supported_versions=list(SERVICES),
        )

    async def NotifyRegistrationStatus(self, request: Any, context: AioServicerContext) -> Any:
        self.owner.registered = bool(request.plugin_registered)
        self.owner.registration_error = str(request.error)
        if request.plugin_registered:
            log.info("kubelet registered DRA driver %s", self.owner.driver)
        else:
            log.error("kubelet refused DRA driver %s: %s", self.owner.driver, request.error)
        self.owner.registration_changed.set()
        if request.plugin_registered and self.owner.on_registered is not None:
            self.owner.on_registered()
        return reg_pb2.RegistrationStatusResponse()


def _check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(f"socket path too long for a Unix socket ({len(os.fsencode(path))} bytes): {path}")


async def _serve(path: Path, servicers: Servicers, refusals: RefusalLog, root: Root | None = None) -> AioServer:
    # the directory is resolved (inside the root) and made at the moment the socket is bound
    path = makedirs(path.parent, root=root) / path.name
    _check_socket_path(path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a socket left by a previous process
    server = AioServer(path, servicers, refusals=refusals)
    await server.start()
    return server


class DraServer:
    def __init__(
        self,
        kubelet_dir: Path,
        preparer: ClaimPreparer,
        feed: HealthFeed,
        *,
        driver: str = DRIVER_NAME,
        on_registered: Callable[[], None] | None = None,
        kubelet_host_dir: Path | None = None,
        on_claims_changed: Callable[[], Awaitable[None]] | None = None,
        root: Root | None = None,
    ) -> None:
        self.driver = driver
        self.root = root  # the sockets' directories are resolved inside it as they are bound and removed
        self.on_registered = on_registered  # called on every successful (re-)registration
        self.on_claims_changed = on_claims_changed  # awaited after every prepare and unprepare
        self.reg_path = registration_socket(kubelet_dir, driver)
        self.dra_path = dra_socket(kubelet_dir, driver)
        # what the kubelet dials: the socket's path on the host (``kubelet_dir`` may be the host's directory
        # seen from a container, under --root)
        self.endpoint = (
            dra_socket(kubelet_host_dir, driver) if kubelet_host_dir is not None else self.dra_path
        )
        self.preparer = preparer
        self.feed = feed
        self.registered = False
        self.registration_error = ""
        self.registration_changed = asyncio.Event()
        self.refusals = preparer.refusals  # one bound for every refusal of the driver's sockets
        self.watches = StreamSlots(MAX_WATCHES, "NodeWatchResources", self.refusals)
        self._dra: AioServer | None = None
        self._reg: AioServer | None = None

    async def start(self) -> None:
        dra: Servicers = [
            (
                v1_pb2_grpc.add_DRAPluginServicer_to_server,
                _DraServicer(self.preparer, v1_pb2, self.on_claims_changed),
            ),
            (
                v1beta1_pb2_grpc.add_DRAPluginServicer_to_server,
                _DraServicer(self.preparer, v1beta1_pb2, self.on_claims_changed),
            ),
            (
                health_pb2_grpc.add_DRAResourceHealthServicer_to_server,
                _HealthServicer(self.feed, self.preparer.pool, self.watches),
            ),
        ]
        reg: Servicers = [(reg_pb2_grpc.add_RegistrationServicer_to_server, _RegistrationServicer(self))]
        self._dra = await _serve(self.dra_path, dra, self.refusals, self.root)
        try:
            self._reg = await _serve(self.reg_path, reg, self.refusals, self.root)
        except BaseException:
            await self._stop_one(self._dra, self.dra_path)
            self._dra = None
            raise
        log.info("DRA driver %s serving on %s (registration %s)", self.driver, self.dra_path, self.reg_path)

    async def _stop_one(self, server: AioServer | None, path: Path) -> None:
        if server is not None:
            await server.stop(STOP_GRACE_S)
        with contextlib.suppress(FileNotFoundError):
            (path if self.root is None else self.root.within(path.parent) / path.name).unlink()

    async def stop(self) -> None:
        await self._stop_one(self._reg, self.reg_path)
        self._reg = None
        await self._stop_one(self._dra, self.dra_path)
        self._dra = None
        self.registered = False
