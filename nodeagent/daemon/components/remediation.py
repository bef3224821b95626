"""GPU remediation as a daemon component: the health monitor (the device plugin's, or the DRA plane's when it
runs alone) tells it of every XID; it decides, plans and runs the one-GPU pipeline (``nodeagent.remediation``)
in the background, one run per GPU, and finishes or rolls back what a previous agent left in the state record."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from nodeagent.daemon.supervisor import Component, Context
from nodeagent.errors import NodeAgentError, NvmlError
from nodeagent.gpu.inventory import Inventory

log = logging.getLogger(__name__)

RECENT_XID_S = 600.0  # how long an XID counts as "recent" for the catalog's combinations (48 after 63/64)


def held_at_start(ctx: Context, inventory: Inventory) -> dict[int, str]:
    """GPU index → why: the GPUs the remediation record says are out of service (a run past its withdrawal
    when the previous agent stopped, or quarantined). The device plugin and the DRA plane hold them out from
    their first answer, so the kubelet never counts them healthy before the remediation resumes. Nothing
    when no remediation runs here (nothing would ever offer them again)."""
    if not ctx.config.remediation.enabled or ctx.kube is None:
        return {}
    from nodeagent.remediation.record import RecordStore, held_out, record_path

    index = {g.uuid: g.index for g in inventory.gpus}
    return {index[u]: why for u, why in held_out(RecordStore(record_path(ctx.paths)).load()).items() if u in index}


class AdapterResetter:
    """Resets through the NVML adapter's own resetter, GPU by GPU (the simulator's reset, or on a real node
    ``nvidia-smi --gpu-reset -i N``)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def reset(self, uuids: Any) -> None:
        inv = self.ctx.inventory
        index = {g.uuid: g.index for g in inv.gpus} if inv is not None else {}
        for u in uuids:
            self.ctx.gpu.reset_gpu(index[u])


class LinkedMetrics:
    """The pipeline's metrics in the running metrics component's registry (none while none runs)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._by_registry: dict[int, Any] = {}

    def _current(self) -> Any:
        registry = self.ctx.shared.metrics.registry()
        if registry is None:
            return None
        if id(registry) not in self._by_registry:
            from nodeagent.remediation.prommetrics import PromRemediationMetrics

            self._by_registry = {id(registry): PromRemediationMetrics(registry)}  # a rebuilt component's anew
        return self._by_registry[id(registry)]

    def step(self, step: str, result: str, seconds: float) -> None:
        m = self._current()
        if m is not None:
            m.step(step, result, seconds)

    def run(self, action: str, result: str, seconds: float) -> None:
        m = self._current()
        if m is not None:
            m.run(action, result, seconds)


class NoResetter:
    """Under a sandbox root (``--root DIR``) no command runs: a reset fails, saying so."""

    def reset(self, uuids: Any) -> None:
        raise NvmlError(f"GPU {','.join(uuids)}: not reset: nothing is executed under a sandbox root")


class RemediationComponent(Component):
    name = "remediation"

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self._ctx = ctx
        self._rem: Any = None
        self._recent: dict[int, deque[tuple[float, int]]] = {}
        self._listening: list[Any] = []
        self._pod_gpus: dict[str, tuple[str, ...]] = {}  # pod → the GPUs it holds (named in eviction requests)
        self._reboot_checked = False  # the reboot-required condition of an earlier run looked at (once)
        self._layouts: dict[str, tuple[tuple[str, int], ...]] = {}  # GPU → its MIG layout before the reset

    async def start(self, ctx: Context) -> None:
        from nodeagent.kube.node import NodeClient
        from nodeagent.remediation.commands import CommandReboot, CommandResetter
        from nodeagent.remediation.hooks import MonitorHooks
        from nodeagent.remediation.kubeside import KubeNodeSide, KubePods
        from nodeagent.remediation.pipeline import PipelineSettings, Remediator, Resetter
        from nodeagent.remediation.policy import load_catalog, parse_overrides
        from nodeagent.remediation.record import RecordStore, record_path

        cfg = ctx.config.remediation
        settings = PipelineSettings(
            eviction_grace_s=cfg.eviction_grace, eviction_timeout_s=cfg.eviction_timeout,
            step_timeout_s=cfg.step_timeout, max_resets=cfg.max_resets, reset_window_s=cfg.reset_window,
            fabric_manager=cfg.fabric_manager, cordon_on_failure=cfg.cordon_on_failure,
            overrides=parse_overrides(cfg.xid_actions))
        simulated = bool(ctx.config.simulate.machine or ctx.config.simulate.state)
        on_node = ctx.paths.is_node_root  # under a sandbox root nothing is ever executed
        smi = str(ctx.paths(ctx.config.cdi.driver_root.rstrip("/") + "/usr/bin/nvidia-smi"))
        resetter: Resetter
        if simulated and not cfg.reset_command:
            resetter = AdapterResetter(ctx)
        elif on_node:
            resetter = CommandResetter(cfg.reset_command, smi=smi, timeout_s=cfg.step_timeout)
        else:
            resetter = NoResetter()

        monitors = self._monitors

        def index_of(uuid: str) -> int:
            inv = ctx.inventory
            for g in inv.gpus if inv is not None else ():
                if g.uuid == uuid:
                    return g.index
            raise NodeAgentError(f"GPU {uuid} is not in the inventory", subject=uuid)

        pods: Any
        if cfg.evictions == "direct":
            pods = KubePods(ctx.kube)
        else:
            from nodeagent.remediation.nodepods import ControllerPods

            pods = ControllerPods(ctx.kube, ctx.node_name, timeout_s=cfg.eviction_timeout,
                                  gpus_of=lambda pod: self._pod_gpus.get(pod, ()))
            try:  # requests a previous agent left: its runs start again from the record
                await asyncio.to_thread(pods.withdraw_all)
            except NodeAgentError as e:
                log.warning("remediation: eviction requests left on the Node not withdrawn: %s", e)
        from nodeagent.daemon.components.fleetlink import RemediationSlots, fleet_gate

        node = NodeClient(ctx.kube, ctx.node_name)
        fleet = fleet_gate(ctx, node)  # a GPU taken out of service holds a slot of the fleet's budget
        self._rem = Remediator(
            settings, load_catalog(), ctx.gpu, resetter, pods,  # type: ignore[arg-type]
            KubeNodeSide(node, events=ctx.config.publish.events),
            MonitorHooks(monitors, index_of, stop_users=self._stop_users, restore=self._restore,
                         planes=ctx.shared.dra, noexecute_when_out=cfg.noexecute_when_out), store=RecordStore(record_path(ctx.paths)),
            metrics=LinkedMetrics(ctx), reboot=CommandReboot(cfg.reboot_command) if cfg.reboot_command and on_node else None,
            gate=RemediationSlots(fleet) if fleet is not None else None)
        self._listen()
        hooks = self._rem.hooks
        for uuid, why in sorted(self._rem.record.quarantined.items()):  # they stay out across restarts
            ctx.spawn(self._keep_out(hooks, uuid, why), f"remediation: GPU {uuid} quarantined")
        if self._rem.record.runs:
            ctx.spawn(self._resume(), "remediation resume")
        if ctx.inventory is not None:
            self._check_reboot_required(ctx.inventory)
        self.ready.set()
        ctx.set_status(self.name, "watching for GPU faults")

    def _monitors(self) -> list[Any]:
        """The health monitors running now: the device plugin's, and the DRA plane's own when it runs alone
        (plane "dra"; beside the device plugin the plane follows the plugin's monitor and has none)."""
        found = [self._ctx.shared.device_plugin.monitor(), self._ctx.shared.dra.monitor()]
        return [m for i, m in enumerate(found) if m is not None and all(m is not o for o in found[:i])]

    def _listen(self) -> None:
        """Listen to the current monitors (a reload or a late plane start may have replaced them)."""
        current = self._monitors()
        for m in current:
            if not any(m is seen for seen in self._listening):
                m.xid_listeners.append(self._on_xid)
        self._listening = current

    async def on_inventory(self, inventory: Inventory) -> None:
        self._listen()
        self._check_reboot_required(inventory)

    def _check_reboot_required(self, inventory: Inventory) -> None:
        """Once per agent, with the first inventory: a reboot-required condition nothing needs any more (the
        node rebooted, the GPU back) is cleared."""
        if self._reboot_checked or self._rem is None:
            return
        self._reboot_checked = True
        uuids = [g.uuid for g in inventory.gpus]
        self._ctx.spawn(self._clear_reboot_required(uuids), "remediation: reboot-required condition")

    async def _clear_reboot_required(self, uuids: list[str]) -> None:
        try:
            if await self._rem.clear_reboot_required(uuids):
                log.info("remediation: no GPU needs a reboot any more; condition RebootRequired cleared")
        except NodeAgentError as e:
            log.warning("remediation: the RebootRequired condition not cleared: %s", e)

    async def resync(self) -> None:
        self._listen()

    def _on_xid(self, ev: Any) -> None:
        now = time.monotonic()
        recent = self._recent.setdefault(ev.gpu_index, deque(maxlen=32))
        earlier = tuple(x for t, x in recent if now - t < RECENT_XID_S)
        recent.append((now, ev.xid))
        self._ctx.spawn(self._handle(ev.gpu_index, ev.xid, earlier), f"remediation of GPU {ev.gpu_index}")

    def _mps_managers(self) -> list[Any]:
        """The MPS managers running now: the device plugin's and the DRA plane's (None of a plane without)."""
        return [m for m in (self._ctx.shared.device_plugin.mps_manager(), self._ctx.shared.dra.mps_manager())
                if m is not None]

    async def _stop_users(self, uuid: str) -> None:
        """Before the reset: the GPU's MIG layout noted (a reset destroys its instances), its MPS daemons
        stopped."""
        from nodeagent.mig.apply import layout_of

        try:
            inv = await asyncio.to_thread(self._ctx.gpu.discover)
            gpu = next((g for g in inv.gpus if g.uuid == uuid), None)
        except NodeAgentError as e:
            log.warning("GPU %s: its MIG layout not read before the reset: %s", uuid, e)
            gpu = None
        if gpu is not None and gpu.mig_current and uuid not in self._layouts:
            self._layouts[uuid] = layout_of(gpu)
        await self._pause_mps(uuid)

    async def _restore(self, uuid: str) -> None:
        """After the reset: the MIG instances it had laid out again (same profiles at the same placements),
        then its MPS daemons started again."""
        layout = self._layouts.pop(uuid, ())
        if layout:
            await asyncio.to_thread(self._relay_mig, uuid, layout)
        await self._resume_mps(uuid)

    def _relay_mig(self, uuid: str, layout: tuple[tuple[str, int], ...]) -> None:
        from nodeagent.mig.apply import layout_of

        nvml = self._ctx.gpu

        def current() -> Any:
            found = next((g for g in nvml.discover().gpus if g.uuid == uuid), None)
            if found is None:
                raise NodeAgentError(f"GPU {uuid} is gone after its reset", subject=uuid)
            return found

        gpu = current()
        if not gpu.mig_current:  # a GPU that forgets MIG mode at a reset (Hopper): on again, as MIG apply does
            if nvml.set_mig_mode(gpu.index, True):
                nvml.reset_gpu(gpu.index)
            gpu = current()
        have = set(layout_of(gpu))
        for profile, start in sorted(set(layout) - have, key=lambda p: p[1]):
            self._ctx.gpu.create_mig_device(gpu.index, profile, start)
        log.info("GPU %s: MIG layout laid out again after the reset: %s", uuid,
                 ", ".join(f"{p}@{s}" for p, s in layout))

    async def _pause_mps(self, uuid: str) -> None:
        for manager in self._mps_managers():
            names = await manager.pause_gpu(uuid)
            if names:
                log.info("GPU %s: MPS control daemons stopped for its reset: %s", uuid, ", ".join(names))

    async def _resume_mps(self, uuid: str) -> None:
        for manager in self._mps_managers():
            names = await manager.resume_gpu(uuid)
            if names:
                log.info("GPU %s: MPS control daemons started again: %s", uuid, ", ".join(names))

    @staticmethod
    async def _keep_out(hooks: Any, uuid: str, why: str) -> None:
        try:
            await hooks.withdraw(uuid, f"quarantined: {why}")
            await hooks.stays_out(uuid, f"quarantined: {why}")
        except NodeAgentError as e:  # a GPU no longer on the node
            log.info("quarantined GPU %s not withdrawn: %s", uuid, e)

    async def _resume(self) -> None:
        for out in await self._rem.resume():
            log.info("remediation of GPU %s resumed: %s %s", out.plan.target, out.result, out.detail)

    async def _handle(self, index: int, xid: int, recent: tuple[int, ...]) -> None:
        from nodeagent.kube.podresources import holders_by_gpu
        from nodeagent.remediation.holders import dra_holders, merge
        from nodeagent.remediation.pipeline import Fault
        from nodeagent.remediation.planner import facts_from_inventory

        ctx = self._ctx
        inv = ctx.inventory
        if inv is None:
            return
        uuids = {g.index: g.uuid for g in inv.gpus}
        try:
            action = int(await asyncio.to_thread(ctx.gpu.recovery_action, index))
        except NodeAgentError:
            action = 0
        holders: dict[str, list[str]] = {}
        client = ctx.pod_resources_client()
        try:
            assignments, uses = await asyncio.to_thread(client.list_with_claims)
            device_gpus = ctx.shared.device_plugin.device_gpus(frozenset(uuids))
            plugin = {uuids[gpu]: list(pods) for gpu, pods in holders_by_gpu(assignments, device_gpus).items()}
            # pods holding a GPU through a DRA claim allocated from this node's pool, found the same way
            holders = merge(plugin, dra_holders(uses, ctx.node_name, uuids))
            for uuid, pods in holders.items():
                for pod in pods:
                    self._pod_gpus[pod] = tuple(sorted({*self._pod_gpus.get(pod, ()), uuid}))
        except NodeAgentError as e:
            log.warning("GPU %d: which pods hold the GPUs is unknown (%s); none are evicted", index, e)
        finally:
            client.close()
        out = await self._rem.handle(Fault(uuids[index], xid, action, recent), facts_from_inventory(inv), holders)
        log.log(logging.WARNING if out.result == "failed" else logging.INFO,
                "GPU %d: XID %d: %s → %s %s (%.1fs)", index, xid, out.plan.action.value, out.result, out.detail,
                out.seconds)
        ctx.request_resync()
