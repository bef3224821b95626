"""The MPS planners (pure), the DRA claim parameters, and the stand-in control daemon on its own."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from nodeagent.dra.devices import DraDevice
from nodeagent.dra.mps import MpsConfigError, daemon_spec, parse_mps
from nodeagent.sharing.devices import build_resources
from nodeagent.sharing.mps import plan_daemons, with_access
from nodeagent.sharing.spec import parse_plugin_config
from nodeagent.simulator.mps_control import install
from tests.unit._dp_inventories import nvswitch_box


def test_plan_per_gpu_replicas_and_access() -> None:
    c = parse_plugin_config(
        "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
        "      devices: [0]\n    - name: nvidia.com/gpu\n      replicas: 3\n      devices: [1]\n")
    resources = build_resources(nvswitch_box(3), c)
    plans = plan_daemons(resources, lambda p: Path("/r" + p))
    # GPU 2 is not shared, but its device is in the same resource: the daemon serves it with one replica
    assert list(plans) == ["nvidia.com/gpu"]
    spec = plans["nvidia.com/gpu"]
    assert spec.pipe_dir == Path("/r/run/nodeagent/mps/nvidia.com_gpu/pipe")
    assert spec.thread_percentage == 25  # the largest replica count rules
    assert spec.pinned_limits == ((0, f"{81559 // 4}M"), (1, f"{81559 // 3}M"), (2, "81559M"))
    assert spec.commands()[-1] == "set_default_active_thread_percentage 25"
    access = with_access(resources, lambda p: "/r" + p)["nvidia.com/gpu"].mps
    assert access is not None and access.pipe_dir == "/run/nodeagent/mps/nvidia.com_gpu/pipe"
    assert access.pipe_dir_on_host == "/r/run/nodeagent/mps/nvidia.com_gpu/pipe"


def _claim(params: object) -> dict[str, object]:
    return {"status": {"allocation": {"devices": {"config": [
        {"opaque": {"driver": "gpu.nodeagent.io", "parameters": params}}]}}}}


GPUS = [DraDevice("gpu-0", "gpu", 0, 0, "GPU-a"), DraDevice("gpu-1", "gpu", 1, 1, "GPU-b")]


def test_dra_parameters() -> None:
    params = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {
        "strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "2Gi",
                                         "defaultPerDevicePinnedMemoryLimit": {"GPU-b": "512Mi"}}}}
    cfg = parse_mps(_claim(params), "gpu.nodeagent.io", "claim x")
    assert cfg is not None and cfg.thread_percentage is None
    spec = daemon_spec("u1", GPUS, cfg, "claim x", lambda p: Path(p))
    assert spec.pinned_limits == ((0, "2048M"), (1, "512M")) and spec.thread_percentage == 100
    assert parse_mps({"status": {}}, "gpu.nodeagent.io", "c") is None
    for bad, match in [
        ({**params, "kind": "TpuConfig"}, "must be kind GpuConfig"),
        ({**params, "sharing": {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "2 GB"}}},
         "not a memory quantity"),
        ({**params, "sharing": {"strategy": "MPS", "mpsConfig": {"threads": 3}}}, "unknown key"),
    ]:
        with pytest.raises(MpsConfigError, match=match):
            parse_mps(_claim(bad), "gpu.nodeagent.io", "claim x")
    far = parse_mps(_claim({**params, "sharing": {"strategy": "MPS", "mpsConfig": {
        "defaultPerDevicePinnedMemoryLimit": {"5": "1Gi"}}}}), "gpu.nodeagent.io", "claim x")
    assert far is not None
    with pytest.raises(MpsConfigError, match="names 5, which is no GPU of the claim"):
        daemon_spec("u1", GPUS, far, "claim x", lambda p: Path(p))


def test_stand_in_daemon_mode(tmp_path: Path) -> None:
    binary = install(tmp_path / "bin/nvidia-cuda-mps-control")
    d = tmp_path / "mps"
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(d / "p"), "CUDA_MPS_LOG_DIRECTORY": str(d / "l"), "PATH": "/usr/bin:/bin"}

    def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(binary), *args], input=stdin, env=env, capture_output=True, text=True,
                              timeout=20, check=False)

    assert run(stdin="get_server_list\n").returncode == 1  # no daemon yet
    assert run("-d").returncode == 0
    try:
        second = run("-d")
        assert second.returncode == 1 and "already running" in second.stderr
        got = run(stdin="set_default_active_thread_percentage 30\nget_default_active_thread_percentage\n"
                        "set_default_active_thread_percentage 0\nbogus\n")
        assert got.stdout.splitlines() == ["30.0", "30.0", "Invalid value", "Unrecognized command: bogus"]
        pid = int(run(stdin="get_server_list\n").stdout)
    finally:
        run(stdin="quit\n")
    for _ in range(100):
        if not (d / "p/control").exists():
            break
        time.sleep(0.05)
    assert not (d / "p/control").exists()
    def alive() -> bool:  # a zombie waiting for its reaper (the daemon was orphaned by -d) counts as ended
        try:
            return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False

    for _ in range(100):
        if not alive():
            break
        time.sleep(0.05)
    if alive():
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("the daemon did not quit")
    log = (d / "l/control.log").read_text()
    assert "Starting control daemon" in log and "Accepting command: quit" in log


def test_sim_compute_mode_command(tmp_path: Path) -> None:
    import json
    import sys

    state = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "nodeagent", "sim", "inject", "compute-mode", "--simulate", "a10-x2",
           "--sim-state", str(state), "--gpu", "1"]
    ok = subprocess.run([*cmd, "PROHIBITED"], capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0 and ok.stdout.strip() == "GPU 1 compute mode PROHIBITED"
    assert json.loads(state.read_text())["gpus"][1]["compute_mode"] == 2
    from nodeagent.nvmlsource import open_nvml

    nvml = open_nvml(None, state)
    try:
        assert nvml.nvml.nvmlDeviceGetComputeMode(nvml.nvml.nvmlDeviceGetHandleByIndex(1)) == 2
    finally:
        nvml.close()


async def test_a_daemon_left_by_a_killed_agent_is_replaced(tmp_path: Path) -> None:
    from nodeagent.gpu.mps import MpsDaemonSpec, MpsManager

    binary = install(tmp_path / "bin/nvidia-cuda-mps-control")
    d = tmp_path / "mps"
    spec = MpsDaemonSpec("nvidia.com/gpu", d / "p", d / "l", (), 50, ((0, "100M"),))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(spec.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(spec.log_dir)}
    left = subprocess.run([str(binary), "-d"], env=env, capture_output=True, text=True, timeout=20, check=False)
    assert left.returncode == 0
    old = int(subprocess.run([str(binary)], input="get_server_list\n", env=env, capture_output=True, text=True,
                             timeout=20, check=True).stdout)
    manager = MpsManager(binary)
    try:
        await manager.apply({spec.name: spec})
        assert manager.ready(spec.name)
        state = manager.states()[0]
        assert state.pid != old and not state.last_error
        got = subprocess.run([str(binary)], input="get_default_active_thread_percentage\n", env=env,
                             capture_output=True, text=True, timeout=20, check=True)
        assert got.stdout.split() == ["50.0"]
    finally:
        await manager.stop()
    assert not (spec.pipe_dir / "control").exists()
    assert "An instance of this daemon is already running" not in (spec.log_dir / "control.log").read_text()


def test_daemon_environment_finds_the_driver_beside_its_binary(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The control daemon runs with a clean environment: the driver's binary directory (under the root) first
    on PATH, where it finds its server; the agent's LD_LIBRARY_PATH (the DaemonSet's links to the node's driver
    libraries) passed on; nothing else of the agent's environment."""
    from nodeagent.gpu.mps import MpsDaemon, MpsDaemonSpec

    spec = MpsDaemonSpec("nvidia.com/gpu", tmp_path / "p", tmp_path / "l", ("GPU-a", "GPU-b"), 50)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/run/nvml")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    env = MpsDaemon(spec, Path("/host/usr/bin/nvidia-cuda-mps-control")).env()
    assert env == {"PATH": "/host/usr/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LD_LIBRARY_PATH": "/run/nvml",
                   "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "p"), "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "l"),
                   "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}
    monkeypatch.delenv("LD_LIBRARY_PATH")
    assert "LD_LIBRARY_PATH" not in MpsDaemon(spec, Path("/usr/bin/nvidia-cuda-mps-control")).env()


class _Modes:
    """Compute modes as NVML keeps them, for the manager's port; GPU-x cannot be read (an NVML error)."""

    def __init__(self, modes: dict[str, int]) -> None:
        self.modes = modes
        self.sets: list[tuple[str, int]] = []

    def compute_mode(self, uuid: str) -> int:
        from nodeagent.errors import NvmlError

        if uuid == "GPU-x":
            raise NvmlError("GPU-x: nvmlDeviceGetComputeMode: Unknown Error")
        return self.modes[uuid]

    def set_compute_mode(self, uuid: str, mode: int) -> None:
        self.sets.append((uuid, mode))
        self.modes[uuid] = mode


async def test_compute_modes_switched_recorded_and_restored_by_the_next_agent(tmp_path: Path) -> None:
    """Only DEFAULT GPUs go to EXCLUSIVE_PROCESS (an administrator's PROHIBITED stays, one already exclusive is
    not the agent's to restore); the record lets an agent started after a crash switch them back."""
    import json

    from nodeagent.gpu.mps import MpsManager

    modes = _Modes({"GPU-a": 0, "GPU-b": 2, "GPU-c": 3, "GPU-d": 0})
    record = tmp_path / "run/exclusive-gpus.json"
    first = MpsManager(tmp_path / "nvidia-cuda-mps-control", compute_modes=modes, record=record)
    await first._compute_modes({"GPU-a", "GPU-b", "GPU-c", "GPU-x"})  # what apply does before the daemons start
    assert modes.sets == [("GPU-a", 3)] and modes.modes["GPU-b"] == 2
    assert json.loads(record.read_text()) == ["GPU-a"]
    # the agent was killed (nothing restored); the next one is started without MPS
    second = MpsManager(tmp_path / "nvidia-cuda-mps-control", compute_modes=modes, record=record)
    await second.apply({})
    assert modes.modes == {"GPU-a": 0, "GPU-b": 2, "GPU-c": 3, "GPU-d": 0}
    assert json.loads(record.read_text()) == []
    # without the port (an NVML source that cannot set modes) nothing is touched or recorded
    record.unlink()
    await MpsManager(tmp_path / "nvidia-cuda-mps-control", record=record)._compute_modes({"GPU-d"})
    assert not record.exists() and modes.modes["GPU-d"] == 0


async def test_a_gpu_reset_pauses_only_its_daemons_and_resumes_them(tmp_path: Path) -> None:
    """GPU remediation stops the control daemons serving the GPU to be reset (no process may hold it), keeps
    the others running, keeps the paused one stopped through a re-apply of the same config, and starts it
    again after the reset."""
    from nodeagent.gpu.mps import MpsDaemonSpec, MpsManager

    binary = install(tmp_path / "bin/nvidia-cuda-mps-control")
    on_a = MpsDaemonSpec("on-a", tmp_path / "a/p", tmp_path / "a/l", ("GPU-a",), 50)
    on_b = MpsDaemonSpec("on-b", tmp_path / "b/p", tmp_path / "b/l", ("GPU-b",), 50)
    manager = MpsManager(binary)
    try:
        await manager.apply({"on-a": on_a, "on-b": on_b})
        pid_b = manager.states()[1].pid
        assert await manager.pause_gpu("GPU-a") == ["on-a"]
        assert manager.daemon("on-a") is None and manager.ready("on-b") and manager.paused() == ["on-a"]
        assert not (on_a.pipe_dir / "control").exists()
        await manager.apply({"on-a": on_a, "on-b": on_b})  # a resync meanwhile: still paused
        assert manager.daemon("on-a") is None
        assert await manager.resume_gpu("GPU-a") == ["on-a"]
        assert manager.ready("on-a") and manager.paused() == []
        assert [s.pid for s in manager.states() if s.name == "on-b"] == [pid_b]  # never disturbed
        assert await manager.resume_gpu("GPU-a") == []
    finally:
        await manager.stop()
