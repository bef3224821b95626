"""Restarting the real containerd and waiting for it on its socket."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from nodeagent.errors import RestartError
from nodeagent.runtime.restart import answers, restart_containerd, serving_pid, wait_ready
from tests.peers.containerd import Containerd

pytestmark = pytest.mark.peers
CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "containerd" / "containerd-1.7-systemd.toml"


@pytest.fixture
def supervised(containerd: Containerd, tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """containerd under a restart loop (what k3s or an entrypoint script does); yields (socket, loop)."""
    first = containerd.start(CONFIG)  # the fixture rewrites root/state/sockets into a temp dir
    config, socket = first.config, first.address
    first.stop()
    loop = subprocess.Popen(
        ["sh", "-c", f'while :; do "{containerd.binary}" --config "{config}" >>"{tmp_path}/log" 2>&1; '
                     "sleep 0.1; done"],
        start_new_session=True,
    )
    try:
        wait_ready(socket, 30)
        yield socket, loop
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(loop.pid, signal.SIGKILL)  # the loop and the containerd it started
        loop.wait()
        pid = serving_pid(socket)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_signal_restart_waits_for_a_new_process(supervised: tuple[Path, subprocess.Popen[bytes]]) -> None:
    socket, loop = supervised
    old = serving_pid(socket)
    assert old is not None and answers(socket)
    took = restart_containerd("signal", socket, timeout=30)
    assert took is not None and took >= 0
    new = serving_pid(socket)
    assert new is not None and new != old
    # without the supervisor (the loop shell only; containerd keeps running) nobody brings it back
    os.kill(loop.pid, signal.SIGKILL)
    loop.wait()
    t0 = time.monotonic()
    with pytest.raises(RestartError, match=r"did not answer on .* within 1\.5s"):
        restart_containerd("signal", socket, timeout=1.5)
    assert time.monotonic() - t0 < 10


def test_systemd_mode_runs_systemctl_then_waits(supervised: tuple[Path, subprocess.Popen[bytes]]) -> None:
    socket, _ = supervised
    calls: list[list[str]] = []

    def runner(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        calls.append(list(cmd))
        return subprocess.CompletedProcess(list(cmd), 0, "", "")

    assert restart_containerd("systemd", socket, timeout=10, runner=runner) is not None
    assert calls == [["systemctl", "restart", "containerd"]]

    def failing(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(list(cmd), 5, "", "Failed to restart containerd.service: Unit not found.\n")

    with pytest.raises(RestartError, match=r"exited 5: Failed to restart containerd\.service: Unit not found\."):
        restart_containerd("systemd", socket, runner=failing)


def test_none_mode_and_missing_socket(tmp_path: Path) -> None:
    sock = tmp_path / "nothing.sock"
    assert restart_containerd("none", sock) is None
    assert not answers(sock)
    with pytest.raises(RestartError, match="no process is serving"):
        restart_containerd("signal", sock, timeout=0.5)
    with pytest.raises(RestartError, match=r"within 0\.3s"):
        wait_ready(sock, 0.3)
