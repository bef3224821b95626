"""The metrics listener under idle and trickling clients: bounded threads, timeouts, scrapes still answered."""

from __future__ import annotations

import contextlib
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


def test_slowloris_clients_cannot_hold_the_slots() -> None:
    """MAX_CONNECTIONS clients each sending one header line every 3 s (the read timeout never fires) held every
    slot for as long as they liked. Now the whole request has one deadline, and while they hold the slots a
    scrape takes the slot of the slowest of them: every scrape is answered, every trickler is cut off."""
    server = Metrics("node-a").serve("127.0.0.1:0")
    tricklers: list[socket.socket] = []
    stop = threading.Event()
    try:
        for _ in range(MAX_CONNECTIONS):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            tricklers.append(s)

        def trickle() -> None:
            n = 0
            while not stop.wait(3.0):
                n += 1
                for s in tricklers:
                    with contextlib.suppress(OSError):  # cut off by the server: as it should be
                        s.sendall(f"X-Slow-{n}: 1\r\n".encode())

        feeder = threading.Thread(target=trickle, daemon=True)
        feeder.start()
        time.sleep(1.5)  # every slot is taken by a trickler by now
        answered, started = 0, time.monotonic()
        latencies: list[float] = []
        while time.monotonic() - started < 7.0:
            t0 = time.monotonic()
            assert b"# HELP" in _scrape(server.port)
            latencies.append(time.monotonic() - t0)
            answered += 1
            time.sleep(0.5)
        assert answered >= 10 and max(latencies) < 2.0, latencies
        # none of the tricklers is still connected 8.5 s after it connected (the request deadline is 5 s)
        cut = 0
        for s in tricklers:
            s.settimeout(0.5)
            try:
                cut += s.recv(1) == b""
            except ConnectionResetError:
                cut += 1
            except TimeoutError:
                pass
        assert cut == MAX_CONNECTIONS
    finally:
        stop.set()
        for s in tricklers:
            s.close()
        server.stop()
