"""The metrics listener (nodeagent/metricsserver.py) under idle, trickling and oversized clients: no thread per
connection, unfinished requests give way to newer connections, finished ones never do, scrapes answered."""

from __future__ import annotations

import contextlib
import gzip
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from nodeagent.metrics import Metrics
from nodeagent.metricsserver import MAX_PER_CLIENT, Limits, MetricsServer, start_bounded_server


def _scrape(port: int, host: str = "127.0.0.1", **headers: str) -> bytes:
    req = urllib.request.Request(f"http://{host}:{port}/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        body: bytes = resp.read()
        return body


def _wait(cond: Callable[[], object], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def _closed(s: socket.socket, timeout: float = 5.0) -> bool:
    """The server closed ``s`` (EOF or reset within ``timeout``)."""
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, ConnectionAbortedError):
        return True
    except TimeoutError:
        return False


def _read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    s.settimeout(10)
    out = b""
    while chunk := s.recv(1 << 20):
        out += chunk
    return out


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


@contextlib.contextmanager
def _served(app: Any = None, **limits: Any) -> Iterator[MetricsServer]:
    if app is None:
        from prometheus_client import make_wsgi_app

        app = make_wsgi_app(Metrics("node-a").registry)
    server = start_bounded_server("127.0.0.1", 0, app, Limits(**limits))
    try:
        yield server
    finally:
        server.stop()


def test_idle_connections_cannot_pile_up_threads() -> None:
    """300 idle connections made 300 threads with a thread per connection; now they make none, the server
    keeps at most MAX_PER_CLIENT of one address (the others closed), and a scrape is answered while they
    stay."""
    server = Metrics("node-a").serve("127.0.0.1:0")
    # the threads there now (a thread an earlier test left may end meanwhile: only new ones count)
    base = set(threading.enumerate())
    idle: list[socket.socket] = []
    try:
        for _ in range(300):
            idle.append(_connect(server.port))
        turned_away = 300 - MAX_PER_CLIENT
        assert _wait(lambda: server.counts.evicted + server.counts.refused >= turned_away, 10), server.counts
        assert server.open_connections <= MAX_PER_CLIENT
        assert [t for t in threading.enumerate() if t not in base] == []
        assert b"# HELP" in _scrape(server.port)
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_a_trickling_client_is_cut_off() -> None:
    server = Metrics("node-a").serve("127.0.0.1:0")
    try:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        s.sendall(b"GET /metrics HTTP/1.0\r\n")  # and never the blank line
        t0 = time.monotonic()
        s.settimeout(30)
        try:
            data = s.recv(100)
        except OSError:
            data = b""
        waited = time.monotonic() - t0
        s.close()
        assert data == b"" and waited < 20, (data, waited)
        assert b"# HELP" in _scrape(server.port)
    finally:
        server.stop()


def test_slowloris_clients_cannot_hold_the_slots() -> None:
    """As many clients as one address may keep, each sending one header line every second (the per-read
    timeouts of a threaded server never fire): the whole request has one deadline, every scrape meanwhile
    takes the place of the oldest of them and is answered, and every trickler is cut off."""
    server = Metrics("node-a").serve("127.0.0.1:0")
    tricklers: list[socket.socket] = []
    stop = threading.Event()
    try:
        for _ in range(MAX_PER_CLIENT):
            s = _connect(server.port)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            tricklers.append(s)
        # all of them read once (waiting), as they are long before a scraper's next visit; on a loaded machine
        # the server's loop may not have read them all yet when the first scrape comes
        assert _wait(lambda: server.waiting_connections == MAX_PER_CLIENT, 10), server.waiting_connections

        def trickle() -> None:
            n = 0
            while not stop.wait(1.0):
                n += 1
                for s in tricklers:
                    with contextlib.suppress(OSError):  # cut off by the server: as it should be
                        s.sendall(f"X-Slow-{n}: 1\r\n".encode())

        feeder = threading.Thread(target=trickle, daemon=True)
        feeder.start()
        for _ in range(10):
            assert b"# HELP" in _scrape(server.port)
            time.sleep(0.2)
        assert all(_closed(s, 10) for s in tricklers)
        stop.set()
        feeder.join()
    finally:
        stop.set()
        for s in tricklers:
            s.close()
        server.stop()


def test_a_finished_request_never_gives_way() -> None:
    """With room for two connections, one whose answer (32 MiB, more than the socket buffers hold, not read
    yet) is on its way and newer idle ones: each newcomer closes the idle one before it, never the one being
    answered."""
    body = b"x" * (32 << 20)

    def big(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [body]

    with _served(big, max_connections=2, write_timeout_s=60.0) as server:
        answered = _connect(server.port)
        answered.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _wait(lambda: server.counts.served == 1, 5)
        idle1 = _connect(server.port)
        assert _wait(lambda: server.waiting_connections == 1, 5)
        idle2 = _connect(server.port)
        assert _closed(idle1)
        assert _wait(lambda: server.counts.evicted == 1 and server.waiting_connections == 1, 5)
        idle3 = _connect(server.port)
        assert _closed(idle2)
        got = _read_all(answered)
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(body), len(got)
        assert not _closed(idle3, 0.1)
        for s in (answered, idle1, idle2, idle3):
            s.close()


def test_one_address_cannot_push_out_another() -> None:
    """A flood of unfinished requests from one address closes only its own: a slow client elsewhere finishes
    its request and is answered."""
    with _served(max_per_client=8, max_connections=64) as server:
        slow = _connect(server.port, "127.0.0.3")
        slow.sendall(b"GET /metrics HTTP/1.1\r\n")
        flood = [_connect(server.port, "127.0.0.2") for _ in range(100)]
        assert _wait(lambda: server.counts.evicted + server.counts.refused >= 92, 10), server.counts
        slow.sendall(b"Host: x\r\n\r\n")
        assert _read_all(slow).startswith(b"HTTP/1.1 200 OK")
        for s in [slow, *flood]:
            s.close()


def test_a_scraper_queued_with_a_flood_while_the_loop_was_held_up_is_answered() -> None:
    """The loop is held up (a scrape being rendered) while a scraper and then 60 clients that send nothing
    connect from one address, the per-address bound 8: all are accepted together once the loop runs again,
    and none of the idle ones can push the scraper out before it is read: it is answered."""
    entered, release = threading.Event(), threading.Event()

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ["PATH_INFO"] == "/hold":
            entered.set()
            release.wait(30)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"answer\n"]

    with _served(app, max_per_client=8) as server:
        holder = _connect(server.port)
        holder.sendall(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        assert entered.wait(10)
        scraper = _connect(server.port)
        scraper.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        flood = [_connect(server.port) for _ in range(60)]  # within the listen backlog of 64
        release.set()
        assert _read_all(scraper).endswith(b"answer\n")
        assert _read_all(holder).endswith(b"answer\n")
        assert _wait(lambda: server.counts.evicted + server.counts.refused >= 60 - 8, 10), server.counts
        for s in [holder, scraper, *flood]:
            s.close()


def test_oversized_and_malformed_requests() -> None:
    with _served() as server:
        s = _connect(server.port)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n")
        assert _read_all(s).startswith(b"HTTP/1.1 431 ")
        s.close()
        s = _connect(server.port)
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert _read_all(s).startswith(b"HTTP/1.1 400 ")
        s.close()
        assert server.counts.malformed == 2
        assert b"# HELP" in _scrape(server.port)


def test_methods_encodings_and_formats_as_prometheus_client_serves_them() -> None:
    server = Metrics("node-a").serve("127.0.0.1:0")
    url = f"http://127.0.0.1:{server.port}"
    try:
        plain = _scrape(server.port)
        assert b"# TYPE nodeagent_kube_api_requests" in plain
        assert gzip.decompress(_scrape(server.port, **{"Accept-Encoding": "gzip"})).startswith(b"# HELP")
        om = _scrape(server.port, Accept="application/openmetrics-text; version=1.0.0")
        assert om.endswith(b"# EOF\n")
        with urllib.request.urlopen(urllib.request.Request(url + "/", method="OPTIONS"), timeout=10) as r:
            assert r.status == 200 and r.headers["Allow"] == "OPTIONS,GET"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url + "/metrics", method="POST", data=b"x"), timeout=10)
        assert e.value.code == 405
        e.value.close()
        with urllib.request.urlopen(url + "/favicon.ico", timeout=10) as r:
            assert r.read() == b""
    finally:
        server.stop()


def test_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        server = Metrics("node-a").serve("[::1]:0")
    except OSError as e:
        pytest.skip(f"no IPv6 loopback: {e}")
    try:
        assert server.address[0] == "::1"
        assert b"# HELP" in _scrape(server.port, "[::1]")
    finally:
        server.stop()


def test_stop_closes_every_connection_and_joins_the_thread() -> None:
    server = Metrics("node-a").serve("127.0.0.1:0")
    idle = [_connect(server.port) for _ in range(20)]
    assert _wait(lambda: server.counts.served == 0 and server.open_connections == 20, 5)
    server.stop()
    assert not any(t.name == "metrics-http" for t in threading.enumerate())
    assert all(_closed(s) for s in idle)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5)
    for s in idle:
        s.close()
