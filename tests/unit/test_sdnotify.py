"""sd_notify: real datagrams over a Unix socket, path and abstract namespace."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.sdnotify import Notifier


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    s.bind(path)
    s.settimeout(2)
    yield s, path
    s.close()


def test_no_socket_is_a_noop() -> None:
    n = Notifier({})
    assert not n.enabled
    assert n.ready() is False
    assert n.watchdog_interval is None


def test_ready_status_watchdog_stopping(listener: tuple[socket.socket, str]) -> None:
    s, path = listener
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000"})
    assert n.watchdog_interval == 5.0
    assert n.ready("serving 8 GPUs")
    assert s.recv(4096) == b"READY=1\nSTATUS=serving 8 GPUs"
    n.status("resync")
    assert s.recv(4096) == b"STATUS=resync"
    n.watchdog()
    assert s.recv(4096) == b"WATCHDOG=1"
    n.stopping()
    assert s.recv(4096) == b"STOPPING=1"
    n.close()


def test_abstract_namespace() -> None:
    name = f"nodeagent-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(b"\0" + name.encode())
    s.settimeout(2)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.ready()
        assert s.recv(4096) == b"READY=1"
        n.close()
    finally:
        s.close()


def test_watchdog_for_another_pid_is_ignored(listener: tuple[socket.socket, str]) -> None:
    _, path = listener
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"})
    assert n.watchdog_interval is None


def test_send_failure_is_not_raised(tmp_path: Path) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert n.enabled
    assert n.ready() is False
    n.close()


def test_a_receiver_that_stops_reading_never_blocks(tmp_path: Path) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "full.sock")
    s.bind(path)
    try:
        n = Notifier({"NOTIFY_SOCKET": path})
        results = [n.status("x" * 1000) for _ in range(2000)]  # far more than the socket buffer holds
        assert results[0] is True
        assert results[-1] is False
        n.close()
    finally:
        s.close()
