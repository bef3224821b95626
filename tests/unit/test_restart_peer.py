"""Which process serves containerd's socket (SO_PEERCRED), and whether it started before its config was
written: a real listening Unix socket of this process stands in for containerd."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.runtime.restart import newer_than_server, serving_pid


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "run/containerd/containerd.sock"
    path.parent.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        s.listen(4)
        yield path


def test_the_listener_is_found_by_any_path_that_reaches_the_socket(listening: Path, tmp_path: Path) -> None:
    assert serving_pid(listening) == os.getpid()
    # the node's /run reached through a mount-like other path (a pod's /host/run): same answer
    (tmp_path / "host").mkdir()
    (tmp_path / "host/run").symlink_to(tmp_path / "run")
    assert serving_pid(tmp_path / "host/run/containerd/containerd.sock") == os.getpid()


def test_no_listener_no_pid(tmp_path: Path) -> None:
    assert serving_pid(tmp_path / "absent.sock") is None
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))  # bound, never listening: connection refused
    assert serving_pid(stale) is None
    assert newer_than_server(stale, [stale]) is None


def test_a_config_written_after_the_server_started_is_named(listening: Path, tmp_path: Path) -> None:
    config = tmp_path / "etc/containerd/config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("version = 3\n")
    dropin = tmp_path / "etc/containerd/conf.d/99-nvidia.toml"
    dropin.parent.mkdir()
    dropin.write_text("")
    os.utime(dropin, (0, 0))  # written long before this process started
    assert newer_than_server(listening, [dropin, config, tmp_path / "missing.toml"]) == config
    os.utime(config, (0, 0))
    assert newer_than_server(listening, [dropin, config]) is None
