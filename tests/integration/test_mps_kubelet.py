"""MPS on the device-plugin plane, judged by the kubelet's own device manager (the Go harness).

The agent runs the simulator's stand-in ``nvidia-cuda-mps-control`` (its own module, nothing of the sandbox
root), over the simulator's state file, so the control daemon shows its server as a process on the simulated GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nodeagent.commands.discover import render_text
from nodeagent.deviceplugin.service import DevicePluginService
from nodeagent.errors import ConfigError
from nodeagent.gpu.health import HealthMonitorSettings
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import mps_manager, open_nvml
from nodeagent.sharing.spec import PluginConfig, parse_plugin_config
from nodeagent.simulator.inject import set_compute_mode
from nodeagent.simulator.state import SimStore
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

MACHINE = "a10-x2"  # two NVIDIA A10, 23028 MiB each
GPU = "nvidia.com/gpu"
MPS4 = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
TS2 = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"


def cfg(text: str) -> PluginConfig:
    return parse_plugin_config(text, source="dp.yaml")


@dataclass
class MpsNode:
    harness: KubeletHarness
    service: DevicePluginService
    nvml: NvmlAdapter
    store: SimStore
    paths: HostPaths
    binary: Path

    @property
    def pipe_dir(self) -> Path:
        return self.paths("/run/nodeagent/mps/nvidia.com_gpu/pipe")

    def control(self, *commands: str) -> subprocess.CompletedProcess[str]:
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "PATH": "/usr/bin:/bin"}
        stand_in = [sys.executable, "-m", "nodeagent.simulator.mps_control"]  # what the agent runs on the simulator
        return subprocess.run(stand_in, input="".join(c + "\n" for c in commands), env=env,
                              capture_output=True, text=True, timeout=20, check=False)

    def compute_modes(self) -> list[int]:
        """The simulated compute mode of the GPUs MPS4 shares (0 DEFAULT, 3 EXCLUSIVE_PROCESS)."""
        return [int(g.get("compute_mode", 0)) for g in self.store.read()["gpus"][:2]]

    def daemon_pid(self) -> int | None:
        states = self.service.mps_states()
        return states[0].pid if states else None

    def server_processes(self) -> list[tuple[int, int]]:
        """(GPU index, pid) of every MPS server the simulated NVML shows."""
        return [(i, p["pid"]) for i, g in enumerate(self.store.read()["gpus"]) for p in g["processes"]
                if p["name"] == "nvidia-cuda-mps-server"]

    async def wait(self, resource: str, **kw: object) -> object:
        return await asyncio.to_thread(self.harness.wait, resource, **kw)  # type: ignore[arg-type]


@pytest.fixture
def short_root() -> Iterator[Path]:
    """The daemon's control socket lives under the root: keep the path far below 108 bytes."""
    root = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def mps_node(kubelet_harness: KubeletHarness, short_root: Path) -> AsyncIterator[MpsNode]:
    state = short_root / "sim.json"
    store = SimStore.open(MACHINE, state)
    paths = HostPaths(short_root / "root")
    nvml = open_nvml(None, state)
    manager = mps_manager(paths, "/", MACHINE, state, nvml)  # the adapter: it switches the GPUs' compute mode
    binary = manager.binary
    service = DevicePluginService(
        plugin_dir=kubelet_harness.plugin_dir, plugin_config=cfg(MPS4), nvml=nvml,
        health=HealthMonitorSettings(recovery_window_s=None, poll_interval_s=0.2, event_wait_ms=100),
        mps=manager, under_root=paths,
    )
    node = MpsNode(kubelet_harness, service, nvml, store, paths, binary)
    try:
        await service.start(await asyncio.to_thread(nvml.discover))
        yield node
    finally:
        pid = node.daemon_pid()
        await service.stop()
        nvml.close()
        if pid is not None:  # stop leaves no daemon behind
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


async def test_four_replicas_to_four_containers_each_with_the_pipe_dir(mps_node: MpsNode) -> None:
    await mps_node.wait(GPU, total=8, healthy=8, registered=True)
    pid = mps_node.daemon_pid()
    assert pid is not None
    # the defaults sent: 100 / 4 replicas, 23028 MiB / 4 on each of the two GPUs (CUDA ordinals 0 and 1)
    got = mps_node.control("get_default_active_thread_percentage", "get_default_device_pinned_mem_limit 0",
                           "get_default_device_pinned_mem_limit 1", "get_server_list")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["25.0", "5757M", "5757M", str(pid)]
    assert sorted(mps_node.server_processes()) == [(0, pid), (1, pid)]
    # discover shows the server on both GPUs, as NVML reports it
    shown = render_text(await asyncio.to_thread(mps_node.nvml.discover), False)
    assert sum(line.rstrip().endswith(f"server {pid}") for line in shown.splitlines()) == 2
    log = (mps_node.paths("/run/nodeagent/mps/nvidia.com_gpu/log") / "control.log").read_text()
    assert "set_default_active_thread_percentage 25" in log

    pipe = "/run/nodeagent/mps/nvidia.com_gpu/pipe"
    seen: set[str] = set()
    for n in range(4):
        a = await asyncio.to_thread(mps_node.harness.allocate, GPU, 1, pod=f"mps-{n}")
        assert len(a.device_ids) == 1
        seen.update(a.device_ids)
        assert a.envs["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        mounts = {m["container_path"]: m for m in a.mounts}
        assert mounts[pipe]["host_path"] == str(mps_node.pipe_dir) and not mounts[pipe].get("read_only")
        assert mounts["/dev/shm"]["host_path"] == str(mps_node.paths("/dev/shm"))
    assert len(seen) == 4
    # one replica per container (failRequestsGreaterThanOne defaults to true under MPS)
    with pytest.raises(Exception, match="failRequestsGreaterThanOne"):
        await asyncio.to_thread(mps_node.harness.allocate, GPU, 2, pod="greedy")


async def test_daemon_killed_replicas_unhealthy_then_restarted_healthy(mps_node: MpsNode) -> None:
    await mps_node.wait(GPU, total=8, healthy=8, registered=True)
    pid = mps_node.daemon_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await mps_node.wait(GPU, healthy=0, timeout=10.0)
    await mps_node.wait(GPU, healthy=8, timeout=15.0)
    new = mps_node.daemon_pid()
    assert new is not None and new != pid
    assert mps_node.service.mps_states()[0].restarts >= 1
    got = mps_node.control("get_default_active_thread_percentage")
    assert got.stdout.split() == ["25.0"]  # the defaults were sent again to the new daemon


async def test_reload_mps_time_slicing_mps_leaves_no_daemon_behind(mps_node: MpsNode) -> None:
    await mps_node.wait(GPU, total=8, healthy=8, registered=True)
    first = mps_node.daemon_pid()
    assert first is not None
    # the GPUs a daemon serves are switched to EXCLUSIVE_PROCESS, as NVIDIA's MPS daemon does; recorded
    assert mps_node.compute_modes() == [3, 3], mps_node.compute_modes()
    record = mps_node.paths("/run/nodeagent/mps/exclusive-gpus-device-plugin.json")
    assert len(json.loads(record.read_text())) == 2
    inventory = await asyncio.to_thread(mps_node.nvml.discover)
    await mps_node.service.update(inventory, cfg(TS2))
    await mps_node.wait(GPU, total=4, healthy=4)
    assert mps_node.compute_modes() == [0, 0]  # back to DEFAULT: time-slicing runs many processes a GPU
    assert json.loads(record.read_text()) == []
    assert mps_node.service.mps_states() == []
    assert not (mps_node.pipe_dir / "control").exists()
    assert mps_node.server_processes() == []
    assert mps_node.control("get_server_list").returncode == 1  # nothing answers on the pipe any more
    a = await asyncio.to_thread(mps_node.harness.allocate, GPU, 1, pod="ts")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in a.envs
    await mps_node.service.update(inventory, cfg(MPS4))
    await mps_node.wait(GPU, total=8, healthy=8)
    second = mps_node.daemon_pid()
    assert second is not None and second != first
    assert sorted(mps_node.server_processes()) == [(0, second), (1, second)]
    assert mps_node.compute_modes() == [3, 3]


async def test_bad_mps_config_one_line_and_nothing_changed(mps_node: MpsNode) -> None:
    await mps_node.wait(GPU, total=8, healthy=8, registered=True)
    pid = mps_node.daemon_pid()
    before = mps_node.service.served_resources()
    inventory = await asyncio.to_thread(mps_node.nvml.discover)
    bad = MPS4.replace("replicas: 4", "replicas: 49")  # more than the 48 clients of one MPS server
    with pytest.raises(ConfigError) as e:
        await mps_node.service.update(inventory, cfg(bad))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("dp.yaml: sharing.mps.resources[0] (nvidia.com/gpu): replicas 49 is more than")
    with pytest.raises(ConfigError, match=r"^dp.yaml: sharing.mps.resources\[0\] \(nvidia.com/mig-1g.6gb\): MPS"):
        cfg(MPS4.replace("nvidia.com/gpu", "nvidia.com/mig-1g.6gb"))
    assert mps_node.service.served_resources() == before
    assert mps_node.daemon_pid() == pid
    await mps_node.wait(GPU, total=8, healthy=8)


async def test_compute_mode_prohibited_keeps_replicas_unhealthy(mps_node: MpsNode) -> None:
    await mps_node.wait(GPU, total=8, healthy=8, registered=True)
    set_compute_mode(mps_node.store, 1, "PROHIBITED")
    pid = mps_node.daemon_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await mps_node.wait(GPU, healthy=0, timeout=10.0)
    state = mps_node.service.mps_states()[0]
    for _ in range(100):  # the restart (after its back-off) is refused by the daemon
        if "PROHIBITED" in state.last_error:
            break
        await asyncio.sleep(0.05)
    assert not state.ready and "GPU 1 is in compute mode PROHIBITED, which MPS cannot use" in state.last_error
    assert (await asyncio.to_thread(mps_node.harness.resource, GPU)).allocatable == 0
    set_compute_mode(mps_node.store, 1, "EXCLUSIVE_PROCESS")
    await mps_node.wait(GPU, healthy=8, timeout=15.0)
