"""Hostile clients of the metrics endpoint and a scraper to measure it by; shared by
tests/e2e/test_run_metrics_flood.py and tests/bench/bench_metrics.py.

Three loads, each from plain blocking sockets on threads of its own, each a context manager that starts its
clients on entry and closes every socket on exit:

- ``Trickle``: a steady stream of new connections, each sending ``GET /metrics HTTP/1.1\\r\\nX-a: `` and
  never the rest, every one kept open;
- ``IdleFlood``: thousands of connections that send nothing, opened at once from many loopback addresses
  (127.0.0.0/8 is all loopback on Linux) and kept open (those the server closes stay closed);
- ``SlowHeaders``: clients each sending one more header line every second and never the blank line,
  connecting again when cut off.
"""

from __future__ import annotations

import contextlib
import resource
import selectors
import socket
import statistics
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from prometheus_client.parser import text_string_to_metric_families

HALF_REQUEST = b"GET /metrics HTTP/1.1\r\nX-a: "
L = TypeVar("L", bound="_Load")


def raise_fd_limit(need: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE to at least ``need`` (as far as the hard limit allows)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def _connect(port: int, source: str, timeout: float = 5.0) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))
    except OSError:
        return None


class _Load:
    name = "load"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.connected = 0

    def _keep(self, s: socket.socket) -> None:
        with self._lock:
            self.socks.append(s)
            self.connected += 1

    def _spawn(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name=f"{self.name}-load", daemon=True)
        t.start()
        self._threads.append(t)

    def __enter__(self: L) -> L:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        with self._lock:
            for s in self.socks:
                s.close()
            self.socks.clear()


class Trickle(_Load):
    """``rate`` new half-sent requests a second from ``source``, each connection kept open."""

    name = "trickle"

    def __init__(self, port: int, rate: float = 100.0, source: str = "127.0.0.1") -> None:
        super().__init__()
        self.rate = rate
        self._spawn(self._run, port, source)

    def _run(self, port: int, source: str) -> None:
        start = time.monotonic()
        n = 0
        while not self._stop.is_set():
            s = _connect(port, source)
            if s is not None:
                with contextlib.suppress(OSError):
                    s.sendall(HALF_REQUEST)
                self._keep(s)
            n += 1
            self._stop.wait(max(0.0, start + n / self.rate - time.monotonic()))


class IdleFlood(_Load):
    """``count`` connections that send nothing, from ``sources`` loopback addresses 127.0.2.1 onwards, begun
    ``rate`` a second in steps of a tenth of a second (``rate`` 0: all at once), non-blocking, so that the
    kernel's retries of handshakes that met a full listen queue run side by side; ``opened`` is set once each
    has connected or failed."""

    name = "idle"

    def __init__(self, port: int, count: int = 3000, sources: int = 100, rate: float = 0.0,
                 timeout: float = 30.0) -> None:
        super().__init__()
        self.opened = threading.Event()
        self.failed = 0
        self._spawn(self._run, port, [f"127.0.2.{1 + i % sources}" for i in range(count)], rate, timeout)

    def _begin(self, sel: selectors.BaseSelector, port: int, source: str) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((source, 0))
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            sel.register(s, selectors.EVENT_WRITE)
        except OSError:
            s.close()
            self.failed += 1

    def _run(self, port: int, sources: list[str], rate: float, timeout: float) -> None:
        step = max(1, round(rate / 10)) if rate > 0 else len(sources)
        with selectors.DefaultSelector() as sel:
            start = time.monotonic()
            end = start + timeout
            begun = 0
            while (begun < len(sources) or sel.get_map()) and not self._stop.is_set() and time.monotonic() < end:
                if begun < len(sources) and time.monotonic() >= start + begun / (rate or float("inf")):
                    for source in sources[begun:begun + step]:
                        self._begin(sel, port, source)
                    begun += step
                for key, _ in sel.select(0.02):
                    s = cast(socket.socket, key.fileobj)
                    sel.unregister(s)
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        self._keep(s)
                    else:
                        s.close()
                        self.failed += 1
            for key in list(sel.get_map().values()):
                cast(socket.socket, key.fileobj).close()
                self.failed += 1
        self.opened.set()


class SlowHeaders(_Load):
    """``clients`` clients (127.0.3.1 onwards), each sending the request line and then one header line a
    second, never the blank line; a client cut off connects again."""

    name = "slow"

    def __init__(self, port: int, clients: int = 40) -> None:
        super().__init__()
        self.reconnects = 0
        self._spawn(self._run, port, [f"127.0.3.{1 + i}" for i in range(clients)])

    def _open(self, port: int, source: str) -> socket.socket | None:
        s = _connect(port, source)
        if s is None:
            return None
        try:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        except OSError:
            s.close()
            return None
        self._keep(s)
        return s

    def _run(self, port: int, sources: list[str]) -> None:
        clients: dict[str, socket.socket | None] = {src: self._open(port, src) for src in sources}
        n = 0
        while not self._stop.wait(1.0):
            n += 1
            for src, s in clients.items():
                if s is not None:
                    try:
                        s.sendall(f"X-Slow-{n}: {n}\r\n".encode())
                        continue
                    except OSError:
                        pass
                self.reconnects += 1
                clients[src] = self._open(port, src)


@dataclass
class Scrape:
    ok: bool
    seconds: float
    why: str = ""


@dataclass
class Scrapes:
    results: list[Scrape] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return sum(r.ok for r in self.results)

    def failures(self) -> list[str]:
        return [r.why for r in self.results if not r.ok]

    def latency_ms(self) -> dict[str, float]:
        """p50 and p99 of the answered scrapes, in ms."""
        ok = sorted(r.seconds for r in self.results if r.ok)
        if not ok:
            return {"p50_ms": float("nan"), "p99_ms": float("nan")}
        p99 = ok[min(len(ok) - 1, round(0.99 * (len(ok) - 1)))]
        return {"p50_ms": round(statistics.median(ok) * 1000, 1), "p99_ms": round(p99 * 1000, 1)}

    def summary(self) -> dict[str, Any]:
        return {"scrapes": len(self.results), "answered": self.answered, **self.latency_ms()}


def scrape_once(port: int, metric: str, timeout: float = 15.0) -> Scrape:
    """One GET /metrics: answered means a 200 whose whole body (its Content-Length) parses as the text
    exposition format and holds at least one sample of ``metric``."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
            body = r.read()
            status = r.status
        took = time.monotonic() - t0
        if status != 200:
            return Scrape(False, took, f"status {status}")
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    except Exception as e:  # the scraper's view: any failure is a scrape lost
        return Scrape(False, time.monotonic() - t0, f"{type(e).__name__}: {e}"[:200])
    if metric not in families or not families[metric].samples:
        return Scrape(False, took, f"no {metric} in {len(body)} bytes")
    return Scrape(True, took)


def scrape_many(port: int, n: int, metric: str, interval: float = 0.1) -> Scrapes:
    out = Scrapes()
    for _ in range(n):
        out.results.append(scrape_once(port, metric))
        time.sleep(interval)
    return out
