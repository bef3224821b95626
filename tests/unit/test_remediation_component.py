"""The daemon's remediation component, wired as the daemon wires it but around fakes of the API (one object
answering the requests the adapters send) and of PodResources: an XID reaching the device plugin's health
monitor evicts the GPU's own pod, holds the GPU out of the plugin while it is reset and offers it again."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from nodeagent.config import AgentConfig, RemediationSettings, SimulateSettings
from nodeagent.daemon.components.remediation import RemediationComponent
from nodeagent.errors import KubeError
from nodeagent.gpu.health import HealthMonitor, HealthMonitorSettings, XidEvent
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.podresources import Assignment
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator import inject
from nodeagent.simulator.open import open_sim


class FakeKube:
    """Answers what KubePods, NodeClient and KubeNodeSide send; a pod is gone once evicted."""

    def __init__(self, pods: set[str]) -> None:
        self.pods = set(pods)
        self.evictions: list[str] = []
        self.events: list[str] = []
        self.conditions: list[tuple[str, str]] = []

    def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        parts = path.strip("/").split("/")
        if path.endswith("/eviction"):
            pod = f"{parts[3]}/{parts[5]}"
            self.evictions.append(pod)
            self.pods.discard(pod)
            return {}
        if method == "GET" and "pods" in parts:
            pod = f"{parts[3]}/{parts[5]}"
            if pod not in self.pods:
                raise KubeError(f"pod {pod} not found", status=404)
            return {"metadata": {"uid": f"uid-{pod}"}}
        if method == "GET" and parts[-2] == "nodes":
            return {"metadata": {"name": parts[-1], "uid": "node-uid"}}
        if method == "POST" and path.endswith("/events"):
            self.events.append(kw["body"]["reason"])
            return {"metadata": {"name": "e"}}
        if method == "PATCH" and path.endswith("/status"):
            for c in kw["body"]["status"].get("conditions", []):
                self.conditions.append((c["type"], c["status"]))
            return {"metadata": {"name": parts[-2]}}
        raise AssertionError(f"unexpected request {method} {path}")


class FakePodResources:
    def __init__(self, assignments: list[Assignment]) -> None:
        self.assignments = assignments

    def list(self) -> list[Assignment]:
        return self.assignments

    def list_with_claims(self) -> tuple[Sequence[Assignment], Sequence[Any]]:
        return self.assignments, ()

    def close(self) -> None:
        return None


class FakePlugin:
    def __init__(self, monitor: HealthMonitor, device_gpus: dict[tuple[str, str], int]) -> None:
        self._monitor, self._device_gpus = monitor, device_gpus

    def monitor(self) -> HealthMonitor:
        return self._monitor

    def device_gpus(self, gpu_indices: frozenset[int]) -> dict[tuple[str, str], int]:
        return {k: v for k, v in self._device_gpus.items() if v in gpu_indices}

    def mps_manager(self) -> Any:
        return None


class FakeDra:
    """The DRA plane's link: the GPU's devices withdrawn from the slices and listed again; its MPS manager's
    daemons paused and resumed."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.own_monitor: HealthMonitor | None = None

    async def hold_out(self, gpus: set[int], reason: str, effect: str = "NoSchedule") -> None:
        self.calls.append(("hold_out", sorted(gpus), effect))

    async def offer_again(self, gpus: set[int]) -> None:
        self.calls.append(("offer_again", sorted(gpus)))

    def mps_manager(self) -> Any:
        return self

    def monitor(self) -> HealthMonitor | None:  # beside the device plugin the plane has no monitor of its own
        return self.own_monitor

    async def pause_gpu(self, uuid: str) -> list[str]:
        self.calls.append(("pause", uuid))
        return ["claim"]

    async def resume_gpu(self, uuid: str) -> list[str]:
        self.calls.append(("resume", uuid))
        return ["claim"]


class FakeMetricsLink:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        self.reg = CollectorRegistry()

    def registry(self) -> Any:
        return self.reg


class FakeCtx:
    """The parts of the daemon's context the remediation component uses. ``kube`` and ``dra`` may be the real
    ones (tests/integration/test_remediation_dra.py: the API client and a DraLink to a running DRA plane)."""

    def __init__(self, tmp: Path, config: AgentConfig, gpu: Any, kube: Any, plugin: FakePlugin | NoPlugin,
                 pod_resources: FakePodResources, *, node: str = "n1", dra: Any = None) -> None:
        self.config, self.gpu, self.kube = config, gpu, kube
        self.paths = HostPaths(tmp)
        self.inventory = gpu.discover()
        self.node_name = node
        self.dra = FakeDra() if dra is None else dra
        self.shared = type("S", (), {"device_plugin": plugin, "metrics": FakeMetricsLink(), "dra": self.dra})()
        self._pr = pod_resources
        self.tasks: list[asyncio.Task[Any]] = []
        self.status: dict[str, str] = {}

    def pod_resources_client(self) -> FakePodResources:
        return self._pr

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.append(t)
        return t

    def request_resync(self) -> None:
        return None

    def set_status(self, component: str, text: str) -> None:
        self.status[component] = text


def _direct_eviction_config() -> AgentConfig:
    """Remediation on, the agent evicting by itself, short bounds (the simulated dgx-h100)."""
    return dataclasses.replace(AgentConfig(), simulate=SimulateSettings(machine="dgx-h100"),
                               remediation=RemediationSettings(enabled=True, step_timeout=5.0, evictions="direct",
                                                               eviction_timeout=5.0, eviction_grace=1.0))


def test_an_xid_at_the_monitor_remediates_the_gpu_through_the_component(tmp_path: Path) -> None:
    sim = open_sim("dgx-h100")
    gpu = adapter_for_sim(sim, HostPaths(tmp_path))
    inv = gpu.discover()
    uuid = {g.index: g.uuid for g in inv.gpus}
    inject.inject_process(sim.store, 3, 33, "python")
    inject.inject_process(sim.store, 5, 55, "python")
    kube = FakeKube({"team/on-3", "team/on-5"})
    pr = FakePodResources([Assignment("team", "on-3", "c", "nvidia.com/gpu", (uuid[3],)),
                           Assignment("team", "on-5", "c", "nvidia.com/gpu", (uuid[5],))])
    changes: list[bool] = []

    async def scenario() -> None:
        monitor = HealthMonitor(gpu, HealthMonitorSettings(), lambda: _note(changes, monitor))
        monitor.gpu_indices = frozenset(uuid)
        plugin = FakePlugin(monitor, {("nvidia.com/gpu", uuid[i]): i for i in uuid})
        cfg = _direct_eviction_config()
        ctx = FakeCtx(tmp_path, cfg, gpu, kube, plugin, pr)
        comp = RemediationComponent(ctx)  # type: ignore[arg-type]
        await comp.start(ctx)  # type: ignore[arg-type]
        assert comp.ready.is_set()
        real_evict = comp._rem.pods._evict

        def evict_and_end(pod: str, grace: float) -> Any:  # the kubelet ends the container's process
            out = real_evict(pod, grace)
            inject.kill_process(sim.store, 3, 33)
            return out

        comp._rem.pods._evict = evict_and_end
        inject.inject_xid(sim.store, 3, 48, recovery_action=1)
        await monitor.handle_events([XidEvent(3, 48)])
        await asyncio.gather(*ctx.tasks)
        reg = ctx.shared.metrics.reg
        assert reg.get_sample_value("nodeagent_remediations_total", {"action": "reset-gpu", "result": "done"}) == 1
        # held out of the DRA plane (tainted, or out of its slices), its MPS daemons stopped for the reset and
        # started again, offered again
        assert ctx.dra.calls == [("hold_out", [3], "NoSchedule"), ("pause", uuid[3]), ("resume", uuid[3]),
                                 ("offer_again", [3])]

    asyncio.run(scenario())
    assert kube.evictions == ["team/on-3"] and "team/on-5" in kube.pods
    assert gpu.recovery_action_of(uuid[3]) == 0 and gpu.process_count(uuid[5]) == 1
    assert kube.events.count("GPURemediationStep") == 8 and "GPURemediated" in kube.events
    assert ("nodeagent.io/GPURemediation", "True") in kube.conditions
    assert kube.conditions[-1] == ("nodeagent.io/GPURemediation", "False")
    assert changes == [False, True]  # held out (Unhealthy), then offered (Healthy) again


async def _note(changes: list[bool], monitor: HealthMonitor) -> None:
    changes.append(monitor.is_healthy(3))


def test_a_quarantined_gpu_stays_out_after_a_restart(tmp_path: Path) -> None:
    from nodeagent.remediation.record import RecordFile, RecordStore, record_path

    sim = open_sim("dgx-h100")
    gpu = adapter_for_sim(sim, HostPaths(tmp_path))
    uuid = {g.index: g.uuid for g in gpu.discover().gpus}
    RecordStore(record_path(HostPaths(tmp_path))).save(RecordFile(quarantined={uuid[6]: "reset 3 times"}))

    async def scenario() -> tuple[HealthMonitor, FakeDra]:
        monitor = HealthMonitor(gpu, HealthMonitorSettings(), _nothing)
        monitor.gpu_indices = frozenset(uuid)
        cfg = dataclasses.replace(AgentConfig(), remediation=RemediationSettings(
            enabled=True, evictions="direct", noexecute_when_out=True))
        ctx = FakeCtx(tmp_path, cfg, gpu, FakeKube(set()), FakePlugin(monitor, {}), FakePodResources([]))
        await RemediationComponent(ctx).start(ctx)  # type: ignore[arg-type]
        await asyncio.gather(*ctx.tasks)
        return monitor, ctx.dra

    monitor, dra = asyncio.run(scenario())
    assert not monitor.is_healthy(6) and "quarantined" in monitor.unhealthy()[(6, None)]
    assert all(monitor.is_healthy(i) for i in uuid if i != 6)
    # the DRA devices: NoSchedule when taken out, NoExecute once it stays out (the policy says so)
    assert dra.calls == [("hold_out", [6], "NoSchedule"), ("hold_out", [6], "NoExecute")]


class NoPlugin:
    """Plane "dra" alone: no device plugin runs."""

    def monitor(self) -> None:
        return None

    def device_gpus(self, gpu_indices: frozenset[int]) -> dict[tuple[str, str], int]:
        return {}

    def mps_manager(self) -> None:
        return None


def test_with_the_dra_plane_alone_its_own_monitor_feeds_the_remediation(tmp_path: Path) -> None:
    sim = open_sim("dgx-h100")
    gpu = adapter_for_sim(sim, HostPaths(tmp_path))
    uuid = {g.index: g.uuid for g in gpu.discover().gpus}
    kube = FakeKube(set())

    async def scenario() -> tuple[FakeCtx, list[bool]]:
        changes: list[bool] = []
        monitor = HealthMonitor(gpu, HealthMonitorSettings(), lambda: _note(changes, monitor))
        monitor.gpu_indices = frozenset(uuid)
        cfg = dataclasses.replace(AgentConfig(), simulate=SimulateSettings(machine="dgx-h100"),
                                  remediation=RemediationSettings(enabled=True, evictions="direct", step_timeout=5.0))
        ctx = FakeCtx(tmp_path, cfg, gpu, kube, NoPlugin(), FakePodResources([]))
        ctx.dra.own_monitor = monitor
        comp = RemediationComponent(ctx)  # type: ignore[arg-type]
        await comp.start(ctx)  # type: ignore[arg-type]
        assert monitor.xid_listeners == [comp._on_xid]
        await comp.resync()  # listening once, whatever the resyncs
        assert monitor.xid_listeners == [comp._on_xid]
        inject.inject_xid(sim.store, 3, 48, recovery_action=1)
        await monitor.handle_events([XidEvent(3, 48)])
        await asyncio.gather(*ctx.tasks)
        return ctx, changes

    ctx, changes = asyncio.run(scenario())
    assert gpu.recovery_action_of(uuid[3]) == 0 and "GPURemediated" in kube.events
    assert ctx.dra.calls == [("hold_out", [3], "NoSchedule"), ("pause", uuid[3]), ("resume", uuid[3]),
                             ("offer_again", [3])]
    assert changes == [False, True]  # the DRA plane's monitor held it out, then released it


async def _nothing() -> None:
    return None


def test_a_mig_gpu_gets_its_layout_back_after_the_reset(tmp_path: Path) -> None:
    """The reset destroys the GPU's MIG instances; the restore step lays the same profiles out at the same
    placements before the GPU is offered; the pods of both instances were evicted."""
    from nodeagent.mig.apply import layout_of

    sim = open_sim("dgx-h100")
    gpu = adapter_for_sim(sim, HostPaths(tmp_path))
    inject.write_mig_layout(sim.store, 2, ["3g.40gb", "2g.20gb", "1g.10gb"])
    inv = gpu.discover()
    before = layout_of(inv.gpus[2])
    migs = [d.uuid for d in inv.gpus[2].mig_devices]
    assert len(before) == 3
    uuid = {g.index: g.uuid for g in inv.gpus}
    kube = FakeKube({"team/mig-0", "team/mig-1"})
    pr = FakePodResources([Assignment("team", "mig-0", "c", "nvidia.com/mig-3g.40gb", (migs[0],)),
                           Assignment("team", "mig-1", "c", "nvidia.com/mig-2g.20gb", (migs[1],))])

    async def scenario() -> None:
        monitor = HealthMonitor(gpu, HealthMonitorSettings(), _nothing)
        monitor.gpu_indices = frozenset(uuid)
        plugin = FakePlugin(monitor, {(a.resource, a.device_ids[0]): 2 for a in pr.assignments})
        cfg = _direct_eviction_config()
        ctx = FakeCtx(tmp_path, cfg, gpu, kube, plugin, pr)
        comp = RemediationComponent(ctx)  # type: ignore[arg-type]
        await comp.start(ctx)  # type: ignore[arg-type]
        inject.inject_xid(sim.store, 2, 48, recovery_action=1)
        await monitor.handle_events([XidEvent(2, 48)])
        await asyncio.gather(*ctx.tasks)

    asyncio.run(scenario())
    assert sorted(kube.evictions) == ["team/mig-0", "team/mig-1"]
    after = gpu.discover().gpus[2]
    assert gpu.recovery_action_of(uuid[2]) == 0 and "GPURemediated" in kube.events
    assert after.mig_current and layout_of(after) == before  # the same profiles at the same placements


def test_a_successor_holds_the_withdrawn_gpus_out_from_its_first_list_and_watch() -> None:
    """The previous agent was killed in the middle of a reset of GPU 3 (withdrawn), before withdrawing GPU 4,
    and had quarantined GPU 6: its successor's device plugin marks GPUs 3 and 6 Unhealthy in its very first
    ListAndWatch answer, before any remediation has resumed; GPU 4 and the others are Healthy."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="na-", dir="/tmp") as root:  # socket paths under 108 bytes
        _successor_first_answer(Path(root))


def _successor_first_answer(root: Path) -> None:
    import grpc

    from nodeagent.daemon import Daemon
    from nodeagent.daemon.components.deviceplugin import DevicePluginComponent
    from nodeagent.deviceplugin.api import pb2, pb2_grpc
    from nodeagent.remediation.planner import Plan, Step
    from nodeagent.remediation.policy import Action
    from nodeagent.remediation.record import RecordFile, RecordStore, RunRecord, record_path
    from nodeagent.sdnotify import Notifier

    sim = open_sim("dgx-h100")
    paths = HostPaths(root)
    gpu = adapter_for_sim(sim, paths)
    inv = gpu.discover()
    uuid = {g.index: g.uuid for g in inv.gpus}
    steps = (Step.WITHDRAW, Step.EVICT, Step.STOP_USERS, Step.RESET, Step.VERIFY, Step.RESTORE, Step.OFFER)

    def run(i: int, done: tuple[Step, ...]) -> RunRecord:
        return RunRecord(Plan(Action.RESET_GPU, f"XID 48 on GPU {i}", (uuid[i],), (), steps), done)

    RecordStore(record_path(paths)).save(RecordFile(
        runs={uuid[3]: run(3, (Step.WITHDRAW, Step.EVICT)), uuid[4]: run(4, ())},
        quarantined={uuid[6]: "reset 3 times"}))
    cfg = dataclasses.replace(AgentConfig(), simulate=SimulateSettings(machine="dgx-h100"),
                              remediation=RemediationSettings(enabled=True))

    def first_answer(sock: Path) -> dict[str, str]:
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            stream = pb2_grpc.DevicePluginStub(ch).ListAndWatch(pb2.Empty(), timeout=10)
            answer = next(stream)
            stream.cancel()
        return {d.ID: d.health for d in answer.devices}

    async def scenario() -> dict[str, str]:
        d = Daemon(cfg, paths, gpu_factory=lambda c, p: gpu, kube_factory=lambda c: object(), specs=[],
                   notifier=Notifier({}))
        comp = DevicePluginComponent(d.ctx)
        await comp.on_inventory(inv)  # the first inventory starts the servers; no remediation runs yet
        try:
            return await asyncio.to_thread(first_answer, comp.service.plugin_dir / "nvidia-gpu.sock")
        finally:
            await comp.service.stop()

    health = asyncio.run(scenario())
    assert set(health) == set(uuid.values())
    assert {i for i, u in uuid.items() if health[u] == "Unhealthy"} == {3, 6}
    assert all(health[uuid[i]] == "Healthy" for i in uuid if i not in (3, 6))


def test_a_successor_dra_plane_holds_them_out_before_its_first_slices(tmp_path: Path) -> None:
    """Plane "dra" alone: before the DRA driver starts (and publishes its first ResourceSlices) its health map
    and its own monitor already hold GPU 3 (withdrawn by the previous agent) out; without remediation, nothing."""
    from nodeagent.daemon import Daemon
    from nodeagent.daemon.components.dra import DraPlaneComponent
    from nodeagent.remediation.planner import Plan, Step
    from nodeagent.remediation.policy import Action
    from nodeagent.remediation.record import RecordFile, RecordStore, RunRecord, record_path
    from nodeagent.sdnotify import Notifier

    sim = open_sim("dgx-h100")
    paths = HostPaths(tmp_path)
    gpu = adapter_for_sim(sim, paths)
    inv = gpu.discover()
    uuid = {g.index: g.uuid for g in inv.gpus}
    plan = Plan(Action.RESET_GPU, "XID 48", (uuid[3],), (), (Step.WITHDRAW, Step.RESET, Step.OFFER))
    RecordStore(record_path(paths)).save(RecordFile(runs={uuid[3]: RunRecord(plan, (Step.WITHDRAW,))}))

    class Started(Exception):
        pass

    def first_look(enabled: bool) -> tuple[dict[Any, str], dict[int, str]]:
        cfg = dataclasses.replace(AgentConfig(), simulate=SimulateSettings(machine="dgx-h100"),
                                  remediation=RemediationSettings(enabled=enabled))
        cfg = dataclasses.replace(cfg, device_plugin=dataclasses.replace(cfg.device_plugin, plane="dra"))
        d = Daemon(cfg, paths, gpu_factory=lambda c, p: gpu, kube_factory=lambda c: object(), specs=[],
                   notifier=Notifier({}))
        comp = DraPlaneComponent(d.ctx)
        seen: list[tuple[dict[Any, str], dict[int, str]]] = []

        async def start(inventory: Any) -> None:  # what the driver would publish first
            assert comp.dra.monitor is not None
            seen.append((dict(comp.dra._unhealthy), dict(comp.dra.monitor.held)))
            raise Started

        comp.dra.start = start  # type: ignore[method-assign]
        with pytest.raises(Started):  # stopped right there
            asyncio.run(comp._start(inv))
        return seen[0]

    unhealthy, held = first_look(True)
    assert set(unhealthy) == {(3, None)} and set(held) == {3} and "XID 48" in held[3]
    assert first_look(False) == ({}, {})
