"""``nodeagent doctor`` beside a real ``nodeagent run`` in a sandbox, with nothing faked under the root: the
simulator's sandbox has a /proc of its own files only, so doctor tells its agent by the record's lock and
takes what the agent sees from its record. One agent in the simulator's default sandbox (no --root, as the
README's first commands) serves every case but the last, which needs another device plugin there before the
agent starts: its own agent recognised (its pid, its socket), an XID it holds, a registration a kubelet
took, a kill -9; and the agent
waiting beside another device plugin that holds its socket name."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from nodeagent.agentrecord import RECORD, AgentRecord, read_record
from nodeagent.deviceplugin.api import pb2, pb2_grpc
from nodeagent.errors import NodeAgentError
from nodeagent.hostpaths import HostPaths
from tests.e2e._agent import REPO, eventually
from tests.e2e.test_doctor import _one
from tests.peers.sampleplugin import SampleDevicePlugin

T4_UUID = "GPU-9b546366-b804-5789-91a6-2ff95c0d0aa5"  # the simulated t4x1's GPU


@dataclass
class Sandbox:
    base: Path
    env: dict[str, str]
    state: Path
    agent: subprocess.Popen[bytes]

    def na(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nodeagent", *args], cwd=self.base, env=self.env,
                              capture_output=True, text=True, timeout=120, check=False)

    def doctor(self, *args: str) -> list[dict[str, Any]]:
        r = self.na("doctor", "--json", *args)
        assert r.returncode in (0, 1, 2) and "Traceback" not in r.stderr, r.stderr
        findings: list[dict[str, Any]] = json.loads(r.stdout)["findings"]
        return findings


def _start(base: Path, args: list[str]) -> Sandbox:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NODEAGENT_", "KUBERNETES_", "KUBECONFIG"))}
    env.update(HOME=str(base / "home"), XDG_RUNTIME_DIR=str(base / "xdg"), PYTHONPATH=str(REPO))
    env.pop("NODE_NAME", None)
    state = base / "t4.json"
    log = (base / "agent.log").open("wb")
    agent = subprocess.Popen([sys.executable, "-m", "nodeagent", *args, "run", "--simulate", "t4x1", "--sim-state",
                              str(state), "--no-kube", "--metrics-address="], cwd=base, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
    log.close()
    return Sandbox(base, env, state, agent)


def _recorded(paths: HostPaths, agent: subprocess.Popen[bytes], what: str, cond: Any) -> AgentRecord:
    def ready() -> AgentRecord | None:
        assert agent.poll() is None, f"the agent exited {agent.returncode}"
        try:
            record = read_record(paths)
        except NodeAgentError:  # (what the agent replaces at its start)
            return None
        return record if record is not None and record.pid == agent.pid and cond(record) else None

    found: AgentRecord = eventually(ready, 30, what)
    return found


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    base = Path(tempfile.mkdtemp(prefix="nadr-", dir="/tmp"))  # short: sockets live below it
    box = _start(base, [])
    try:
        yield box
    finally:
        if box.agent.poll() is None:
            box.agent.kill()
        box.agent.wait()
        shutil.rmtree(base, ignore_errors=True)


def _paths(box: Sandbox) -> HostPaths:
    # the default sandbox of a command given the state file: named after that file, whatever --simulate says
    return HostPaths(Path(box.env["XDG_RUNTIME_DIR"]) / "nodeagent-sim" / "state-t4")


def test_doctor_knows_its_own_agent_in_the_default_sandbox(sandbox: Sandbox) -> None:
    root = _paths(sandbox).root
    _recorded(_paths(sandbox), sandbox.agent, "the agent's socket and why it is not registered in its record",
              lambda r: r.resources and r.resources[0].why)
    pid = sandbox.agent.pid
    assert not (root / "proc" / str(pid)).exists()  # the sandbox's /proc has the simulator's files only
    findings = sandbox.doctor("--simulate", "t4x1", "--sim-state", str(sandbox.state), "--no-kube")
    _one(findings, "agent", "ok", f"nodeagent run is running (pid {pid}), started 20")
    assert not [f for f in findings if "another device plugin" in f["text"] or "nodeagent run is not running" in f["text"]], findings
    _one(findings, "kubelet", "ok", "nvidia.com/gpu (/var/lib/kubelet/device-plugins/nvidia-gpu.sock) is not "
         f"registered with the kubelet by the running agent (pid {pid}): {root}/var/lib/kubelet/device-plugins/"
         "kubelet.sock does not exist")
    _one(findings, "health", "ok", "the agent serves every GPU as Healthy (no XID held)")


def test_an_xid_the_running_agent_holds_is_the_nodes_health(sandbox: Sandbox) -> None:
    r = sandbox.na("sim", "inject", "xid", "--sim-state", str(sandbox.state), "--gpu", "0", "--code", "48")
    assert r.returncode == 0, r.stderr
    _recorded(_paths(sandbox), sandbox.agent, "the XID in the agent's record", lambda r: r.unhealthy)
    findings = sandbox.doctor("--sim-state", str(sandbox.state), "--no-kube")  # the state file names the sandbox
    held = _one(findings, "health", "error", "GPU 0 is served Unhealthy to the kubelet after XID 48")
    assert held["fix"] == ""
    assert not [f for f in findings if "serves every GPU as Healthy" in f["text"]], findings


class Kubelet:
    """The kubelet's Registration service, taking every registration."""

    def Register(self, request: Any, context: Any) -> Any:
        return pb2.Empty()


def test_a_registration_the_kubelet_took(sandbox: Sandbox) -> None:
    """A kubelet comes up: the agent registers, its record says so, doctor tells the resource registered by it."""
    root = _paths(sandbox).root
    kubelet = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb2_grpc.add_RegistrationServicer_to_server(Kubelet(), kubelet)
    kubelet.add_insecure_port(f"unix://{root}/var/lib/kubelet/device-plugins/kubelet.sock")
    kubelet.start()
    try:
        _recorded(_paths(sandbox), sandbox.agent, "the registration in the agent's record",
                  lambda r: r.resources and r.resources[0].registered)
        findings = sandbox.doctor("--simulate", "t4x1", "--sim-state", str(sandbox.state), "--no-kube")
    finally:
        kubelet.stop(None)
    _one(findings, "kubelet", "ok", "nvidia.com/gpu: served on /var/lib/kubelet/device-plugins/nvidia-gpu.sock by the "
         f"running agent (pid {sandbox.agent.pid}), registered with the kubelet")
    assert not [f for f in findings if "not registered" in f["text"] or "no GPU resource registered" in f["text"]]


def test_a_killed_agent_is_not_running_and_what_it_held_is_history(sandbox: Sandbox) -> None:
    pid = sandbox.agent.pid
    sandbox.agent.send_signal(signal.SIGKILL)
    sandbox.agent.wait()
    findings = sandbox.doctor("--simulate", "t4x1", "--sim-state", str(sandbox.state), "--no-kube")
    _one(findings, "agent", "warning", f"nodeagent run is not running on this host; the last one (pid {pid}, "
         "started 20")
    assert not [f for f in findings if "served Unhealthy" in f["text"] or "running agent" in f["text"]], findings


def test_the_agent_waiting_beside_another_device_plugin_on_its_socket() -> None:
    """Another device plugin holds nvidia-gpu.sock (not registered with the kubelet yet) and the agent rightly
    waits: doctor names that plugin and why the agent does not register, and says the agent runs. A link loop at
the record's name is replaced with one warning."""
    base = Path(tempfile.mkdtemp(prefix="nadr-", dir="/tmp"))
    root = base / "node"
    plugins = root / "var/lib/kubelet/device-plugins"
    plugins.mkdir(parents=True)
    kubelet = socket.socket(socket.AF_UNIX)
    kubelet.bind(str(plugins / "kubelet.sock"))
    kubelet.listen()
    other = SampleDevicePlugin(plugins, "nvidia.com/gpu", {T4_UUID: "Healthy"}, socket_name="nvidia-gpu.sock")
    other.start()
    # and a link loop where the agent keeps its record: its own file never stops it (it made run exit 2)
    record = root / RECORD.lstrip("/")
    record.parent.mkdir(parents=True)
    record.symlink_to(record.name)
    box = _start(base, ["--root", str(root)])
    try:
        _recorded(HostPaths(root), box.agent, "the conflict and the waiting resource in the agent's record",
                  lambda r: r.conflicts and r.resources and r.resources[0].why)
        findings = box.doctor("--root", str(root), "--simulate", "t4x1", "--no-kube")
        log = (base / "agent.log").read_text()
    finally:
        box.agent.kill()
        box.agent.wait()
        other.stop()
        kubelet.close()
        shutil.rmtree(base, ignore_errors=True)
    pid = box.agent.pid
    found = _one(findings, "kubelet", "warning", f"another device plugin serves nvidia.com/gpu on nvidia-gpu.sock "
                 f"(pid {os.getpid()})")
    assert found["text"].endswith(f"(found by the running agent, pid {pid})"), found
    assert "[adopt] take_over = true" in found["fix"]
    waiting = _one(findings, "kubelet", "warning", "nvidia.com/gpu (/var/lib/kubelet/device-plugins/nvidia-gpu.sock) "
                   f"is not registered with the kubelet by the running agent (pid {pid}): {plugins}/nvidia-gpu.sock "
                   "is served by another process")
    assert waiting["fix"] == found["fix"]
    _one(findings, "agent", "ok", f"nodeagent run is running (pid {pid})")
    assert log.count(f"{RECORD} was a symbolic link, not the agent's file: replaced") == 1, log
    assert not [f for f in findings if "no GPU resource registered" in f["text"] or "nodeagent run is not running" in f["text"]]
