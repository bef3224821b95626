"""Looking at the device-plugin sockets of other processes: who listens, whether it answers the device-plugin
API, which device IDs it lists (read-only; one short call each, every call with a deadline).

A socket answers when ``GetDevicePluginOptions`` succeeds; its devices come from the first ``ListAndWatch``
message (the stream is closed after it). The listening process is named by the kernel (``SO_PEERCRED``
of the connection), so a caller can tell its own sockets, or nodeagent's, from another plugin's.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from nodeagent import fileio
from nodeagent.deviceplugin.api import pb2 as api_pb2
from nodeagent.deviceplugin.api import pb2_grpc as api_pb2_grpc
from nodeagent.errors import KubeletError, NodeAgentError
from nodeagent.grpcadapter.client import Failure, call, first_message, open_channel

KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT = "kubelet_internal_checkpoint"
PROBE_TIMEOUT_S = 1.0
MAX_CHECKPOINT = 16 << 20


@dataclass(frozen=True)
class PluginSocket:
    """A Unix socket in the device-plugin directory: ``answers`` when it speaks the device-plugin API;
    ``device_ids`` its first ListAndWatch list; ``pid`` the listening process (None: nobody listens)."""

    name: str
    answers: bool
    device_ids: tuple[str, ...] = ()
    pid: int | None = None


def peer_pid(path: Path, timeout_s: float = PROBE_TIMEOUT_S) -> int | None:
    """The pid of the process listening on the Unix socket ``path`` as the kernel names it (``SO_PEERCRED``):
    0 for a process of another pid namespace; None when nobody accepts connections (a stale file)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(str(path))
            raw = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return None
    pid: int = struct.unpack("3i", raw)[0]
    return pid


def listener_pid(path: Path, timeout_s: float = PROBE_TIMEOUT_S) -> int | None:
    """The pid of the process listening on the Unix socket ``path`` (None: nobody accepts connections, or the
    kernel cannot name it here)."""
    return peer_pid(path, timeout_s) or None


def probe(path: Path, timeout_s: float = PROBE_TIMEOUT_S) -> PluginSocket:
    """What listens on ``path`` and whether it is a device plugin (never raises)."""
    pid = listener_pid(path, timeout_s)
    if pid is None:
        return PluginSocket(path.name, False)

    def failed(f: Failure) -> KubeletError:
        return KubeletError(f"{path}: {f.code}: {f.details}", subject=str(path))

    try:
        with open_channel(path) as channel:
            stub = api_pb2_grpc.DevicePluginStub(channel)
            call(stub.GetDevicePluginOptions, api_pb2.Empty(), timeout=timeout_s, error=failed)
            first = first_message(stub.ListAndWatch, api_pb2.Empty(), timeout=timeout_s, error=failed)
    except NodeAgentError:
        return PluginSocket(path.name, False, pid=pid)
    return PluginSocket(path.name, True, tuple(sorted(d.ID for d in first.devices)), pid)


def scan(directory: Path, skip: frozenset[str] = frozenset(), timeout_s: float = PROBE_TIMEOUT_S) -> list[PluginSocket]:
    """Every socket in ``directory`` but ``kubelet.sock`` and ``skip``, probed (sorted by name)."""
    try:
        names = sorted(p.name for p in directory.iterdir() if p.is_socket())
    except OSError:
        return []
    return [probe(directory / n, timeout_s) for n in names if n != KUBELET_SOCKET and n not in skip]


def registered_devices(directory: Path, root: fileio.Root | None = None) -> dict[str, tuple[str, ...]]:
    """The kubelet's checkpoint in ``directory``: resource name → the device IDs registered for it
    ({} when there is none or it cannot be read); resolved inside ``root`` as it is read."""
    try:
        data = fileio.read_regular(directory / CHECKPOINT, max_bytes=MAX_CHECKPOINT, root=root)
        doc = json.loads(data or b"{}")
    except (NodeAgentError, ValueError):
        return {}
    devices = (doc.get("Data") or {}).get("RegisteredDevices") if isinstance(doc, dict) else None
    if not isinstance(devices, dict):
        return {}
    return {str(k): tuple(sorted(str(i) for i in v)) for k, v in devices.items() if isinstance(v, list)}
