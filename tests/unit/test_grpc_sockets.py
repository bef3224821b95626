"""The kubelet-facing sockets on grpcio (``nodeagent.grpcadapter.server``), seen through a device-plugin
server: the socket's mode from the first instant, the message, connection, ping and stream bounds, malformed
requests refused by name, bounded refusal logs, and a stop that no client holds up. Clients are grpcio's
own and raw Unix sockets speaking just enough HTTP/2 by hand."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

import nodeagent.grpcadapter.server as grpc_server
from nodeagent.deviceplugin.api import pb2, pb2_grpc
from nodeagent.deviceplugin.server import STOP_GRACE_S
from nodeagent.deviceplugin.service import DevicePluginService
from nodeagent.grpcadapter.server import SERVER_LOOP_THREAD, RefusalLog, cut
from nodeagent.sharing.spec import parse_plugin_config
from tests.unit._dp_inventories import nvswitch_box

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
ENHANCE_YOUR_CALM = 0xB


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal field without indexing, new name, no Huffman (lengths under 127)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


class Raw:
    """A Unix-socket client that speaks HTTP/2 by hand (or nothing at all)."""

    def __init__(self, path: Path, *, preface: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(str(path))
        self.buf = b""
        self.http2 = preface
        if preface:
            self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))

    def call(self, stream: int, method: str, message: bytes) -> None:
        """A request for ``method`` on ``stream`` carrying one gRPC message."""
        block = b"".join(
            literal(n, v)
            for n, v in (
                (b":method", b"POST"),
                (b":scheme", b"http"),
                (b":path", method.encode()),
                (b":authority", b"x"),
                (b"content-type", b"application/grpc"),
                (b"te", b"trailers"),
            )
        )
        body = b"\x00" + struct.pack(">I", len(message)) + message
        self.sock.sendall(frame(HEADERS, END_HEADERS, stream, block) + frame(DATA, END_STREAM, stream, body))

    def next_frame(self, timeout: float) -> tuple[int, bytes] | None:
        """The next frame's type and payload (the server's SETTINGS acknowledged, as a client must); None once
        the server closed the connection."""
        self.sock.settimeout(timeout)
        while True:
            if len(self.buf) >= 9:
                n = int.from_bytes(self.buf[:3], "big")
                if len(self.buf) >= 9 + n:
                    kind, flags, payload = self.buf[3], self.buf[4], self.buf[9 : 9 + n]
                    self.buf = self.buf[9 + n :]
                    if kind == SETTINGS and not flags & ACK and self.http2:
                        with contextlib.suppress(OSError):  # the server may have closed by now
                            self.sock.sendall(frame(SETTINGS, ACK, 0))
                    return kind, payload
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None
            self.buf += chunk

    def goaway(self, timeout: float) -> tuple[int, bytes] | None:
        """The error code and debug data of the GOAWAY the server sends within ``timeout`` (None: closed
        without one)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            f = self.next_frame(left)
            if f is None:
                return None
            if f[0] == GOAWAY:
                code: int = struct.unpack(">I", f[1][4:8])[0]
                return code, f[1][8:]
        raise AssertionError(f"no GOAWAY within {timeout} s")

    def closed_within(self, timeout: float) -> bool:
        """Whether the server closes the connection (reading whatever it sends) within ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                if self.next_frame(left) is None:
                    return True
        except TimeoutError:
            pass
        return False

    def close(self) -> None:
        self.sock.close()


def allocate_request(device: str) -> Any:
    return pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=[device])])


def sock_of(svc: DevicePluginService) -> Path:
    return svc.plugin_dir / "nvidia-gpu.sock"


def allocate_works(svc: DevicePluginService, timeout: float = 5.0) -> bool:
    gpu0 = svc.served_resources()["nvidia.com/gpu"][0]
    with grpc.insecure_channel(f"unix://{sock_of(svc)}") as ch:
        answer = pb2_grpc.DevicePluginStub(ch).Allocate(allocate_request(gpu0), timeout=timeout)
    return bool(answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"])


async def test_the_socket_is_never_reachable_with_a_wider_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even with umask 0: the socket grpcio binds sits in a fresh 0700 directory until it is 0600, and only
    then is renamed into place; nothing of it is left beside the socket."""
    seen: list[tuple[str, int, int, bool]] = []
    real_chmod, real_rename = os.chmod, os.rename

    def spy_chmod(path: Any, mode: int, **kw: Any) -> None:
        p = Path(path)
        if stat.S_ISSOCK(p.lstat().st_mode):
            seen.append(
                ("chmod", stat.S_IMODE(p.lstat().st_mode), stat.S_IMODE(p.parent.stat().st_mode), False)
            )
        real_chmod(path, mode, **kw)

    def spy_rename(src: Any, dst: Any, **kw: Any) -> None:
        s = Path(src)
        seen.append(
            (
                "rename",
                stat.S_IMODE(s.lstat().st_mode),
                stat.S_IMODE(s.parent.stat().st_mode),
                Path(dst).exists(),
            )
        )
        real_rename(src, dst, **kw)

    monkeypatch.setattr(os, "chmod", spy_chmod)
    monkeypatch.setattr(os, "rename", spy_rename)
    svc = DevicePluginService(plugin_dir=tmp_path / "dp")
    old = os.umask(0)
    try:
        await svc.start(nvswitch_box(2))
    finally:
        os.umask(old)
    try:
        assert [(what, parent, exists) for what, _, parent, exists in seen] == [
            ("chmod", 0o700, False),  # bound inside a directory only its owner can enter
            ("rename", 0o700, False),
        ]
        assert seen[1][1] == 0o600  # already 0600 when it gets its name
        mode = sock_of(svc).stat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert [p.name for p in svc.plugin_dir.iterdir()] == ["nvidia-gpu.sock"]
        assert allocate_works(svc)  # the renamed socket is the listening one
    finally:
        await svc.stop()
    assert list(svc.plugin_dir.iterdir()) == []


async def test_over_4_mib_is_resource_exhausted_and_the_socket_goes_on(service: DevicePluginService) -> None:
    with grpc.insecure_channel(f"unix://{sock_of(service)}") as ch:
        stub = pb2_grpc.DevicePluginStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Allocate(allocate_request("x" * (grpc_server.MAX_MESSAGE + 1)), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert allocate_works(service)


async def test_malformed_requests_are_invalid_argument_naming_the_message(
    service: DevicePluginService, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="nodeagent.deviceplugin.server")
    with grpc.insecure_channel(f"unix://{sock_of(service)}") as ch:
        for method, name in (
            ("Allocate", "AllocateRequest"),
            ("GetPreferredAllocation", "PreferredAllocationRequest"),
            ("GetDevicePluginOptions", "Empty"),
        ):
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(f"/v1beta1.DevicePlugin/{method}")(b"\xff\xff\xff", timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert (e.value.details() or "").startswith(f"malformed {name} (3 bytes): "), e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            next(ch.unary_stream("/v1beta1.DevicePlugin/ListAndWatch")(b"\xff", timeout=5))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (e.value.details() or "").startswith("malformed Empty (1 bytes): ")
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("allocate refused: malformed AllocateRequest (3 bytes): ") for line in lines)
    assert any(line.startswith("list and watch refused: malformed Empty (1 bytes)") for line in lines)
    assert service.server("nvidia.com/gpu").watches.in_use == 0  # a refused stream took no slot
    assert allocate_works(service)


def test_refusal_lines_are_cut_and_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    refusals = RefusalLog(logging.getLogger("test.refusals"), burst=3, window_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="test.refusals")
    for i in range(5):
        refusals.refused("allocate", f"reason {i}")
    refusals.refused("allocate", "y" * 5000)
    assert [r.getMessage() for r in caplog.records] == [f"allocate refused: reason {i}" for i in range(3)]
    now[0] = 10.0
    refusals.refused("allocate", "z" * 5000)
    last = caplog.records[-1].getMessage()
    assert last.endswith("(3 lines before it not logged)") and len(last) < 700
    assert cut("z" * 5000, 512) in last and len(cut("z" * 5000, 512)) == 512
    assert cut("short", 512) == "short"


async def test_idle_and_silent_connections_do_not_lock_out_a_client(service: DevicePluginService) -> None:
    held = [Raw(sock_of(service), preface=i % 2 == 0) for i in range(16)]
    try:
        assert allocate_works(service, timeout=5)
        assert all(not h.closed_within(0.05) for h in held)  # they are not closed for being idle that soon
    finally:
        for h in held:
            h.close()


async def test_handshake_idle_and_ping_bounds_are_grpcios_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bounds are applied by grpcio itself: a connection that never sends the HTTP/2 preface is closed
    after the handshake timeout, one without calls gets GOAWAY after the idle time, and one that pings without
    calls gets GOAWAY ENHANCE_YOUR_CALM after its strikes."""
    monkeypatch.setattr(grpc_server, "HANDSHAKE_TIMEOUT_MS", 300)
    monkeypatch.setattr(grpc_server, "MAX_CONNECTION_IDLE_MS", 500)
    svc = DevicePluginService(plugin_dir=tmp_path / "dp")
    await svc.start(nvswitch_box(2))
    silent, idle, pinging = (Raw(sock_of(svc), preface=p) for p in (False, True, True))
    try:
        for i in range(4):
            pinging.sock.sendall(frame(PING, 0, 0, struct.pack(">Q", i)))
        assert await asyncio.to_thread(pinging.goaway, 5) == (ENHANCE_YOUR_CALM, b"too_many_pings")
        assert await asyncio.to_thread(silent.closed_within, 5)
        goaway = await asyncio.to_thread(idle.goaway, 5)
        assert goaway is not None and goaway[1] == b"connection idle", goaway
        assert await asyncio.to_thread(allocate_works, svc)
    finally:
        for r in (silent, idle, pinging):
            r.close()
        await svc.stop()


async def test_connections_beyond_the_cap_are_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grpc_server, "MAX_CONNECTIONS", 4)
    svc = DevicePluginService(plugin_dir=tmp_path / "dp")
    await svc.start(nvswitch_box(2))
    held = [Raw(sock_of(svc)) for _ in range(4)]
    try:
        for h in held:  # each one answered with the server's SETTINGS: all four are open
            assert await asyncio.to_thread(h.next_frame, 5) is not None
        extra = Raw(sock_of(svc), preface=False)  # the server may drop it before anything could be written
        assert await asyncio.to_thread(extra.closed_within, 5)
        extra.close()
        for h in held:
            h.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the slots come back as the server sees them closed
            try:
                if await asyncio.to_thread(allocate_works, svc, 1.0):
                    break
            except grpc.RpcError:
                await asyncio.sleep(0.1)
        assert await asyncio.to_thread(allocate_works, svc)
    finally:
        await svc.stop()


async def test_stop_is_not_held_up_by_a_client_that_reads_nothing(tmp_path: Path) -> None:
    """A ListAndWatch whose client never reads (nor opens its flow-control window) stops being sent to once
    the window is full; stop still returns within the grace (the call is cancelled), its thread ends, and
    other clients were served meanwhile."""
    svc = DevicePluginService(plugin_dir=tmp_path / "dp")
    await svc.start(nvswitch_box(8))
    stuck = Raw(sock_of(svc))
    stuck.call(1, "/v1beta1.DevicePlugin/ListAndWatch", b"")
    replicas: Callable[[int], Any] = lambda n: parse_plugin_config(  # noqa: E731
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
        f"      replicas: {n}\n"
    )
    try:
        for n in range(2, 40):  # lists of up to 312 devices, several times the 64 KiB window in all
            await svc.update(nvswitch_box(8), replicas(n))
            await asyncio.sleep(0.01)  # each list is sent (or waits for the window) before the next
        assert await asyncio.to_thread(allocate_works, svc)
    finally:
        t = time.monotonic()
        await svc.stop()
        took = time.monotonic() - t
        stuck.close()
    # the stream was stuck (stop waited out the grace before cancelling it) and stop still returned in time
    assert STOP_GRACE_S <= took < STOP_GRACE_S + 2, took
    assert [th.name for th in threading.enumerate() if th.name == SERVER_LOOP_THREAD] == [SERVER_LOOP_THREAD]
