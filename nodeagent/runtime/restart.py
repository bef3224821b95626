"""Restart containerd after a config change and wait until it answers again.

containerd does not reload its config on SIGHUP; a change needs a new process. Modes:
``systemd`` runs ``systemctl restart containerd``; ``signal`` sends SIGTERM to the process serving the
socket and relies on its supervisor (k3s, rke2, a container entrypoint loop) to start it again;
``none`` leaves it to the caller. Either way "back" means a new process answers a gRPC Version call
on the socket within the timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from nodeagent.errors import RestartError

if TYPE_CHECKING:
    from nodeagent.grpcadapter.client import Failure

RestartMode = Literal["systemd", "signal", "none"]
RESTART_MODES: tuple[RestartMode, ...] = ("systemd", "signal", "none")
DEFAULT_SOCKET = "/run/containerd/containerd.sock"
_VERSION_METHOD = "/containerd.services.version.v1.Version/Version"

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120, check=False)


def answers(socket: Path, timeout: float = 2.0) -> bool:
    """Whether containerd answers its Version RPC on ``socket``."""
    if not socket.exists():
        return False
    # gRPC only when there is a socket to ask: `runtime configure/show` under a --root pay nothing for it
    from nodeagent.grpcadapter.client import call, open_channel, raw_method

    def not_answering(failure: Failure) -> RestartError:
        return RestartError(f"containerd on {socket}: {failure.code}: {failure.details}", subject=str(socket))

    with open_channel(socket) as channel:
        try:
            call(raw_method(channel, _VERSION_METHOD), b"", timeout=timeout, error=not_answering)
        except RestartError:
            return False
    return True


def serving_pid(socket: Path) -> int | None:
    """The pid of the process listening on the unix ``socket``, if any."""
    import psutil

    want = str(socket)
    for conn in psutil.net_connections(kind="unix"):
        if str(conn.laddr) == want and conn.pid is not None and conn.status in ("NONE", psutil.CONN_LISTEN):
            return conn.pid
    return None


def wait_ready(socket: Path, timeout: float, *, old_pid: int | None = None, poll: float = 0.2) -> float:
    """Block until a process other than ``old_pid`` answers on ``socket``; return the seconds waited."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        if answers(socket, timeout=min(2.0, max(0.1, deadline - time.monotonic()))) and (
            old_pid is None or serving_pid(socket) not in (old_pid, None)
        ):
            return time.monotonic() - start
        if time.monotonic() >= deadline:
            raise RestartError(
                f"containerd did not answer on {socket} within {timeout:g}s after the restart; "
                "check `journalctl -u containerd` (the config backup sits next to the file)",
                subject=str(socket),
                retryable=True,
            )
        time.sleep(poll)


def restart_containerd(
    mode: RestartMode,
    socket: Path,
    *,
    timeout: float = 60.0,
    runner: Runner = _run,
    unit: str = "containerd",
) -> float | None:
    """Restart containerd by ``mode`` and wait for it; seconds until it answered, ``None`` for ``none``."""
    if mode == "none":
        return None
    old_pid = serving_pid(socket)
    if mode == "systemd":
        try:
            done = runner(["systemctl", "restart", unit])
        except (OSError, subprocess.SubprocessError) as e:
            raise RestartError(f"systemctl restart {unit} failed: {e}", subject=unit) from e
        if done.returncode != 0:
            msg = (done.stderr or done.stdout).strip().splitlines()
            raise RestartError(
                f"systemctl restart {unit} exited {done.returncode}: {msg[-1] if msg else ''}".rstrip(": "),
                subject=unit,
            )
        # systemctl waits for the new process; the old pid may legitimately be reused only in theory.
        return wait_ready(socket, timeout)
    if mode == "signal":
        if old_pid is None:
            raise RestartError(
                f"no process is serving {socket}; cannot signal containerd", subject=str(socket)
            )
        with contextlib.suppress(ProcessLookupError):
            os.kill(old_pid, signal.SIGTERM)
        return wait_ready(socket, timeout, old_pid=old_pid)
    raise RestartError(f"unknown restart mode {mode!r} (systemd, signal, none)")
