"""The remediation pipeline on the NVML simulator (the real adapter over ``SimulatedNvml``), with fake pods
and a recording Node: what each fault does to which GPU and pod, failure paths, and a successor's resume.
Also the simulator's reset/drain semantics and the ``nvidia-smi -r`` stand-in."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pynvml
import pytest

from nodeagent.errors import GpuBusyError, GpuLostError
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.remediation.pipeline import (
    CONDITION_REBOOT,
    CONDITION_RUNNING,
    EvictResult,
    Fault,
    PipelineSettings,
    Remediator,
)
from nodeagent.remediation.planner import GpuFacts, Step, facts_from_inventory
from nodeagent.remediation.policy import load_catalog
from nodeagent.remediation.record import RecordFile, RecordStore, RunRecord
from nodeagent.simulator import inject
from nodeagent.simulator.abi import smi
from nodeagent.simulator.nvml import SimulatedNvml
from nodeagent.simulator.open import open_sim
from nodeagent.simulator.reset import SimGroupResetter

FAST = dict(eviction_grace_s=1.0, eviction_timeout_s=2.0, step_timeout_s=2.0, poll_s=0.01)


class FakePods:
    """Pods holding GPUs by a process each; an eviction ends the process unless a budget blocks it."""

    def __init__(self, sim: SimulatedNvml, placement: Mapping[str, tuple[int, int]], blocked: int = 0) -> None:
        self.sim = sim
        self.placement = dict(placement)  # pod → (GPU index, pid)
        self.blocked = blocked  # evictions refused (HTTP 429) before one is allowed; -1: always
        self.evicted: list[str] = []
        self.refused = 0

    async def evict(self, pod: str, grace_s: float) -> EvictResult:
        if pod not in self.placement:
            return "gone"
        if self.blocked == -1 or self.refused < self.blocked:
            self.refused += 1
            return "blocked"
        gpu, pid = self.placement.pop(pod)
        inject.kill_process(self.sim.store, gpu, pid)
        self.evicted.append(pod)
        return "evicted"

    async def gone(self, pod: str) -> bool:
        return pod not in self.placement


class FakeNode:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, bool]] = []
        self.conditions: list[tuple[str, bool, str]] = []
        self.cordoned: list[str] = []

    async def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append((reason, message, warning))

    async def condition(self, type: str, status: bool, reason: str, message: str) -> None:
        self.conditions.append((type, status, reason))

    async def cordon(self, reason: str) -> None:
        self.cordoned.append(reason)

    def reasons(self) -> list[str]:
        return [r for r, _, _ in self.events]


class FakeHooks:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def withdraw(self, uuid: str, reason: str) -> None:
        self.calls.append(("withdraw", uuid))

    async def offer(self, uuid: str) -> None:
        self.calls.append(("offer", uuid))

    async def stop_users(self, uuid: str) -> None:
        self.calls.append(("stop_users", uuid))

    async def restore(self, uuid: str) -> None:
        self.calls.append(("restore", uuid))


class Rig:
    def __init__(self, tmp: Path, machine: str = "dgx-h100", **settings: Any) -> None:
        self.sim = open_sim(machine)
        self.nvml: NvmlAdapter = adapter_for_sim(self.sim, HostPaths(tmp))
        self.inv = self.nvml.discover()
        self.gpus: dict[str, GpuFacts] = facts_from_inventory(self.inv)
        self.uuid = {g.index: g.uuid for g in self.inv.gpus}
        self.node = FakeNode()
        self.hooks = FakeHooks()
        self.store = RecordStore(tmp / "var/lib/nodeagent/remediation.json")
        self.settings = PipelineSettings(**{**FAST, **settings})
        self.pods = FakePods(self.sim, {})

    def place(self, pod: str, gpu: int, pid: int) -> None:
        inject.inject_process(self.sim.store, gpu, pid, "python")
        self.pods.placement[pod] = (gpu, pid)

    def holders(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for pod, (gpu, _) in self.pods.placement.items():
            out.setdefault(self.uuid[gpu], []).append(pod)
        return out

    def remediator(self, **kw: Any) -> Remediator:
        return Remediator(self.settings, load_catalog(), self.nvml, SimGroupResetter(self.sim), self.pods,
                          self.node, self.hooks, store=self.store, **kw)

    def fault(self, gpu: int, xid: int | None, recovery: int = 0) -> Fault:
        if xid is not None:
            inject.inject_xid(self.sim.store, gpu, xid, recovery_action=recovery or None)
        elif recovery:
            inject.set_recovery_action(self.sim.store, gpu, recovery)
        return Fault(self.uuid[gpu], xid, recovery)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_xid_48_resets_only_its_gpu_and_evicts_only_its_pod(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.place("team/on-3", 3, 300)
    rig.place("team/on-5", 5, 500)
    rem = rig.remediator()
    out = run(rem.handle(rig.fault(3, 48, recovery=1), rig.gpus, rig.holders()))
    assert out.result == "done", out.detail
    assert rig.pods.evicted == ["team/on-3"] and "team/on-5" in rig.pods.placement
    assert rig.nvml.process_count(rig.uuid[5]) == 1  # GPU 5's work never noticed
    assert rig.nvml.recovery_action_of(rig.uuid[3]) == 0
    assert rig.nvml.persistence_mode_of(rig.uuid[3]) is True  # restored
    assert rig.hooks.calls == [("withdraw", rig.uuid[3]), ("stop_users", rig.uuid[3]), ("restore", rig.uuid[3]),
                               ("offer", rig.uuid[3])]
    steps = [m for r, m, _ in rig.node.events if r == "GPURemediationStep"]
    assert len(steps) == 8 and all(rig.uuid[3] in m for m in steps)
    assert rig.node.conditions[0][:2] == (CONDITION_RUNNING, True) and rig.node.conditions[-1][:2] == (
        CONDITION_RUNNING, False)
    assert "GPURemediated" in rig.node.reasons() and not rig.node.cordoned
    assert rig.store.load().runs == {} and len(rig.store.load().resets[rig.uuid[3]]) == 1


def test_a_budget_that_refuses_for_a_while_delays_the_eviction(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.place("team/on-3", 3, 300)
    rig.pods.blocked = 3
    out = run(rig.remediator().handle(rig.fault(3, 48), rig.gpus, rig.holders()))
    assert out.result == "done" and rig.pods.refused == 3 and rig.pods.evicted == ["team/on-3"]


def test_a_budget_that_never_allows_it_leaves_the_gpu_out_and_the_node_saying_why(tmp_path: Path) -> None:
    rig = Rig(tmp_path, eviction_timeout_s=0.3, cordon_on_failure=True)
    rig.place("team/on-3", 3, 300)
    rig.pods.blocked = -1
    out = run(rig.remediator().handle(rig.fault(3, 48), rig.gpus, rig.holders()))
    assert out.result == "failed" and "evict" in out.detail
    assert ("offer", rig.uuid[3]) not in rig.hooks.calls and ("withdraw", rig.uuid[3]) in rig.hooks.calls
    assert (CONDITION_REBOOT, True, "GPURecoveryFailed") in rig.node.conditions
    assert "NodeRebootRequired" in rig.node.reasons() and len(rig.node.cordoned) == 1
    assert rig.nvml.process_count(rig.uuid[3]) == 1  # never reset under the pod


def test_a_failing_reset_is_not_retried_and_never_reboots_unless_configured(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    inject.fail_next(rig.sim.store, "simResetGpu", pynvml.NVML_ERROR_UNKNOWN)
    rebooted: list[str] = []

    async def reboot(reason: str) -> None:
        rebooted.append(reason)

    out = run(rig.remediator().handle(rig.fault(2, 95), rig.gpus, {}))
    assert out.result == "failed" and "reset" in out.detail and not rig.node.cordoned
    inject.fail_next(rig.sim.store, "simResetGpu", pynvml.NVML_ERROR_UNKNOWN)
    out = run(rig.remediator(reboot=reboot).handle(rig.fault(2, 95), rig.gpus, {}))
    assert out.result == "failed" and len(rebooted) == 1


def test_xid_79_takes_the_reboot_path_and_xid_13_only_tells_the_pod(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.place("team/on-1", 1, 100)
    inject.inject_lost(rig.sim.store, 4)
    out = run(rig.remediator().handle(Fault(rig.uuid[4], 79), rig.gpus, rig.holders()))
    assert out.result == "reboot-required" and (CONDITION_REBOOT, True, "NodeRebootRequired") in rig.node.conditions
    with pytest.raises(GpuLostError):  # a GPU off the bus cannot be reset
        SimGroupResetter(rig.sim).reset([rig.uuid[4]])
    rig.node.events.clear()
    out = run(rig.remediator().handle(rig.fault(1, 13), rig.gpus, rig.holders()))
    assert out.result == "notified" and rig.pods.evicted == [] and rig.nvml.process_count(rig.uuid[1]) == 1
    assert [r for r in rig.node.reasons()] == ["GPUApplicationRestartAdvised"]
    assert "team/on-1" in rig.node.events[0][1]


def test_a_successor_clears_reboot_required_only_when_no_gpu_needs_it(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    inject.inject_lost(rig.sim.store, 4)
    assert run(rig.remediator().handle(Fault(rig.uuid[4], 79), rig.gpus, {})).result == "reboot-required"
    uuids = list(rig.uuid.values())
    rig.node.conditions.clear()
    assert not run(rig.remediator().clear_reboot_required(uuids))  # still off the bus: it stays
    inject.reboot(rig.sim.store)  # the node rebooted: the GPU is back
    assert run(rig.remediator().clear_reboot_required(uuids))
    assert rig.node.conditions == [(CONDITION_REBOOT, False, "NotRequired")]
    rig.store.save(RecordFile(quarantined={rig.uuid[2]: "reset 3 times"}))
    rig.node.conditions.clear()
    assert not run(rig.remediator().clear_reboot_required(uuids)) and rig.node.conditions == []


def test_repeated_faults_end_in_quarantine(tmp_path: Path) -> None:
    rig = Rig(tmp_path, max_resets=2)
    for _ in range(2):
        assert run(rig.remediator().handle(rig.fault(6, 48), rig.gpus, {})).result == "done"
    rem = rig.remediator()  # a new agent: the reset history comes from the record
    out = run(rem.handle(rig.fault(6, 48), rig.gpus, {}))
    assert out.result == "quarantined" and (CONDITION_REBOOT, True, "GPUQuarantined") in rig.node.conditions
    assert rig.nvml.recovery_action_of(rig.uuid[6]) == 0 and rig.uuid[6] in rig.store.load().quarantined


def test_a_mig_gpu_is_reset_with_the_pods_of_all_its_instances(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    inject.write_mig_layout(rig.sim.store, 2, ["3g.40gb", "3g.40gb"])
    gis = [gi["id"] for gi in rig.sim.store.read()["gpus"][2]["gis"]]
    for n, gi in enumerate(gis):
        inject.inject_process(rig.sim.store, 2, 200 + n, "python", gi_id=gi)
        rig.pods.placement[f"team/mig-{n}"] = (2, 200 + n)
    rig.place("team/on-3", 3, 300)
    out = run(rig.remediator().handle(rig.fault(2, 48), rig.gpus, rig.holders()))
    assert out.result == "done" and sorted(rig.pods.evicted) == ["team/mig-0", "team/mig-1"]
    assert rig.sim.store.read()["gpus"][2]["gis"] == []  # the reset destroyed them; restore lays them out again
    assert ("restore", rig.uuid[2]) in rig.hooks.calls


def _half_done(rig: Rig, gpu: int, done: Sequence[Step]) -> None:
    rem = rig.remediator()
    p = rem.plan_for(Fault(rig.uuid[gpu], 48), rig.gpus, {})
    rem.record.runs[p.target] = RunRecord(p, tuple(done), {rig.uuid[gpu]: True}, 1.0)
    rem._save()
    rig.nvml.set_persistence_mode_of(rig.uuid[gpu], False)


def test_a_successor_finishes_a_reset_the_gpu_still_needs(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.fault(3, 48, recovery=1)
    _half_done(rig, 3, (Step.WITHDRAW, Step.EVICT, Step.STOP_USERS, Step.PERSISTENCE_OFF))
    [out] = run(rig.remediator().resume())
    assert out.result == "done" and rig.nvml.recovery_action_of(rig.uuid[3]) == 0
    assert rig.nvml.persistence_mode_of(rig.uuid[3]) is True
    # the predecessor's hold ended with its process: the successor holds the GPU out again, then offers it
    assert [c for c in rig.hooks.calls if c[0] in ("withdraw", "offer")] == [("withdraw", rig.uuid[3]),
                                                                            ("offer", rig.uuid[3])]
    assert rig.store.load().runs == {}


def test_a_successor_rolls_back_when_the_gpu_needs_no_reset_any_more(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    _half_done(rig, 3, (Step.WITHDRAW, Step.EVICT, Step.STOP_USERS, Step.PERSISTENCE_OFF))
    [out] = run(rig.remediator().resume())
    assert out.result == "rolled-back" and rig.nvml.persistence_mode_of(rig.uuid[3]) is True
    assert rig.hooks.calls == [("restore", rig.uuid[3]), ("offer", rig.uuid[3])]
    assert "GPURemediationRolledBack" in rig.node.reasons() and rig.store.load().runs == {}


def test_simulator_reset_and_drain_behave_like_the_driver(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    u = rig.uuid[0]
    inject.inject_process(rig.sim.store, 0, 42, "python")
    with pytest.raises(GpuBusyError):
        SimGroupResetter(rig.sim).reset([u])
    with pytest.raises(Exception, match="use"):  # persistence mode on: drain refused (IN_USE)
        rig.nvml.set_drain(u, True)
    rig.nvml.set_persistence_mode_of(u, False)
    rig.nvml.set_drain(u, True)
    assert rig.nvml.drain_state(u) is True
    inject.kill_process(rig.sim.store, 0, 42)
    inject.set_recovery_action(rig.sim.store, 0, 4)
    SimGroupResetter(rig.sim).reset([u])
    assert rig.nvml.recovery_action_of(u) == 0 and rig.nvml.drain_state(u) is True


def test_the_nvidia_smi_stand_in_resets_by_uuid_and_refuses_like_the_real_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "sim.json"
    sim = open_sim("dgx-h100", state)
    monkeypatch.setenv("NODEAGENT_SIM_STATE", str(state))
    monkeypatch.delenv("NODEAGENT_SIM_MACHINE", raising=False)
    sim.nvmlInit()
    u1, u2 = (str(sim.nvmlDeviceGetUUID(sim.nvmlDeviceGetHandleByIndex(i))) for i in (1, 2))
    inject.set_recovery_action(sim.store, 1, 1)
    inject.set_recovery_action(sim.store, 2, 1)
    assert smi.main(["-r", "-i", f"{u1},{u2}"]) == 0
    assert capsys.readouterr().out.count("was successfully reset") == 2
    assert [g.get("recovery_action") for g in sim.store.read()["gpus"][1:3]] == [0, 0]
    inject.inject_process(sim.store, 1, 7, "python")
    assert smi.main(["-r", "-i", u1]) == 255 and "In use by another client" in capsys.readouterr().err
    inject.inject_lost(sim.store, 3)
    assert smi.main(["--gpu-reset", "-i", "3"]) == 15
    assert smi.main(["-r", "-i", "GPU-nonexistent"]) == 6


def test_metrics_count_runs_and_steps(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from nodeagent.remediation.prommetrics import PromRemediationMetrics

    reg = CollectorRegistry()
    rig = Rig(tmp_path)
    out = run(rig.remediator(metrics=PromRemediationMetrics(reg)).handle(rig.fault(1, 48), rig.gpus, {}))
    assert out.result == "done"
    assert reg.get_sample_value("nodeagent_remediations_total", {"action": "reset-gpu", "result": "done"}) == 1
    assert reg.get_sample_value("nodeagent_remediation_steps_total", {"step": "reset", "result": "ok"}) == 1


def test_monitor_hooks_hold_a_gpu_out_of_the_device_plugin_and_release_it_at_once(tmp_path: Path) -> None:
    from nodeagent.gpu.health import HealthMonitor, HealthMonitorSettings, XidEvent
    from nodeagent.remediation.hooks import MonitorHooks

    rig = Rig(tmp_path)
    changes: list[int] = []
    seen: list[XidEvent] = []

    async def changed() -> None:
        changes.append(1)

    async def scenario() -> None:
        mon = HealthMonitor(rig.nvml, HealthMonitorSettings(), changed)
        mon.gpu_indices = frozenset(range(8))
        mon.xid_listeners.append(seen.append)
        await mon.handle_events([XidEvent(3, 48), XidEvent(9, 48), XidEvent(2, 13)])  # 9: not monitored
        assert [(e.gpu_index, e.xid) for e in seen] == [(3, 48), (2, 13)]  # critical or not
        hooks = MonitorHooks(lambda: [mon], {u: i for i, u in rig.uuid.items()}.__getitem__)
        await hooks.withdraw(rig.uuid[5], "XID 48")
        assert not mon.is_healthy(5) and not mon.is_healthy(5, 1) and "remediation" in mon.unhealthy()[(5, None)]
        await hooks.offer(rig.uuid[3])  # a GPU with a fault: released at once, no quiet window
        assert mon.is_healthy(3)
        await hooks.offer(rig.uuid[5])
        assert mon.is_healthy(5) and mon.unhealthy() == {}

    run(scenario())
    assert len(changes) == 3
