"""The kubelet-facing sockets (grpc.aio through ``nodeagent.grpcadapter.server``) under hostile clients on the
same Unix socket, spoken to over raw HTTP/2 (the ``h2`` library): clients that open no flow-control window,
calls whose request never comes, idle connections at the connection cap, floods of malformed requests and
large bodies. Each test is bounded in clients, calls and time; the kubelet's side is a grpcio client that must
be answered throughout."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

import nodeagent.grpcadapter.server as grpc_server
from nodeagent.deviceplugin.api import pb2, pb2_grpc
from nodeagent.deviceplugin.server import STOP_GRACE_S
from nodeagent.deviceplugin.service import DevicePluginService
from nodeagent.dra.api import reg_pb2, reg_pb2_grpc, v1_pb2, v1_pb2_grpc
from nodeagent.dra.server import DraServer
from nodeagent.dra.service import FAILED_READS_BURST, FAILED_READS_PER_S
from nodeagent.sharing.spec import parse_plugin_config
from tests.unit._dp_inventories import nvswitch_box
from tests.unit.test_dra_service import Claims

REPO = Path(__file__).resolve().parents[2]
ALLOCATE = "/v1beta1.DevicePlugin/Allocate"
LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"
# the method the kubelet calls (its gRPC client's full method name, as in Kubernetes' own DRA e2e tests);
# "/v1.DRAPlugin/..." is no method of the server and was answered UNIMPLEMENTED at once
PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
GET_INFO = "/pluginregistration.Registration/GetInfo"


def grpc_message(message: Any) -> bytes:
    body: bytes = message.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


class H2:
    """One HTTP/2 connection to a Unix socket, as a hostile client drives it."""

    def __init__(self, path: Path, *, window: int = 65_535) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(str(path))
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.flush()
        self.status: dict[int, str] = {}  # stream → grpc-status of its trailers
        self.closed = False

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def open(self, method: str, body: bytes | None) -> int:
        """A call of ``method`` whose request is ``body`` (None: headers only, the request never sent)."""
        sid: int = self.conn.get_next_available_stream_id()
        self.conn.send_headers(
            sid,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", method),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ],
        )
        if body is not None:
            self.conn.send_data(sid, body, end_stream=True)
        self.flush()
        return sid

    def read(self, timeout: float) -> None:
        """Whatever the server sends within ``timeout`` (never opening the window: no WINDOW_UPDATE is sent
        for data received)."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 20)
        except (TimeoutError, BlockingIOError):
            return
        except OSError:
            data = b""
        if not data:
            self.closed = True
            return
        for event in self.conn.receive_data(data):
            if isinstance(event, (h2.events.TrailersReceived, h2.events.ResponseReceived)):
                for name, value in event.headers:
                    if bytes(name) == b"grpc-status":
                        self.status[event.stream_id] = bytes(value).decode()
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.closed = True
        self.conn.clear_outbound_data_buffer()  # acknowledgements the server need not see

    def close(self) -> None:
        self.sock.close()


def tasks() -> int:
    """Threads of this process (grpcio's own included)."""
    return len(os.listdir("/proc/self/task"))


def sock_of(svc: DevicePluginService) -> Path:
    return svc.plugin_dir / "nvidia-gpu.sock"


def allocate_request(svc: DevicePluginService) -> Any:
    gpu0 = svc.served_resources()["nvidia.com/gpu"][0]
    return pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=[gpu0])])


def allocate_took(svc: DevicePluginService, timeout: float = 5.0, *, wait_for_ready: bool = False) -> float:
    """Seconds a kubelet-like client's Allocate takes on a new connection (raises when it is not answered;
    with ``wait_for_ready``, a connection that fails is dialled again until ``timeout``)."""
    t0 = time.monotonic()
    with grpc.insecure_channel(f"unix://{sock_of(svc)}") as ch:
        answer = pb2_grpc.DevicePluginStub(ch).Allocate(
            allocate_request(svc), timeout=timeout, wait_for_ready=wait_for_ready
        )
    assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"]
    return time.monotonic() - t0


def calls_in_parallel(calls: list[Callable[[], object]], parallel: int = 16) -> dict[str, int]:
    """How many of ``calls`` (gRPC calls) ended with each status, run ``parallel`` at once (fewer than a
    connection's streams, as the kubelet's calls are)."""
    def code(call: Callable[[], object]) -> str:
        try:
            call()
        except grpc.RpcError as e:
            return str(e.code().name)
        return "OK"

    codes: dict[str, int] = {}
    with ThreadPoolExecutor(parallel) as pool:
        for c in pool.map(code, calls):
            codes[c] = codes.get(c, 0) + 1
    return codes


def replicas(n: int) -> Any:
    return parse_plugin_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
        f"      replicas: {n}\n"
    )



async def _all_end_past_their_deadline(clients: list[Any], opened: dict[int, list[int]], wait_s: float) -> None:
    """Read the clients until every call they opened has its status (at most ``wait_s``): each must have ended
    DEADLINE_EXCEEDED, the server's answer to a request that never came."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(len(c.status) < len(opened[id(c)]) for c in clients):
        for c in clients:
            await asyncio.to_thread(c.read, 0.05)
    statuses = [c.status.get(sid) for c in clients for sid in opened[id(c)]]
    assert statuses == [str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])] * len(statuses)

async def test_a_zero_window_client_on_16_connections_holds_no_thread(service: DevicePluginService) -> None:
    """16 connections that open no flow-control window, each with every call a connection may carry (a
    ListAndWatch and Allocates), while the device list changes: the process's thread count stays where it
    was (the hand-written server it replaced grew to 1,631 threads), the kubelet's Allocate is answered
    throughout, and stop is not held up past its grace."""
    await asyncio.to_thread(allocate_took, service)  # the client's own threads, started once
    before = tasks()
    body = grpc_message(allocate_request(service))
    clients = [H2(sock_of(service), window=0) for _ in range(16)]
    try:
        for c in clients:
            c.open(LIST_AND_WATCH, grpc_message(pb2.Empty()))
            for _ in range(grpc_server.MAX_STREAMS - 1):
                c.open(ALLOCATE, body)
        for n in range(2, 12):  # every change is a list sent to every stream that holds a slot
            await service.update(nvswitch_box(2), replicas(n))
            await asyncio.sleep(0.05)
        for c in clients:
            await asyncio.to_thread(c.read, 0.05)
        took = await asyncio.to_thread(allocate_took, service)
        grown = tasks() - before
        print(f"zero window, 16 connections: {before} threads before, {grown:+d}; Allocate in {took * 1e3:.1f} ms")
        assert took < 2.0, took
        assert grown <= 4, f"{grown} more threads"
        assert not any(c.closed for c in clients)  # they were held, not merely dropped
    finally:
        t0 = time.monotonic()
        await service.stop()
        stop_took = time.monotonic() - t0
        for c in clients:
            c.close()
    assert stop_took < STOP_GRACE_S + 2, stop_took


async def test_the_kubelets_list_and_watch_gets_in_past_streams_that_take_nothing(
    service: DevicePluginService, caplog: pytest.LogCaptureFixture
) -> None:
    """Every ListAndWatch slot held by a client that opens no window (so the list sent to it is never taken):
    the kubelet's ListAndWatch takes the slot of the one stuck longest, whose method is cancelled, and gets
    the list; its slot comes back when its stream ends."""
    caplog.set_level(logging.WARNING, logger="nodeagent.deviceplugin.server")
    watches = service.server("nvidia.com/gpu").watches
    stuck = [H2(sock_of(service), window=0) for _ in range(watches.limit)]
    try:
        for c in stuck:
            c.open(LIST_AND_WATCH, grpc_message(pb2.Empty()))
        for _ in range(50):
            if watches.in_use == watches.limit:
                break
            await asyncio.sleep(0.02)
        assert watches.in_use == watches.limit
        await asyncio.sleep(grpc_server.STUCK_STREAM_S + 0.2)

        def kubelet_watch() -> int:
            with grpc.insecure_channel(f"unix://{sock_of(service)}") as ch:
                first = next(pb2_grpc.DevicePluginStub(ch).ListAndWatch(pb2.Empty(), timeout=5))
                return len(first.devices)

        assert await asyncio.to_thread(kubelet_watch) == 2
        assert watches.ended == 1
        for _ in range(50):  # the kubelet's stream ended with its channel: its slot comes back
            if watches.in_use == watches.limit - 1:
                break
            await asyncio.sleep(0.02)
        assert watches.in_use == watches.limit - 1
        assert await asyncio.to_thread(kubelet_watch) == 2
        assert watches.ended == 1
        assert await asyncio.to_thread(allocate_took, service) < 2.0
    finally:
        for c in stuck:
            c.close()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("nodeagent")]
    assert len(lines) == 1 and lines[0].startswith("ListAndWatch ended: a stream whose client took no answer")
    # grpcio may report a stuck client's stream it could not finish: one line each, within its rate limit
    core = [r.getMessage() for r in caplog.records if not r.name.startswith("nodeagent")]
    assert len(core) <= 5 and all("\n" not in m for m in core), core


async def test_calls_whose_request_never_comes_do_not_lock_the_kubelet_out(
    service: DevicePluginService, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """16 connections with every call they may carry left without its request (496 calls; with grpcio's
    server-wide cap of 64 calls, 64 such calls locked every Allocate out): the kubelet's Allocate is answered
    at once, and each such call ends DEADLINE_EXCEEDED once its request is ``REQUEST_TIMEOUT_S`` late."""
    monkeypatch.setattr(grpc_server, "REQUEST_TIMEOUT_S", 1.0)
    caplog.set_level(logging.WARNING, logger="nodeagent.deviceplugin.server")
    clients = [H2(sock_of(service)) for _ in range(16)]
    try:
        opened = {id(c): [c.open(ALLOCATE, None) for _ in range(grpc_server.MAX_STREAMS - 1)] for c in clients}
        await asyncio.sleep(0.2)
        took = await asyncio.to_thread(allocate_took, service)
        print(f"{sum(map(len, opened.values()))} calls without their request: Allocate in {took * 1e3:.1f} ms")
        assert took < 2.0
        await _all_end_past_their_deadline(clients, opened, 5)
        assert await asyncio.to_thread(allocate_took, service) < 2.0
    finally:
        for c in clients:
            c.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(ln.startswith("allocate refused: no request within 1 s") for ln in lines)
    assert len(lines) <= 20  # the refusal log's burst, not one line a call


async def test_clients_that_drop_their_calls_mid_send_leave_a_few_lines(
    service: DevicePluginService, caplog: pytest.LogCaptureFixture
) -> None:
    """Connections dropped while the answers of their calls wait for a window that never opens: grpc.aio logs
    each such call with its traceback; at most ``GrpcLogBound``'s burst of one-line entries are written."""
    caplog.set_level(logging.INFO)
    body = grpc_message(allocate_request(service))
    for _ in range(8):
        clients = [H2(sock_of(service), window=0) for _ in range(4)]
        for c in clients:
            c.open(LIST_AND_WATCH, grpc_message(pb2.Empty()))
            for _ in range(8):
                c.open(ALLOCATE, body)
        await asyncio.sleep(0.1)
        for c in clients:
            c.close()
    await asyncio.sleep(0.5)
    lines = [r for r in caplog.records if r.name.startswith("grpc")]
    assert len(lines) <= 5, [r.getMessage() for r in lines]
    assert all(r.exc_info is None and "\n" not in r.getMessage() and len(r.getMessage()) < 600 for r in lines)
    assert await asyncio.to_thread(allocate_took, service) < 2.0


async def test_idle_connections_at_the_cap_time_out_and_the_kubelet_gets_in(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As many idle connections as the server takes: a new client is turned away while they are held, and
    answered once the server closed them for idleness (here 0.5 s; 60 s in production)."""
    monkeypatch.setattr(grpc_server, "MAX_CONNECTIONS", 16)
    monkeypatch.setattr(grpc_server, "MAX_CONNECTION_IDLE_MS", 500)
    svc = DevicePluginService(plugin_dir=short_dir / "dp")
    await svc.start(nvswitch_box(2))
    idle = [H2(sock_of(svc)) for _ in range(16)]
    try:
        for c in idle:
            await asyncio.to_thread(c.read, 1.0)  # the server's SETTINGS: the connection is taken
        t0 = time.monotonic()
        took = await asyncio.to_thread(allocate_took, svc, 10.0, wait_for_ready=True)  # dials till it gets in
        waited = time.monotonic() - t0
        for c in idle:
            for _ in range(20):
                if c.closed:
                    break
                await asyncio.to_thread(c.read, 0.1)
        print(f"16 idle connections at the cap: a new client answered after {waited:.2f} s")
        assert all(c.closed for c in idle)  # GOAWAY "connection idle", then closed
        assert took < 10.0 and waited < 5.0, (took, waited)
    finally:
        for c in idle:
            c.close()
        await svc.stop()


async def test_a_flood_of_malformed_and_refused_requests_is_a_few_short_lines(
    service: DevicePluginService, caplog: pytest.LogCaptureFixture
) -> None:
    """3,000 malformed requests, 200 Allocates naming a 400 kB device, 200 garbage connections: at most the
    refusal log's burst of lines (the hand-written server wrote 268,514 in 15 s and one line of 3.1 MB)."""
    caplog.set_level(logging.INFO)
    path = sock_of(service)

    def flood() -> dict[str, int]:
        for i in range(200):
            garbage = b"GET / HTTP/1.1\r\n\r\n" if i % 2 else b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(64)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, contextlib.suppress(OSError):
                s.connect(str(path))
                s.sendall(garbage)  # the server may have closed it already
        huge = pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=["x" * 400_000])])
        with grpc.insecure_channel(f"unix://{path}") as ch:
            # the server drops connections beyond its cap at accept; the garbage ones may not all be closed on
            # its side yet on a loaded machine: the channel connects once they are (the flood needs a channel)
            grpc.channel_ready_future(ch).result(timeout=30)
            raw = ch.unary_unary(ALLOCATE)
            stub = pb2_grpc.DevicePluginStub(ch)
            return calls_in_parallel(
                [lambda i=i: raw(b"\xff" * (1 + i % 40), timeout=30) for i in range(3000)]
                + [lambda: stub.Allocate(huge, timeout=30)] * 200
            )

    t0 = time.monotonic()
    codes = await asyncio.to_thread(flood)
    took = time.monotonic() - t0
    assert codes == {"INVALID_ARGUMENT": 3200}
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    print(f"flood: 3,200 refused calls and 200 garbage connections in {took:.1f} s, {len(lines)} lines, "
          f"the longest {max(map(len, lines))} characters")
    assert 1 <= len(lines) <= 21, len(lines)
    assert max(len(ln) for ln in lines) < 700
    assert await asyncio.to_thread(allocate_took, service) < 2.0
    assert took < 60


async def test_over_4_mib_is_resource_exhausted_on_the_dra_socket(served: tuple[DraServer, Claims]) -> None:
    server = served[0]
    async with grpc.aio.insecure_channel(f"unix://{server.dra_path}") as ch:
        stub = v1_pb2_grpc.DRAPluginStub(ch)
        big = v1_pb2.NodePrepareResourcesRequest(
            claims=[v1_pb2.Claim(namespace="ns", uid="u", name="n" * (grpc_server.MAX_MESSAGE + 1))]
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.NodePrepareResources(big, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        ok = await stub.NodePrepareResources(
            v1_pb2.NodePrepareResourcesRequest(claims=[v1_pb2.Claim(namespace="ns", uid="u1", name="one")]),
            timeout=10,
        )
        assert ok.claims["u1"].devices[0].device_name == "gpu-1"


async def test_calls_whose_request_never_comes_do_not_lock_out_the_dra_sockets(
    served: tuple[DraServer, Claims], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DRA driver's sockets (grpc.aio on the daemon's loop): 3 connections to each with 31 calls each left
    without their request (GetInfo and the kubelet's NodePrepareResources method); the kubelet's GetInfo (its
    plugin watcher registering the driver; 64 such calls locked it out) and NodePrepareResources are answered
    while they are held open, and each held call ends DEADLINE_EXCEEDED once its request is late."""
    monkeypatch.setattr(grpc_server, "REQUEST_TIMEOUT_S", 3.0)
    registered = v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name
    assert PREPARE.split("/")[1] == registered  # the service nodeagent registers
    server = served[0]
    clients = [H2(server.reg_path) for _ in range(3)] + [H2(server.dra_path) for _ in range(3)]
    try:
        opened = {id(c): [c.open(method, None) for _ in range(grpc_server.MAX_STREAMS - 1)]
                  for c, method in zip(clients, [GET_INFO] * 3 + [PREPARE] * 3, strict=True)}
        await asyncio.sleep(0.2)
        for c in clients:
            await asyncio.to_thread(c.read, 0.05)
        assert [c.status for c in clients] == [{}] * 6  # every call is open (an unknown method ends at once)
        t0 = time.monotonic()
        async with grpc.aio.insecure_channel(f"unix://{server.reg_path}") as ch:
            info = await reg_pb2_grpc.RegistrationStub(ch).GetInfo(reg_pb2.InfoRequest(), timeout=5)
        assert info.name == server.driver
        async with grpc.aio.insecure_channel(f"unix://{server.dra_path}") as ch:
            ok = await v1_pb2_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1_pb2.NodePrepareResourcesRequest(claims=[v1_pb2.Claim(namespace="ns", uid="u1", name="one")]),
                timeout=5,
            )
        took = time.monotonic() - t0
        assert ok.claims["u1"].devices[0].device_name == "gpu-1"
        print(f"{sum(map(len, opened.values()))} DRA calls without their request: GetInfo and "
              f"NodePrepareResources in {took * 1e3:.1f} ms")
        assert took < 2.0
        await _all_end_past_their_deadline(clients, opened, 15)
    finally:
        for c in clients:
            c.close()


async def test_a_flood_of_unknown_claims_makes_few_lines_and_few_api_reads(
    served: tuple[DraServer, Claims], caplog: pytest.LogCaptureFixture
) -> None:
    """3,000 NodePrepareResources calls, each naming a claim the API server does not know, and one naming a
    claim whose UID is 1,000 NULs: a few cut, escaped log lines and a bounded number of ResourceClaim reads
    (counted at the driver's read of the API); the kubelet's own claim is prepared after it."""
    caplog.set_level(logging.INFO, logger="nodeagent")
    server, claims = served
    async with grpc.aio.insecure_channel(f"unix://{server.dra_path}") as ch:
        stub = v1_pb2_grpc.DRAPluginStub(ch)

        async def prepare(namespace: str, uid: str, name: str) -> str:
            answer = await stub.NodePrepareResources(
                v1_pb2.NodePrepareResourcesRequest(claims=[v1_pb2.Claim(namespace=namespace, uid=uid, name=name)]),
                timeout=30)
            return str(answer.claims[uid].error)

        nul = await prepare("ns", "\x00" * 1000, "claim")
        assert claims.reads == 0 and nul.startswith("claim UID '\\x00") and len(nul) < 400, nul
        t0 = time.monotonic()
        at_once = asyncio.Semaphore(16)

        async def unknown(i: int) -> str:
            async with at_once:
                return await prepare("ns", f"uid-{i:05d}", f"claim-{i}")

        errors = await asyncio.gather(*(unknown(i) for i in range(3000)))
        took = time.monotonic() - t0
        assert all(errors)
        reads = claims.reads
        await asyncio.sleep(2 / FAILED_READS_PER_S)  # the budget of failed reads refills: one more read
        assert await prepare("ns", "u1", "one") == ""
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    print(f"3,000 calls naming unknown claims in {took:.1f} s: {reads} ResourceClaim reads, {len(lines)} log "
          f"lines, the longest {max(map(len, lines))} characters")
    assert reads <= FAILED_READS_BURST + FAILED_READS_PER_S * took + 1, reads  # was 3,000
    assert 1 <= len(lines) <= 20, len(lines)  # was 3,004
    assert max(map(len, lines)) < 700 and not any(c in ln for ln in lines for c in "\x00\n")
    assert any(ln.startswith("NodePrepareResources refused: claim UID '\\x00") for ln in lines)


# The server in a process of its own, so that its resident memory is its own.
SERVER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from nodeagent.deviceplugin.service import DevicePluginService
    from tests.unit._dp_inventories import nvswitch_box

    async def main():
        svc = DevicePluginService(plugin_dir=Path(sys.argv[1]))
        await svc.start(nvswitch_box(2))
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await svc.stop()

    asyncio.run(main())
    """
)


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def test_memory_taken_by_large_bodies_comes_back(short_dir: Path) -> None:
    """Three bursts of 32 Allocates of 4 MB each (refused: no such device) and 32 of 5 MB (RESOURCE_EXHAUSTED)
    at the device-plugin server: its resident memory rises while they are read and is back within 50 MiB of
    where it was 2 s after (it was +800 MB after one burst, and grew with every further one)."""
    plugin_dir = short_dir / "dp"
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(plugin_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        before = rss_mib(proc.pid)
        peak = before
        path = plugin_dir / "nvidia-gpu.sock"
        codes: dict[str, int] = {}
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.02):
                peak = max(peak, rss_mib(proc.pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            with grpc.insecure_channel(
                f"unix://{path}", options=[("grpc.max_send_message_length", 8 << 20)]
            ) as ch:
                stub = pb2_grpc.DevicePluginStub(ch)
                bodies = {
                    size: pb2.AllocateRequest(
                        container_requests=[pb2.ContainerAllocateRequest(devices_ids=["x" * size])]
                    )
                    for size in (4_000_000, 5_000_000)
                }
                for _ in range(3):
                    burst = calls_in_parallel(
                        [functools.partial(stub.Allocate, body, timeout=60) for body in bodies.values() for _ in range(32)]
                    )
                    for k, v in burst.items():
                        codes[k] = codes.get(k, 0) + v
        finally:
            done.set()
            sampler.join()
        time.sleep(2)
        after = rss_mib(proc.pid)
        print(f"server RSS: {before} MiB before, {peak} MiB at the peak, {after} MiB 2 s after")
        assert codes == {"INVALID_ARGUMENT": 96, "RESOURCE_EXHAUSTED": 96}
        assert peak > before  # the bodies were taken in
        assert after <= before + 50, (before, peak, after)
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.wait(30)
        proc.stdout.close()
