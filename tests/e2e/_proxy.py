"""A loopback TCP forwarder the tests switch off and on to cut the agent off from the API server, or slow down."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
import urllib.parse
from pathlib import Path

import yaml


class Outage:
    """Forwards 127.0.0.1:<port> to ``target``; ``cut()`` drops every connection and refuses new ones;
    ``latency_s`` holds each piece of the answers back that long (a slow API server)."""

    def __init__(self, target: tuple[str, int], *, latency_s: float = 0.0) -> None:
        self.target = target
        self.latency_s = latency_s
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        t = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        t.start()
        self._threads.append(t)

    def cut(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns |= {client, upstream}
            t = threading.Thread(target=self._pump, args=(client, upstream), daemon=True)
            t.start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        try:
            sel.register(a, selectors.EVENT_READ, b)
            sel.register(b, selectors.EVENT_READ, a)
            while True:
                for key, _ in sel.select(timeout=1.0):
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = src.recv(65536)
                    if not data:
                        return
                    if src is b and self.latency_s:
                        time.sleep(self.latency_s)
                    key.data.sendall(data)
        except (OSError, ValueError):
            return
        finally:
            sel.close()
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                self._conns -= {a, b}


def forwarded(url: str, kubeconfig: Path, dest: Path, *, latency_s: float = 0.0) -> Outage:
    """An ``Outage`` forwarder to the API server at ``url``, running, and at ``dest`` a copy of ``kubeconfig``
    whose clusters reach the server through it."""
    parts = urllib.parse.urlsplit(url)
    forwarder = Outage((parts.hostname or "127.0.0.1", parts.port or 443), latency_s=latency_s)
    forwarder.restore()
    doc = yaml.safe_load(kubeconfig.read_text())
    for c in doc["clusters"]:
        c["cluster"]["server"] = f"https://{parts.hostname}:{forwarder.port}"
    dest.write_text(yaml.safe_dump(doc))
    return forwarder
