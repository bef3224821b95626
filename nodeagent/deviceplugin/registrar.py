"""Registering resources with the kubelet, and noticing when the kubelet restarts.

``register`` is one Register call over ``kubelet.sock``. ``KubeletWatcher`` uses watchdog (inotify on
Linux) on the device-plugin directory and calls back on the loop whenever ``kubelet.sock`` is created
again, which is how a kubelet restart shows itself. The directory is watched at its resolved path: an
inotify watch on a symlink would see changes of the link itself, never the sockets in its target.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from nodeagent import fileio
from nodeagent.deviceplugin.api import pb2 as api_pb2
from nodeagent.deviceplugin.api import pb2_grpc as api_pb2_grpc
from nodeagent.errors import KubeletError
from nodeagent.grpcadapter.client import Failure, acall, open_aio_channel

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
REGISTER_TIMEOUT_S = 5.0


async def register(
    plugin_dir: Path, resource_name: str, endpoint: str, *, timeout: float = REGISTER_TIMEOUT_S
) -> None:
    """Register one resource; raises KubeletError (retryable) naming the cause."""
    sock = plugin_dir / KUBELET_SOCKET
    if not sock.exists():
        raise KubeletError(
            f"{sock} does not exist (kubelet not running?)", subject=resource_name, retryable=True
        )
    request = api_pb2.RegisterRequest(
        version=API_VERSION,
        endpoint=endpoint,
        resource_name=resource_name,
        options=api_pb2.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        ),
    )

    def refused(failure: Failure) -> KubeletError:
        return KubeletError(
            f"kubelet refused {resource_name}: {failure.code}: {failure.details}",
            subject=resource_name,
            retryable=True,
        )

    async with open_aio_channel(sock) as channel:
        stub = api_pb2_grpc.RegistrationStub(channel)
        await acall(stub.Register, request, timeout=timeout, error=refused, wait_for_ready=True)


class _Handler(FileSystemEventHandler):
    def __init__(self, target: Path, notify: Callable[[], None]) -> None:
        self._target = str(target)
        self._notify = notify

    def _check(self, path: Any) -> None:
        if isinstance(path, bytes):
            path = path.decode()
        if path == self._target:
            self._notify()

    def on_created(self, event: FileSystemEvent) -> None:
        self._check(event.src_path)

    def on_moved(self, event: FileSystemEvent) -> None:
        self._check(event.dest_path)


class KubeletWatcher:
    """Calls ``on_kubelet_start`` (on the event loop) each time ``kubelet.sock`` appears."""

    def __init__(self, plugin_dir: Path, on_kubelet_start: Callable[[], None], root: fileio.Root | None = None) -> None:
        self._dir = plugin_dir
        self._root = root  # under a root the directory (and any link above it) is resolved inside it
        self._callback = on_kubelet_start
        self._observer: Any = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        # Watch what the path points at: a symlinked device-plugins directory (or a symlink anywhere
        # above it) must still report kubelet.sock being created in the real directory; under a root, the
        # directory it points at inside the root.
        if self._root is not None:
            watched = fileio.makedirs(self._dir, root=self._root)
        else:
            self._dir.mkdir(parents=True, exist_ok=True)
            watched = self._dir.resolve()

        def notify() -> None:
            loop.call_soon_threadsafe(self._callback)

        observer = Observer()
        observer.schedule(_Handler(watched / KUBELET_SOCKET, notify), str(watched), recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer

    async def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is None:
            return
        observer.stop()
        await asyncio.to_thread(observer.join, 5.0)
