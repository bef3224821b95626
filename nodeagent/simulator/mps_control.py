"""``nvidia-cuda-mps-control`` stand-in: the MPS control daemon and its client, for what nodeagent uses.

- ``-d`` starts the daemon in the background (the command returns once it listens), ``-f`` in the
  foreground. It reads ``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``) and
  ``CUDA_MPS_LOG_DIRECTORY`` (default ``/var/log/nvidia-mps``), listens on ``<pipe dir>/control`` and
  appends to ``<log dir>/control.log``; a second daemon on the same pipe directory refuses to start.
- Without arguments it is the client: each line of standard input is one command sent to the daemon,
  each answer printed; exit status 1 when no daemon listens.
- Commands: ``set_default_active_thread_percentage P``, ``get_default_active_thread_percentage``,
  ``set_default_device_pinned_mem_limit DEV LIMIT``, ``get_default_device_pinned_mem_limit DEV``,
  ``get_server_list``, ``quit``.

Against a shared simulator state (``NODEAGENT_SIM_STATE``, with ``NODEAGENT_SIM_MACHINE``) the daemon
refuses GPUs in a compute mode MPS cannot use (PROHIBITED, EXCLUSIVE_THREAD) and shows its server as a
process ``nvidia-cuda-mps-server`` on the GPUs of ``CUDA_VISIBLE_DEVICES`` (all GPUs when unset) until it
quits. The real daemon starts its server on the first client; this one starts it with the daemon.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nodeagent.simulator.state import SimStore

DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
DEFAULT_LOG_DIR = "/var/log/nvidia-mps"
SERVER_NAME = "nvidia-cuda-mps-server"
SERVER_USED_MIB = 256  # the context the server holds on each GPU
# NVML compute modes: DEFAULT 0, EXCLUSIVE_THREAD 1 (retired), PROHIBITED 2, EXCLUSIVE_PROCESS 3
REFUSED_COMPUTE_MODES = {1: "EXCLUSIVE_THREAD", 2: "PROHIBITED"}
MAX_LINE = 4096


def _dirs() -> tuple[Path, Path]:
    return (Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR),
            Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG_DIR))


class _Log:
    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "control.log"

    def __call__(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        with self.path.open("a") as f:
            f.write(f"[{stamp}.{int(time.time() * 1000) % 1000:03d} Control {os.getpid():6d}] {message}\n")


class _SimGpus:
    """The simulated GPUs this daemon serves (no state file: nothing to show, nothing to refuse)."""

    def __init__(self) -> None:
        self.store: SimStore | None = None
        self.indices: list[int] = []
        state = os.environ.get("NODEAGENT_SIM_STATE")
        if not state:
            return
        from nodeagent.simulator.state import SimStore

        self.store = SimStore.open(os.environ.get("NODEAGENT_SIM_MACHINE") or None, Path(state))
        gpus = self.store.read()["gpus"]
        uuids = [s.uuid for s in self.store.machine.gpus]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            self.indices = list(range(len(gpus)))
            return
        for ref in (r.strip() for r in visible.split(",") if r.strip()):
            if ref.isdigit() and int(ref) < len(gpus):
                self.indices.append(int(ref))
            elif ref in uuids:
                self.indices.append(uuids.index(ref))
            else:
                raise ValueError(f"CUDA_VISIBLE_DEVICES names no GPU of this machine: {ref}")

    def refused(self) -> str | None:
        if self.store is None:
            return None
        gpus = self.store.read()["gpus"]
        for i in self.indices:
            mode = int(gpus[i].get("compute_mode", 0))
            if mode in REFUSED_COMPUTE_MODES:
                return f"GPU {i} is in compute mode {REFUSED_COMPUTE_MODES[mode]}, which MPS cannot use"
        return None

    def show_server(self, pid: int, on: bool) -> None:
        if self.store is None:
            return
        with self.store.transaction() as st:
            for i in self.indices:
                procs = [p for p in st["gpus"][i]["processes"] if p["pid"] != pid]
                if on:
                    procs.append({"pid": pid, "name": SERVER_NAME, "used_mib": SERVER_USED_MIB, "gi_id": None})
                st["gpus"][i]["processes"] = procs


class _Daemon:
    def __init__(self, pipe_dir: Path, log: _Log, gpus: _SimGpus) -> None:
        self.pipe_dir = pipe_dir
        self.log = log
        self.gpus = gpus
        self.thread_percentage = "100.0"
        self.pinned: dict[str, str] = {}
        self.running = True

    def answer(self, line: str) -> str:
        words = line.split()
        if not words:
            return ""
        cmd, args = words[0], words[1:]
        self.log(f"Accepting command: {line}")
        if cmd == "set_default_active_thread_percentage" and len(args) == 1:
            try:
                value = float(args[0])
            except ValueError:
                return "Invalid value"
            if not 0 < value <= 100:
                return "Invalid value"
            self.thread_percentage = f"{value:.1f}"
            return self.thread_percentage
        if cmd == "get_default_active_thread_percentage" and not args:
            return self.thread_percentage
        if cmd == "set_default_device_pinned_mem_limit" and len(args) == 2:
            dev, limit = args
            if not dev.isdigit() or not limit[:-1].isdigit() or limit[-1] not in "MG":
                return "Invalid value"
            self.pinned[dev] = limit
            return ""
        if cmd == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return self.pinned.get(args[0], "0")
        if cmd == "get_server_list" and not args:
            return str(os.getpid()) if self.gpus.indices or self.gpus.store is None else ""
        if cmd == "quit" and not args:
            self.running = False
            return ""
        return f"Unrecognized command: {line}"

    def serve(self, listener: socket.socket) -> None:
        listener.settimeout(0.5)
        while self.running:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn, conn.makefile("rw", encoding="utf-8", newline="\n") as f:
                conn.settimeout(5.0)
                with contextlib.suppress(OSError):
                    for line in f:
                        f.write(self.answer(line.strip()[:MAX_LINE]) + "\n")
                        f.flush()


def _say(ready_fd: int | None, message: str) -> None:
    """An error at start: on stderr, or (``-d``) through the start pipe to the command the user ran."""
    if ready_fd is None:
        print(message, file=sys.stderr)
    else:
        os.write(ready_fd, b"0" + message.encode())


def _listen(pipe_dir: Path, log: _Log, ready_fd: int | None) -> socket.socket | None:
    pipe_dir.mkdir(parents=True, exist_ok=True)
    path = pipe_dir / "control"
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            log("An instance of this daemon is already running")
            _say(ready_fd, "An instance of this daemon is already running")
            return None
        except OSError:
            path.unlink()  # left by a daemon that died
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    return listener


def run_daemon(ready_fd: int | None = None) -> int:
    pipe_dir, log_dir = _dirs()
    log = _Log(log_dir)
    try:
        gpus = _SimGpus()
    except (ValueError, OSError) as e:
        log(f"Startup failed: {e}")
        _say(ready_fd, f"nvidia-cuda-mps-control: {e}")
        return 1
    refused = gpus.refused()
    if refused is not None:
        log(f"Startup failed: {refused}")
        _say(ready_fd, f"nvidia-cuda-mps-control: {refused}")
        return 1
    listener = _listen(pipe_dir, log, ready_fd)
    if listener is None:
        return 1
    daemon = _Daemon(pipe_dir, log, gpus)

    def stop(signum: int, frame: FrameType | None) -> None:
        daemon.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log(f"Starting control daemon using socket {pipe_dir / 'control'}")
    gpus.show_server(os.getpid(), True)
    log(f"Starting new server {os.getpid()} for user {os.getuid()}")
    if ready_fd is not None:
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    try:
        daemon.serve(listener)
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            (pipe_dir / "control").unlink()
        gpus.show_server(os.getpid(), False)
        log("Server exited; control daemon exiting")
    return 0


def _background() -> int:
    """``-d``: fork; the parent returns once the child listens (or has failed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # a daemon keeps none of the caller's terminals or pipes
            os.dup2(null, fd)
        os.close(null)
        code = run_daemon(w)
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        answer = f.read()
    if answer[:1] != b"1":
        if answer[1:]:
            print(answer[1:].decode(errors="replace"), file=sys.stderr)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) or 1
    return 0


def run_client(commands: list[str]) -> int:
    pipe_dir, _ = _dirs()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(pipe_dir / "control"))
    except OSError:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    with sock, sock.makefile("rw", encoding="utf-8", newline="\n") as f:
        sock.settimeout(10.0)
        for cmd in commands:
            f.write(cmd + "\n")
            f.flush()
            reply = f.readline()
            if not reply:
                return 1
            if reply.strip():
                print(reply.rstrip("\n"))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["-d"]:
        return _background()
    if args == ["-f"]:
        return run_daemon()
    if args:
        print("usage: nvidia-cuda-mps-control [-d | -f]", file=sys.stderr)
        return 1
    commands = [line.strip() for line in sys.stdin if line.strip()]
    return run_client(commands)


def install(path: Path) -> Path:
    """Write the stand-in command at ``path`` (a shell script running this module on this interpreter)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"#!/bin/sh\nexec '{sys.executable}' -m nodeagent.simulator.mps_control \"$@\"\n"
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    return path


if __name__ == "__main__":
    sys.exit(main())
