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
import socket as _socket
import struct
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
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


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def serving_pid(socket: Path, timeout: float = 2.0) -> int | None:
    """The pid of the process listening on the unix ``socket``, if any: the kernel's credentials of the peer
    (SO_PEERCRED) of a connection to it. Unlike a listing of /proc/net/unix this works from another network
    namespace (a pod without hostNetwork that mounts the node's /run/containerd) and whatever path the
    socket is reached by (``/host/run/...``); the pid is in this process's pid namespace, 0 (``None`` here)
    when the listener is outside it (a pod without hostPID)."""
    try:
        with _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(socket))
            raw = s.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, _PEERCRED.size)
    except OSError:
        return None
    pid = _PEERCRED.unpack(raw)[0]
    return pid if pid > 0 else None


def newer_than_server(socket: Path, files: Iterable[Path]) -> Path | None:
    """The newest of ``files`` changed after the process serving ``socket`` started (it runs an older config:
    containerd reads its config only at start), or ``None`` when none is, or when nothing serves the socket or
    its start time cannot be read. Catches a config written by an earlier run whose restart failed."""
    pid = serving_pid(socket)
    if pid is None:
        return None
    import psutil

    try:
        started = psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None
    newest: tuple[float, Path] | None = None
    for f in files:
        try:
            mtime = os.stat(f).st_mtime
        except OSError:
            continue
        if mtime > started and (newest is None or mtime > newest[0]):
            newest = (mtime, f)
    return newest[1] if newest is not None else None


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
