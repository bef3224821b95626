"""Fault drills: kill -9 of the agent in the middle of node-critical work.

- during a runtime configure (`nodeagent bootstrap`): the containerd files are whole (old or new, containerd
  loads them) and the next run finishes the job, then reports no change;
- during a MIG apply (`nodeagent run`, label driven): after a restart every GPU has the old or the new
  layout, never a mix, and the state label ends terminal.
The kill lands at several points in time; whatever it hits, the invariants must hold.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nodeagent.mig.apply import MigStateFile
from nodeagent.simulator import inject
from nodeagent.simulator.state import STEP_GATE_ENV, SimStore
from tests.e2e._agent import REPO, Agent, node_root, running_agent
from tests.e2e.test_bootstrap_node import rerooted
from tests.e2e.test_run_cluster import agent_config, eventually, make_node, node_obj, set_label
from tests.peers.apiserver import KubeApiServer
from tests.peers.containerd import Containerd
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

ORIGINAL = """version = 2

[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = true
"""


@pytest.mark.parametrize("delay", [0.35, 0.45, 0.6])
def test_kill_during_runtime_configure(tmp_path: Path, containerd: Containerd, delay: float) -> None:
    root = tmp_path / "root"
    cfg = root / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(ORIGINAL)
    args = [sys.executable, "-m", "nodeagent", "--root", str(root), "bootstrap", "--simulate", "t4x1", "--no-kube"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # whatever was hit: the main config is the original or the new one, and containerd loads it
    text = cfg.read_text()
    assert text == ORIGINAL or 'imports = ["/etc/containerd/conf.d/99-nvidia.toml"]' in text
    containerd.config_dump(rerooted(root, cfg, tmp_path / "judge.toml"))
    dropin = root / "etc/containerd/conf.d/99-nvidia.toml"
    if dropin.exists():
        containerd.config_dump(dropin)
    # the next run finishes the job; the one after changes nothing
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    again = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert json.loads(again.stdout)["changed"] is False
    dump = containerd.config_dump(rerooted(root, cfg, tmp_path / "judge.toml"))
    runtimes = dump["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["nvidia"]["options"]["SystemdCgroup"] is True  # copied from runc
    assert "runc" in runtimes


# --------------------------------------------------------------------------------------------------
# kill -9 during a MIG apply
#
# The kill lands at precise points of the apply, judged on the simulated hardware itself: the test takes
# the simulator's state lock (every NVML change happens under an exclusive flock on the state's directory), so
# while it holds the lock the agent is frozen before its next change. Under the lock the test reads the
# state and, when it shows the wanted point (e.g. a GPU instance whose compute instance does not exist
# yet), kills the agent right there; otherwise it releases the lock and the agent makes one more change.

OLD = ("3g.40gb", "3g.40gb")
NEW = ("1g.10gb",) * 7
SimDoc = dict[str, Any]


def layouts(sim_state: Path) -> list[tuple[bool, tuple[str, ...]]]:
    """Per GPU: MIG mode and the sorted profiles (a GPU instance without compute instance shows as ``+bare``)."""
    out = subprocess.run([sys.executable, "-m", "nodeagent", "discover", "--sim-state", str(sim_state), "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=True).stdout
    inv: dict[str, Any] = json.loads(out)
    return [(g["mig_current"], tuple(sorted([d["profile"] for d in g["mig_devices"]]
                                            + [d["profile"] + "+bare" for d in g["bare_gpu_instances"]])))
            for g in inv["gpus"]]


def _gis(doc: SimDoc) -> list[tuple[int, dict[str, Any]]]:
    return [(i, gi) for i, g in enumerate(doc["gpus"]) for gi in g["gis"]]


def orphan_of_new(doc: SimDoc) -> bool:  # a 1g.10gb GPU instance created, its compute instance not yet
    return any(gi["size"] == 1 and not gi["cis"] for _, gi in _gis(doc))


def orphan_of_old(doc: SimDoc) -> bool:  # a 3g.40gb whose compute instance is gone, the GPU instance not yet
    return any(gi["size"] == 4 and not gi["cis"] for _, gi in _gis(doc))


def half_built(doc: SimDoc) -> bool:  # GPU 3 holds 3 of its 7 new instances (GPUs 0-2 new, 4-7 empty)
    return sum(1 for i, gi in _gis(doc) if i == 3 and gi["size"] == 1 and gi["cis"]) == 3


def all_destroyed(doc: SimDoc) -> bool:  # every old instance gone, nothing created yet
    return all(not g["gis"] for g in doc["gpus"])


class StepGate:
    """The simulator's step gate (``STEP_GATE_ENV``): the agent waits for a byte on ``go`` before each change of
    the state file and puts one on ``done`` after, so the test sees every state the agent passes through."""

    def __init__(self, where: Path) -> None:
        self.where = where
        where.mkdir(exist_ok=True)
        os.mkfifo(where / "done")
        self._done = os.open(where / "done", os.O_RDWR | os.O_NONBLOCK)
        os.mkfifo(where / "go")  # last: the gate is closed from here on
        self._go = os.open(where / "go", os.O_RDWR)

    def step(self, agent: Agent, deadline: float) -> None:
        """Let one change through and wait until it is in the file."""
        os.write(self._go, b".")
        while time.monotonic() < deadline and agent.proc.poll() is None:
            ready, _, _ = select.select([self._done], [], [], 0.1)
            if ready:
                os.read(self._done, 1)
                return

    def close(self) -> None:
        (self.where / "go").unlink()  # open again before the FIFOs' ends close
        os.close(self._go)
        os.close(self._done)
        (self.where / "done").unlink()


def kill_at(agent: Agent, sim_state: Path, gate: StepGate | None, point: Callable[[SimDoc], bool],
            timeout: float = 30.0) -> SimDoc:
    """SIGKILL the agent at the first state that satisfies ``point``; returns that state. The agent makes each
    change only when the gate lets it, after the test has looked at the state before it."""
    assert gate is not None, "a kill at a state needs the simulator's step gate"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc: SimDoc = json.loads(sim_state.read_text())  # replaced whole by rename: always one state
        if point(doc):
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait()
            return doc
        if agent.proc.poll() is not None:
            raise AssertionError(f"agent exited {agent.proc.returncode} before the kill point:\n{agent.log()}")
        gate.step(agent, deadline)
    raise AssertionError(f"kill point {point.__name__} not reached within {timeout}s:\n{agent.log()}")


def kill_after(agent: Agent, sim_state: Path, delay: float) -> SimDoc:
    time.sleep(delay)
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait()
    doc: SimDoc = json.loads(sim_state.read_text())
    return doc


def kill_at_random(agent: Agent, sim_state: Path, gate: StepGate | None) -> SimDoc:
    """A kill at a moment drawn when the test runs (the same test list on every pytest worker); the moment
    is printed, so a failure report shows it."""
    delay = random.Random().uniform(0.05, 2.0)
    print(f"the agent is killed {delay:.3f}s into the apply")
    return kill_after(agent, sim_state, delay)


KILL_POINTS: dict[str, Callable[[Agent, Path, StepGate | None], SimDoc]] = {
    "orphan-of-new-instance": lambda a, s, g: kill_at(a, s, g, orphan_of_new),
    "orphan-of-old-instance": lambda a, s, g: kill_at(a, s, g, orphan_of_old),
    "all-old-destroyed": lambda a, s, g: kill_at(a, s, g, all_destroyed),
    "gpu-half-built": lambda a, s, g: kill_at(a, s, g, half_built),
    "random": kill_at_random,
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_kill_during_mig_apply(tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness,
                               point: str) -> None:
    with node_root(kubelet_harness) as root:
        kill_during_mig_apply(tmp_path, root, kube_apiserver, kubelet_harness, point)


def kill_during_mig_apply(tmp_path: Path, root: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness,
                          point: str) -> None:
    """Both agent runs share ``root``: the second finds the first one's in-flight MIG record there."""
    node = "e2e-drill-mig-" + point.replace(".", "-")[:40]
    make_node(kube_apiserver, node)
    sim = root / "sim.json"
    store = SimStore.open("dgx-h100", sim)
    for i in range(8):  # the old layout: 2 x 3g.40gb on every GPU
        inject.write_mig_layout(store, i, list(OLD))
    old = [(True, OLD)] * 8
    new = [(True, NEW)] * 8
    assert layouts(sim) == old
    cfg = agent_config(root, kube_apiserver.kubeconfig)
    args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", str(sim), "--node-name", node]
    gated = not point.startswith("random")
    where = root / "sim-gate"
    with running_agent(tmp_path, root, args, env={STEP_GATE_ENV: str(where)} if gated else None) as agent:
        agent.wait_notify("READY=1", timeout=20)
        gate = StepGate(where) if gated else None
        try:
            set_label(kube_apiserver, node, "nvidia.com/mig.config", "all-1g.10gb")
            killed_in = KILL_POINTS[point](agent, sim, gate)
        finally:
            if gate is not None:
                gate.close()
    at_kill = layouts(sim)
    if not point.startswith("random"):
        assert at_kill not in (old, new), f"the kill at {point} should have left a half-changed node: {at_kill}"
    if not point.startswith("random"):  # the kill left the record of the apply under the root
        assert MigStateFile(root / "var/lib/nodeagent/mig").inflight()
    (tmp_path / "notify.sock").unlink()
    with running_agent(tmp_path, root, args) as agent:
        agent.wait_notify("READY=1", timeout=20)

        def state() -> str | None:
            value: str | None = node_obj(kube_apiserver, node)["metadata"]["labels"].get("nvidia.com/mig.config.state")
            return value

        eventually(lambda: state() in ("success", "failed"), 60, "a terminal mig.config.state")
        final = layouts(sim)
        for i, layout in enumerate(final):
            assert layout in (old[i], new[i]), f"GPU {i} has a mixed layout {layout} (killed at {killed_in})"
        assert state() == "success", agent.log()
        assert final == new
        if not point.startswith("random"):  # the half-changed GPUs were put back whole before the re-apply
            assert "recovered from an interrupted apply of MIG config all-1g.10gb" in agent.log()
        assert MigStateFile(root / "var/lib/nodeagent/mig").inflight() == []
        code, _ = agent.stop()
        assert code == 0
