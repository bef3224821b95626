"""``nodeagent run`` with ``sharing.mps``: the agent runs the MPS control daemon as its child, serves the
replicas to the kubelet's device manager once it answers, swaps it out on a reload to time-slicing and back,
and leaves nothing running after SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e._agent import Agent, node_root, running_agent
from tests.e2e.test_run import demo_args
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

MPS = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
TS = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
SERVER = "nvidia-cuda-mps-server"


def server_pids(state: Path) -> set[int]:
    """The MPS server processes the simulated NVML shows, over all GPUs (one per GPU for one daemon)."""
    gpus = json.loads(state.read_text())["gpus"]
    return {p["pid"] for g in gpus for p in g["processes"] if p["name"] == SERVER}


def wait_for(what: str, check: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def reload_and_wait(agent: Agent) -> None:
    seen = len(agent.poll_notify())
    agent.send(signal.SIGHUP)
    agent.wait_notify("RELOADING=1", after=seen)
    agent.wait_notify("READY=1", after=seen)


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_run_serves_mps_and_ties_the_daemon_to_the_agent(tmp_path: Path, kubelet_harness: KubeletHarness) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[device_plugin]\nconfig = "/etc/nodeagent/dp.yaml"\n')
    with node_root(kubelet_harness) as root:
        state = root / "sim.json"
        dp = root / "etc/nodeagent/dp.yaml"
        dp.parent.mkdir(parents=True)
        dp.write_text(MPS)
        with running_agent(tmp_path, root, demo_args(root, "--config", str(config))) as agent:
            agent.wait_notify("READY=1")
            kubelet_harness.wait("nvidia.com/gpu", registered=True, total=16, healthy=16, timeout=20)
            pids = server_pids(state)
            assert len(pids) == 1, pids  # one daemon for the resource, its server on all 8 GPUs
            first = pids.pop()
            assert alive(first)
            # the simulator's stand-in is the agent's own module: nothing is installed in (or run from) the root
            assert not (root / "usr/bin/nvidia-cuda-mps-control").exists()
            a = kubelet_harness.allocate("nvidia.com/gpu", 1, pod="mps")
            assert a.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/run/nodeagent/mps/nvidia.com_gpu/pipe"

            dp.write_text(TS)
            reload_and_wait(agent)
            kubelet_harness.wait("nvidia.com/gpu", total=16, healthy=16, timeout=15)
            wait_for("the daemon to quit", lambda: not alive(first))
            assert server_pids(state) == set()

            dp.write_text(MPS)
            reload_and_wait(agent)
            kubelet_harness.wait("nvidia.com/gpu", total=16, healthy=16, timeout=15)
            wait_for("a new daemon", lambda: len(server_pids(state)) == 1)
            second = next(iter(server_pids(state)))
            assert second != first and alive(second)
            assert any(f"MPS daemon for nvidia.com/gpu ready (pid {second}" in ln for ln in agent.log().splitlines())

            code, took = agent.stop()
            assert code == 0 and took < 5.0, agent.log()
            wait_for("the daemon to end with the agent", lambda: not alive(second), timeout=2.0)
            assert server_pids(state) == set()
            assert not (root / "run/nodeagent/mps/nvidia.com_gpu/pipe/control").exists()
            assert os.path.exists(root / "run/nodeagent/mps/nvidia.com_gpu/log/control.log")
