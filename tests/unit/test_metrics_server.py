"""The metrics listener under idle and trickling clients: bounded threads, timeouts, scrapes still answered."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

from nodeagent.metrics import MAX_CONNECTIONS, Metrics


def _scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body: bytes = resp.read()
        return body


def _wait(cond: object, timeout: float) -> bool:
    assert callable(cond)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def test_idle_connections_cannot_pile_up_threads() -> None:
    """3,000 idle connections made 3,016 threads; now at most MAX_CONNECTIONS serve at once and the rest are
    closed, and a scrape is answered again once the idle ones time out."""
    server = Metrics("node-a").serve("127.0.0.1:0")
    base = threading.active_count()
    idle: list[socket.socket] = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            idle.append(s)
        _wait(lambda: threading.active_count() >= base + MAX_CONNECTIONS, 5)
        time.sleep(0.5)
        assert threading.active_count() <= base + MAX_CONNECTIONS + 1
        # the connections beyond the limit were closed by the server: reading gives EOF at once
        closed = 0
        for s in idle[-50:]:
            s.settimeout(5)
            try:
                if s.recv(1) == b"":
                    closed += 1
            except OSError:
                closed += 1
        assert closed == 50
        # the idle ones holding a slot are dropped after the connection timeout, then scrapes work
        assert _wait(lambda: threading.active_count() <= base + 1, 15)
        assert b"nodeagent_kube_api_requests" in _scrape(server.port) or b"# HELP" in _scrape(server.port)
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
