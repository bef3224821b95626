"""Start the real ``nodeagent run`` process for end-to-end tests and listen on its NOTIFY_SOCKET."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent.kube.client import KubeClient, connect
from nodeagent.kube.gpuobjects import install_crd
from tests.peers.apiserver import KubeApiServer
from tests.peers.harness import KubeletHarness

REPO = Path(__file__).resolve().parents[2]


def eventually(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``cond`` every 0.1 s until it returns something truthy and return that; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.1)


def fresh_node_with_gpu_crd(server: KubeApiServer, name: str) -> None:
    """The GPU CRD installed and Node ``name`` created anew (one left by an earlier run deleted first)."""
    kube = KubeClient(connect(server.kubeconfig))
    try:
        install_crd(kube)
    finally:
        kube.close()
    server.request("DELETE", f"/api/v1/nodes/{name}")
    status, body = server.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                            "metadata": {"name": name}})
    assert status == 201, body


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    notify: socket.socket
    log_path: Path
    messages: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def poll_notify(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.notify.recv(65536).decode())
            except BlockingIOError:
                return self.messages

    def wait_notify(self, prefix: str, timeout: float = 15.0, after: int = 0) -> str:
        """The first datagram (from index ``after``) starting with ``prefix``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.poll_notify()[after:]:
                if m.startswith(prefix):
                    return m
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode} before {prefix!r}:\n{self.log()}")
            time.sleep(0.02)
        raise AssertionError(f"no {prefix!r} on NOTIFY_SOCKET within {timeout}s; got {self.messages}\n{self.log()}")

    def send(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 5.0) -> tuple[int, float]:
        """Send ``sig``; the exit code and how long the exit took."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired as e:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"agent did not exit within {timeout}s of {sig.name}:\n{self.log()}") from e
        return code, time.monotonic() - t0

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/task"))


# In the arguments of ``running_agent``: the agent's root (``--sim-state {root}/sim.json``: the simulated node's
# state lies inside its root), for arguments made before ``node_root`` made the root.
ROOT = "{root}"


@contextmanager
def node_root(harness: KubeletHarness | None = None, *, sim_state: Path | None = None) -> Iterator[Path]:
    """A throw-away host root for ``--root``: the agent's state, config and containerd files stay inside it.

    With a kubelet harness the root is the harness's own directory, and ``/var/lib/kubelet`` under it is a
    relative symlink to the root itself, so the agent finds the real device manager at its default
    ``/var/lib/kubelet/device-plugins`` (``--root`` confines every path, symlinks included, to the root: a
    link to a directory outside it would be read as a path inside). The harness serves PodResources at
    ``/var/lib/kubelet/pod-resources.sock`` (set ``kubelet.pod_resources_socket`` to that host path). The root
    is a short path under the system temp directory: unix socket paths below it must stay within the
    kernel's 108 bytes. ``sim_state``: a simulator state prepared before the root, copied to ``sim.json`` in
    it (the simulated node's state lies inside its root).
    """
    if harness is not None:
        if sim_state is not None:
            shutil.copyfile(sim_state, harness.workdir / "sim.json")
        assert harness.plugin_dir.parent == harness.workdir and harness.pod_resources_socket.parent == harness.workdir
        root = harness.workdir
        (root / "var/lib").mkdir(parents=True, exist_ok=True)
        if not (root / "var/lib/kubelet").is_symlink():
            (root / "var/lib/kubelet").symlink_to("../..", target_is_directory=True)
        yield root  # removed with the harness's directory
        return
    root = Path(tempfile.mkdtemp(prefix="na-root-"))
    try:
        if sim_state is not None:
            shutil.copyfile(sim_state, root / "sim.json")
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def running_agent(workdir: Path, root: Path, args: Sequence[str],
                  env: dict[str, str] | None = None, *, metrics: str | None = "") -> Iterator[Agent]:
    """``python -m nodeagent --root ROOT <args>`` with a fresh NOTIFY_SOCKET; killed at the end if still
    running. A root is required so that no test writes to the host's /var/lib/nodeagent or /etc.

    ``metrics`` becomes ``run --metrics-address`` (which overrides the config file): "" (the default here)
    turns the listener off, because the agent's own default 127.0.0.1:9400 is one port shared by every
    agent that tests (and other sessions on this machine) start at once; a test that checks metrics gives
    its own free port, and None leaves the address to the config file and the built-in default. ``ROOT`` in an
    argument is replaced by the root."""
    args = [a.replace(ROOT, str(root)) for a in args]  # a path under the root, for arguments made before it
    if metrics is not None and args and args[0] == "run" and not any(a.startswith("--metrics-address")
                                                                       for a in args):
        args = [*args, f"--metrics-address={metrics}"]
    notify_path = workdir / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.setblocking(False)
    log_path = workdir / "agent.log"
    full_env = {**os.environ, "NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "2000000",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("NODE_NAME", None)
    with log_path.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "nodeagent", "--root", str(root), *args], stdout=out, stderr=subprocess.STDOUT,
                                env=full_env, cwd=REPO)
    agent = Agent(proc, notify, log_path)
    try:
        yield agent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
