"""NVML semantics of nodeagent/gpu/FACTS.md on the simulator and through the adapter."""

from __future__ import annotations

import ctypes
import logging
from importlib import resources
from typing import Any

import pynvml
import pytest
import yaml

from nodeagent.errors import NvmlError, NvmlPermissionError, ResetRequiredError
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.gpu.ports import GpuDiscovery, GpuTelemetry, HealthEvents, MigAdministration
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator import inject
from nodeagent.simulator.machine import load_machine, parse_machine
from nodeagent.simulator.nvml import SimulatedNvml
from nodeagent.simulator.state import SimStore


def _adapter(machine: str, *, privileged: bool = True) -> tuple[NvmlAdapter, SimStore]:
    store = SimStore(load_machine(machine))
    return adapter_for_sim(SimulatedNvml(store, privileged=privileged)), store


def test_adapter_implements_every_port() -> None:
    adapter, _ = _adapter("l4x2")
    discovery: GpuDiscovery = adapter
    admin: MigAdministration = adapter
    events: HealthEvents = adapter
    telemetry: GpuTelemetry = adapter
    assert discovery.device_count() == 2 and events.recovery_action(0) == 0
    assert telemetry.metrics(1).memory_total_mib == 23034
    with pytest.raises(NvmlError):
        admin.mig_mode(0)  # L4: no MIG (NOT_SUPPORTED)


def test_set_mig_mode_decides_by_rereading_the_mode() -> None:
    """Idle → current now (False); busy → pending (True, status IN_USE); passthrough → ResetRequiredError."""
    adapter, store = _adapter("dgx-a100-80gb")
    assert adapter.set_mig_mode(0, True) is False and adapter.mig_mode(0) == (True, True)
    inject.inject_process(store, 1, 100, "trainer")
    assert adapter.set_mig_mode(1, True) is True and adapter.mig_mode(1) == (False, True)
    vm, _ = _adapter("vm-a100-passthrough")
    with pytest.raises(ResetRequiredError, match="switches when the host reboots"):
        vm.set_mig_mode(0, True)
    assert vm.mig_mode(0) == (False, True)
    with pytest.raises(ResetRequiredError):
        vm.reset_gpu(0)  # no GPU reset from inside the guest


def test_status_alone_never_decides(caplog: pytest.LogCaptureFixture) -> None:
    """A SUCCESS status with the mode unchanged is not taken for done (mig-parted re-reads the mode)."""
    adapter, store = _adapter("dgx-h100")

    class Liar(SimulatedNvml):
        def nvmlDeviceSetMigMode(self, handle: Any, mode: int) -> int:
            return 0  # claims success, changes nothing

    liar = adapter_for_sim(Liar(store))
    with pytest.raises(NvmlError, match="MIG mode on was not accepted"):
        liar.set_mig_mode(0, True)
    assert adapter.mig_mode(0) == (False, False)


def test_mig_disabled_return_codes() -> None:
    sim = SimulatedNvml(SimStore(load_machine("dgx-h100")))
    sim.nvmlInit()
    h = sim.nvmlDeviceGetHandleByIndex(0)
    for call in (lambda: sim.nvmlDeviceGetGpuInstanceProfileInfo(h, 0),
                 lambda: sim.nvmlDeviceCreateGpuInstance(h, 19),
                 lambda: sim.nvmlDeviceGetGpuInstanceById(h, 1)):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()  # type: ignore[no-untyped-call]
    assert sim.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    l4 = SimulatedNvml(SimStore(load_machine("l40s-x4")))
    l4.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        l4.nvmlDeviceGetMigMode(l4.nvmlDeviceGetHandleByIndex(0))


def test_non_root_codes_and_discovery() -> None:
    adapter, store = _adapter("dgx-h100", privileged=False)
    inject.write_mig_layout(store, 0, ["3g.40gb", "3g.40gb"])
    inject.inject_process(store, 0, 4242, "python3", gi_id=1)
    sim = adapter.nvml
    h = sim.nvmlDeviceGetHandleByIndex(0)
    for call in (lambda: sim.nvmlDeviceGetGpuInstancePossiblePlacements(h, 9, None, ctypes.byref(ctypes.c_uint())),
                 lambda: sim.nvmlDeviceCreateGpuInstance(h, 19),
                 lambda: sim.nvmlDeviceGetComputeRunningProcesses(h)):
        with pytest.raises(pynvml.NVMLError_NoPermission):
            call()  # type: ignore[no-untyped-call]
    with pytest.raises(NvmlPermissionError):
        adapter.discover()
    inv = adapter.discover(partial=True)
    g = inv.gpu(0)
    assert g.mig_current and [d.profile for d in g.mig_devices] == ["3g.40gb", "3g.40gb"]
    assert {d.placement_start for d in g.mig_devices} == {-1}  # needs root
    assert set(adapter.restricted_facts) >= {
        "GPU instances and their placements (nvmlDeviceGetGpuInstances)",
        "processes on MIG-enabled GPUs (nvmlDeviceGetComputeRunningProcesses)",
    }
    assert inv.gpu(1).mig_profiles  # MIG off: the built-in table answers
    with pytest.raises(NvmlPermissionError, match="needs root"):
        adapter.create_mig_device(1, "7g.80gb")


def test_mig_device_memory_differs_from_profile_and_handle_check_is_c_uint() -> None:
    adapter, store = _adapter("dgx-a100-40gb")
    inject.write_mig_layout(store, 0, ["3g.20gb", "3g.20gb"])
    devs = adapter.discover().gpu(0).mig_devices
    assert [(d.placement_start, d.memory_mib) for d in devs] == [(0, 20224), (4, 20096)]
    assert adapter.discover().gpu(0).profile("3g.20gb").memory_mib == 19968  # type: ignore[union-attr]
    sim = adapter.nvml
    h = sim.nvmlDeviceGetHandleByIndex(0)
    flag = sim.nvmlDeviceIsMigDeviceHandle(sim.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
    assert isinstance(flag, ctypes.c_uint) and flag.value == 1
    assert sim.nvmlDeviceIsMigDeviceHandle(h).value == 0


def test_utilisation_is_not_available_in_mig_mode() -> None:
    adapter, store = _adapter("dgx-h100")
    inject.write_mig_layout(store, 0, ["7g.80gb"])
    assert adapter.metrics(0).utilisation_pct is None
    assert adapter.metrics(1).utilisation_pct == 0
    from nodeagent.metrics import sample_from

    assert sample_from(adapter.metrics(0)).gpu_util is None  # omitted from metrics, not reported as 0


def test_recovery_action_field() -> None:
    adapter, store = _adapter("dgx-b200")
    assert adapter.recovery_action(3) == 0
    assert adapter.wait_events(0) == []  # the event set exists before the fault, as in the daemon
    inject.inject_xid(store, 3, 79, recovery_action=1)
    assert adapter.recovery_action(3) == 1
    events = adapter.wait_events(1000)
    assert [(e.gpu_index, e.xid) for e in events] == [(3, 79)]
    inject.set_recovery_action(store, 3, 0)
    assert adapter.recovery_action(3) == 0
    with pytest.raises(Exception, match="unknown GPU recovery action 9"):
        inject.set_recovery_action(store, 3, 9)


def _machine_without(functions: list[str]) -> SimStore:
    text = (resources.files("nodeagent.simulator") / "machines" / "dgx-h100.yaml").read_text()
    doc = yaml.safe_load(text)
    doc["missing_functions"] = functions
    return SimStore(parse_machine("old-driver", doc))


def test_library_mismatch_is_a_clear_error_or_a_fallback(caplog: pytest.LogCaptureFixture) -> None:
    store = _machine_without(["nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetArchitecture",
                              "nvmlDeviceGetMemoryInfo"])
    adapter = adapter_for_sim(SimulatedNvml(store))
    inject.inject_process(store, 0, 7, "train")
    assert [p.pid for p in adapter.processes(0)] == [7]  # fell back to the _v2 form
    with pytest.raises(NvmlError, match="older than this nvidia-ml-py") as e:
        adapter.discover()
    assert not isinstance(e.value.__cause__, pynvml.NVMLError)  # NVMLLibraryMismatchError is its own class
    store2 = _machine_without(["nvmlDeviceGetArchitecture"])
    with caplog.at_level(logging.DEBUG):
        inv = adapter_for_sim(SimulatedNvml(store2)).discover()
    assert inv.gpu(0).architecture == "unknown"  # an optional fact: left out, no traceback


@pytest.mark.parametrize("output,error", [
    ("GPU 00000000:07:00.0 is currently in use by another process.", "GpuBusyError"),
    ("Resetting GPU 00000000:07:00.0 is not supported.", "ResetRequiredError"),
    ("Unknown Error", "NvmlError"),
])
def test_nvidia_smi_resetter(output: str, error: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host resetter runs ``nvidia-smi --gpu-reset -i N`` and turns its last line into one error."""
    from nodeagent.gpu.reset import NvidiaSmiResetter

    tool = tmp_path / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\necho '{output}'\nexit 3\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(NvmlError) as e:
        NvidiaSmiResetter().reset_gpu(2)
    assert type(e.value).__name__ == error and output in str(e.value) and "GPU 2" in str(e.value)
    assert (tmp_path / "args").read_text().split() == ["--gpu-reset", "-i", "2"]
    ok = tmp_path / "ok" / "nvidia-smi"
    ok.parent.mkdir()
    ok.write_text("#!/bin/sh\nexit 0\n")
    ok.chmod(0o755)
    monkeypatch.setenv("PATH", f"{ok.parent}:/usr/bin:/bin")
    NvidiaSmiResetter().reset_gpu(2)


async def test_health_monitor_on_the_adapter_follows_the_recovery_action(tmp_path: Any) -> None:
    """Through the real adapter and event thread: an XID with recovery action "GPU reset" keeps the GPU
    unhealthy past the quiet window; once the driver reports "none" it recovers after the window."""
    import asyncio

    from nodeagent.gpu.health import EventPumps, HealthMonitor, HealthMonitorSettings
    from nodeagent.nvmlsource import open_nvml

    changes: list[int] = []

    async def changed() -> None:
        changes.append(1)

    with open_nvml("dgx-h100", tmp_path / "s.json") as nvml:
        assert nvml.wait_events(0) == []  # the event set exists before the fault, as in the daemon
        monitor = HealthMonitor(nvml, HealthMonitorSettings(recovery_window_s=0.2, poll_interval_s=3600,
                                                     event_wait_ms=50), changed, pumps=EventPumps())
        await monitor.start(range(8))
        try:
            inject.inject_xid(nvml.nvml.store, 5, 48, recovery_action=1)
            for _ in range(200):
                if not monitor.is_healthy(5):
                    break
                await asyncio.sleep(0.02)
            assert not monitor.is_healthy(5) and changes
            await monitor.poll_once()
            await asyncio.sleep(0.3)
            assert not await monitor.poll_once()
            assert monitor.unhealthy() == {(5, None): "XID 48 (recovery: GPU reset)"}
            inject.set_recovery_action(nvml.nvml.store, 5, 0)
            assert not await monitor.poll_once()  # quiet window starts now
            await asyncio.sleep(0.3)
            assert await monitor.poll_once() and monitor.is_healthy(5)
        finally:
            await monitor.stop()
