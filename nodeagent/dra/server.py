"""The kubelet-facing sockets of the DRA driver (Unix sockets, mode 0600, served by ``nodeagent.wire``).

- ``<kubelet>/plugins/<driver>/dra.sock``: ``v1.DRAPlugin``, ``v1beta1.DRAPlugin`` and
  ``v1alpha1.DRAResourceHealth``;
- ``<kubelet>/plugins_registry/<driver>-reg.sock``: the registration service the kubelet's plugin
  watcher finds; ``GetInfo`` names the DRA socket, ``NotifyRegistrationStatus`` tells the outcome.

The methods are coroutines on the daemon's event loop (they share the preparer, the health feed and the
component's state with it); the socket server's threads hand each call to the loop and wait for its answer.
The DRA socket starts first so the kubelet can dial it as soon as it learns about it; stopping removes
the registration socket first (the kubelet then deregisters the driver) and both sockets at the end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.api import health_pb2, reg_pb2, v1_pb2, v1beta1_pb2
from nodeagent.dra.health import HealthFeed
from nodeagent.dra.service import ClaimPreparer, ClaimRef
from nodeagent.wire import server as wire

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
STOP_GRACE_S = 0.2
MAX_SOCKET_PATH = 107
# The longest a call may take on the loop (a prepare reads the claim from the API, writes the CDI spec and
# the fsynced checkpoint, and for dynamic MIG creates the instance: milliseconds when all is well).
CALL_TIMEOUT_S = 60.0


def registration_socket(kubelet_dir: Path, driver: str = DRIVER_NAME) -> Path:
    return kubelet_dir / "plugins_registry" / f"{driver}-reg.sock"


def dra_socket(kubelet_dir: Path, driver: str = DRIVER_NAME) -> Path:
    return kubelet_dir / "plugins" / driver / "dra.sock"


def _path(pb2: Any, service: str, method: str) -> str:
    """The HTTP/2 path of a method: ``/<proto package>.<service>/<method>``, from the generated module."""
    return f"/{pb2.DESCRIPTOR.services_by_name[service].full_name}/{method}"


class _OnLoop:
    """Turns the coroutine methods into what the socket server calls from its threads."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def unary(self, method: Callable[[bytes], Awaitable[bytes]]) -> wire.UnaryMethod:
        def call(request: bytes) -> bytes:
            fut = asyncio.run_coroutine_threadsafe(_awaited(method(request)), self.loop)
            try:
                return fut.result(CALL_TIMEOUT_S)
            except concurrent.futures.TimeoutError as e:
                fut.cancel()
                raise wire.RpcError(wire.DEADLINE_EXCEEDED, f"no answer within {CALL_TIMEOUT_S:g} s") from e

        return call

    def stream(self, method: Callable[[bytes], AsyncGenerator[bytes, None]]) -> wire.StreamMethod:
        def call(request: bytes, stream: wire.ServerStream) -> Iterator[bytes]:
            items = method(request)
            waiting: list[concurrent.futures.Future[bytes]] = []

            def stop_waiting() -> None:  # the call ended (cancelled, connection gone, server stopping)
                for f in waiting:
                    f.cancel()

            stream.add_callback(stop_waiting)
            try:
                while stream.is_active():
                    fut = asyncio.run_coroutine_threadsafe(_next(items), self.loop)
                    waiting[:] = [fut]
                    if not stream.is_active():
                        fut.cancel()
                    try:
                        yield fut.result()
                    except (concurrent.futures.CancelledError, StopAsyncIteration):
                        return
            finally:  # the generator is closed on its loop (unless the loop itself is gone by now)
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(_aclose(items), self.loop).result(5)

        return call


async def _awaited(result: Awaitable[bytes]) -> bytes:
    return await result


async def _next(items: AsyncGenerator[bytes, None]) -> bytes:
    return await anext(items)


async def _aclose(items: AsyncGenerator[bytes, None]) -> None:
    await items.aclose()


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

    async def NodePrepareResources(self, request: bytes) -> bytes:
        results = await self.preparer.prepare(
            self._refs(wire.parse_request(self.pb2.NodePrepareResourcesRequest, request))
        )
        if self.on_claims_changed is not None:
            await self.on_claims_changed()
        resp = self.pb2.NodePrepareResourcesResponse()
        for uid, r in results.items():
            one = resp.claims[uid]
            if r.error:
                one.error = r.error
                continue
            for d in r.devices:
                one.devices.append(
                    self.pb2.Device(
                        request_names=list(d.request_names),
                        pool_name=d.pool,
                        device_name=d.device,
                        cdi_device_ids=list(d.cdi_device_ids),
                    )
                )
        answer: bytes = resp.SerializeToString()
        return answer

    async def NodeUnprepareResources(self, request: bytes) -> bytes:
        results = await self.preparer.unprepare(
            self._refs(wire.parse_request(self.pb2.NodeUnprepareResourcesRequest, request))
        )
        if self.on_claims_changed is not None:
            await self.on_claims_changed()
        resp = self.pb2.NodeUnprepareResourcesResponse()
        for uid, err in results.items():
            resp.claims[uid].error = err
        answer: bytes = resp.SerializeToString()
        return answer

    def methods(self, on_loop: _OnLoop) -> dict[str, wire.UnaryMethod]:
        return {
            _path(self.pb2, "DRAPlugin", "NodePrepareResources"): on_loop.unary(self.NodePrepareResources),
            _path(self.pb2, "DRAPlugin", "NodeUnprepareResources"): on_loop.unary(
                self.NodeUnprepareResources
            ),
        }


class _HealthServicer:
    def __init__(self, feed: HealthFeed, pool: str) -> None:
        self.feed = feed
        self.pool = pool

    async def NodeWatchResources(self, request: bytes) -> AsyncGenerator[bytes, None]:
        wire.parse_request(health_pb2.NodeWatchResourcesRequest, request)
        async for snap in self.feed.watch():
            answer: bytes = health_pb2.NodeWatchResourcesResponse(
                devices=[
                    health_pb2.DeviceHealth(
                        device=health_pb2.DeviceIdentifier(pool_name=self.pool, device_name=s.name),
                        health=s.health,
                        last_updated_time=s.since,
                    )
                    for s in snap
                ]
            ).SerializeToString()
            yield answer


class _RegistrationServicer:
    def __init__(self, owner: DraServer) -> None:
        self.owner = owner

    async def GetInfo(self, request: bytes) -> bytes:
        wire.parse_request(reg_pb2.InfoRequest, request)
        answer: bytes = reg_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.owner.driver,
            endpoint=str(self.owner.endpoint),
            supported_versions=list(SERVICES),
        ).SerializeToString()
        return answer

    async def NotifyRegistrationStatus(self, request: bytes) -> bytes:
        status = wire.parse_request(reg_pb2.RegistrationStatus, request)
        self.owner.registered = bool(status.plugin_registered)
        self.owner.registration_error = str(status.error)
        if status.plugin_registered:
            log.info("kubelet registered DRA driver %s", self.owner.driver)
        else:
            log.error("kubelet refused DRA driver %s: %s", self.owner.driver, status.error)
        self.owner.registration_changed.set()
        if status.plugin_registered and self.owner.on_registered is not None:
            self.owner.on_registered()
        answer: bytes = reg_pb2.RegistrationStatusResponse().SerializeToString()
        return answer


def _check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(f"socket path too long for a Unix socket ({len(os.fsencode(path))} bytes): {path}")


def _serve(
    path: Path, unary: dict[str, wire.UnaryMethod], streaming: dict[str, wire.StreamMethod], name: str
) -> wire.UnixGrpcServer:
    _check_socket_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a socket left by a previous process
    server = wire.UnixGrpcServer(path, unary, streaming, name=name)
    server.start()
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
    ) -> None:
        self.driver = driver
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
        self._dra: wire.UnixGrpcServer | None = None
        self._reg: wire.UnixGrpcServer | None = None

    async def start(self) -> None:
        on_loop = _OnLoop(asyncio.get_running_loop())
        unary: dict[str, wire.UnaryMethod] = {}
        for pb2 in (v1_pb2, v1beta1_pb2):
            unary.update(_DraServicer(self.preparer, pb2, self.on_claims_changed).methods(on_loop))
        health = _HealthServicer(self.feed, self.preparer.pool)
        streaming = {
            _path(health_pb2, "DRAResourceHealth", "NodeWatchResources"): on_loop.stream(
                health.NodeWatchResources
            )
        }
        reg = _RegistrationServicer(self)
        reg_unary = {
            _path(reg_pb2, "Registration", "GetInfo"): on_loop.unary(reg.GetInfo),
            _path(reg_pb2, "Registration", "NotifyRegistrationStatus"): on_loop.unary(
                reg.NotifyRegistrationStatus
            ),
        }
        self._dra = _serve(self.dra_path, unary, streaming, f"DRA {self.driver}")
        try:
            self._reg = _serve(self.reg_path, reg_unary, {}, f"DRA {self.driver} registration")
        except BaseException:
            await self._stop_one(self._dra, self.dra_path)
            self._dra = None
            raise
        log.info("DRA driver %s serving on %s (registration %s)", self.driver, self.dra_path, self.reg_path)

    @staticmethod
    async def _stop_one(server: wire.UnixGrpcServer | None, path: Path) -> None:
        if server is not None:
            await asyncio.to_thread(server.stop, STOP_GRACE_S)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    async def stop(self) -> None:
        await self._stop_one(self._reg, self.reg_path)
        self._reg = None
        await self._stop_one(self._dra, self.dra_path)
        self._dra = None
        self.registered = False
