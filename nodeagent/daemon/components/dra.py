"""The DRA driver ``gpu.nodeagent.io`` as a daemon component (``[device_plugin] plane = "dra"`` or ``"both"``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodeagent.config import AgentConfig
from nodeagent.daemon.planes import LEDGER_FILE, PlaneSplit, check_dra_gpus, only_the_split_changed
from nodeagent.daemon.supervisor import Component, Context, close_quietly
from nodeagent.deadline import within
from nodeagent.errors import ConfigError
from nodeagent.gpu.health import HealthKey
from nodeagent.gpu.inventory import Gpu, Inventory

if TYPE_CHECKING:
    from nodeagent.dra.devices import DraDevice
    from nodeagent.dra.service import ClaimRef
    from nodeagent.kube.podresources import PodResourcesClient

log = logging.getLogger(__name__)

MOVE_POLL_S = 1.0  # how often a move waiting for its holders looks again (an unprepare wakes it at once)


def _describe_split(split: PlaneSplit) -> str:
    parts = [f"DRA serves {', '.join(map(str, sorted(split.dra))) or 'no GPU'}"]
    if split.to_dra:
        parts.append(f"GPU(s) {', '.join(map(str, sorted(split.to_dra)))} withdrawn from the device plugin, "
                     "moving to DRA")
    if split.to_plugin:
        parts.append(f"GPU(s) {', '.join(map(str, sorted(split.to_plugin)))} withdrawn from DRA, moving to "
                     "the device plugin")
    return "; ".join(parts)


class DraPlaneComponent(Component):
    """Runs ``nodeagent.dra.component.DraComponent``: the kubelet's DRA sockets and the node's ResourceSlices.

    Plane "dra": every GPU, with its own health monitor on the daemon's event pumps (no device plugin runs).
    Plane "both": only ``[dra] gpus``; health comes from the device plugin's monitor through
    ``ctx.shared.health`` (one NVML source feeds one monitor). The GPUs each plane offers are the ledger's
    (``ctx.shared.planes``): a reload that changes only ``[dra] gpus`` moves GPUs between the running
    planes (``reconfigure`` withdraws, the move loop offers each one once nothing holds it).

    Stopping withdraws the ResourceSlices only when the plane goes away (a reload to plane "device-plugin",
    the API switched off, another node or cluster); on process exit, and when a reload merely rebuilds the
    plane, the slices stay: prepared claims keep running and the next start answers for them again.
    """

    name = "dra"

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        from nodeagent.dra.component import DraComponent
        from nodeagent.gpu.health import HealthMonitorSettings

        cfg = ctx.config
        self._ctx = ctx
        self._plane = cfg.device_plugin.plane
        self._node_name = ctx.node_name
        self._kubeconfig = cfg.kubeconfig
        alone = self._plane == "dra"
        # plane "both": the ledger says which GPUs are DRA's (a move under way survives this rebuild)
        ledger = ctx.shared.planes
        ledger.bind(ctx.paths.state_dir / LEDGER_FILE, ctx.paths)  # a move under way before a restart
        split = None
        if not alone:
            wanted = frozenset(cfg.dra.gpus)
            split = ledger.split or PlaneSplit.initial(wanted)
            if split.wanted_dra != wanted:
                split = split.toward(wanted, [g.index for g in ctx.inventory.gpus]) if ctx.inventory is not None \
                    else PlaneSplit.initial(wanted)
        ledger.split = split
        served = split.dra_served if split is not None else frozenset()

        def beside_the_device_plugin(gpu: Gpu) -> bool:
            return gpu.index in served

        from nodeagent.dra.mps import ClaimMps
        from nodeagent.nvmlsource import mps_manager

        mps = mps_manager(ctx.paths, cfg.cdi.driver_root, cfg.simulate.machine or None,
                          Path(cfg.simulate.state) if cfg.simulate.state else None, ctx.gpu, "dra")
        self.dra = DraComponent(
            paths=ctx.paths,
            kube=ctx.kube,
            node_name=ctx.node_name,
            kubelet_dir=ctx.host_path(cfg.kubelet.dir),
            kubelet_host_dir=Path(cfg.kubelet.dir),  # the endpoint the kubelet dials (a host path, not --root's)
            verify_interval_s=cfg.dra.verify_interval,
            gpu_filter=None if alone else beside_the_device_plugin,
            nvml=ctx.gpu if alone else None,
            health_settings=HealthMonitorSettings.from_env(
                recovery_window_s=cfg.health.window, poll_interval_s=cfg.health.poll_interval
            ) if alone else None,
            pumps=ctx.pumps,
            mig=ctx.gpu,
            dynamic_mig=cfg.dra.dynamic_mig,
            shared_gpus=cfg.dra.shared_gpus,
            scheduler=ctx.scheduler,
            mps=ClaimMps(mps, ctx.host_path, ctx.paths.publish),
            leaving=split.to_plugin if split is not None else (),
        )
        self._started = False
        self._wake = asyncio.Event()  # a move to start or a claim unprepared: look at the holders again
        self._split_lock = asyncio.Lock()  # one change of the split at a time (a reload, a finished move)
        self._waiting: dict[int, str] = {}  # GPU → the holders last reported as keeping its move waiting
        self._mover: asyncio.Task[None] | None = None
        self._pod_resources: PodResourcesClient | None = None
        from nodeagent.computedomain.report import NodeReporter

        # the ComputeDomains whose channel claims are prepared here, reported on the own Node; Ready only while
        # the host IMEX daemon ([imex], the racks component) answers READY
        self._reporter = NodeReporter(ctx.kube, ctx.node_name, imex_ready=self._imex_ready) \
            if ctx.kube is not None else None
        self._imex_seen: bool | None = None

    async def start(self, ctx: Context) -> None:
        if ctx.inventory is None:
            return  # discovery failed: the first inventory starts the plane
        await self._start(ctx.inventory)

    async def _start(self, inventory: Inventory) -> None:
        self.dra.vfio_devices = list(self._ctx.shared.dra.vfio)  # the workload switch's, if it ran first
        await self.dra.set_foreign(self._ctx.shared.dra.foreign)  # another DRA driver's GPUs, as last seen
        from nodeagent.daemon.components.remediation import held_at_start

        held = await asyncio.to_thread(held_at_start, self._ctx, inventory)
        if held:  # GPUs a killed predecessor's remediation took out: Unhealthy in the first slices already
            if self.dra.monitor is not None:
                self.dra.monitor.held.update(held)
            await self.dra.set_health({(i, None): why for i, why in held.items()})
        await self.dra.start(inventory)
        self._started = True
        if self._plane == "both":
            await self._ctx.shared.health.attach(self)
        self._ctx.shared.dra.attach(self)
        if self._plane == "both":
            try:  # a reload refuses such a config; at start the GPUs are known only now
                check_dra_gpus(self._ctx.config.dra.gpus, [g.index for g in inventory.gpus],
                               self._ctx.config.source or "config")
            except ConfigError as e:
                log.error("%s (ignored)", e)
            await self._ctx.shared.planes.exclude_from_plugin()  # what this build's ledger withdrew
            self._pod_resources = self._ctx.pod_resources_client()
            self._mover = self._ctx.spawn(self._move_loop(), "plane moves")
        self.dra.on_claims_changed = self._claims_changed
        self._imex_seen = self._imex_ready()
        self._ctx.shared.conditions.subscribe(self._imex_changed)
        self._claims_changed()
        gpus = sorted({d.gpu_index for d in self.dra.devices})
        log.info("DRA driver gpu.nodeagent.io serves %d device(s) on GPU(s) %s", len(self.dra.devices),
                 ", ".join(map(str, gpus)) or "none")
        self._ctx.set_status(self.name, f"{len(self.dra.devices)} device(s)")

    def _imex_ready(self) -> bool:
        """Without ``[imex] enabled`` no daemon is supervised here: a prepared domain is Ready."""
        imex = self._ctx.shared.conditions.imex
        return not self._ctx.config.imex.enabled or (imex is not None and imex.ready)

    def _imex_changed(self) -> None:
        """A condition input changed: when it is the IMEX daemon's readiness, the domains' report follows."""
        ready = self._imex_ready()
        if ready != self._imex_seen:
            self._imex_seen = ready
            if self._reporter is not None and self._started:
                self._ctx.spawn(self._report_domains(), "computedomain report")

    def _claims_changed(self) -> None:
        self._wake.set()  # a move waiting for its holders looks again
        if self._reporter is not None:
            self._ctx.spawn(self._report_domains(), "computedomain report")

    async def _report_domains(self) -> None:
        from nodeagent.errors import KubeError

        assert self._reporter is not None
        try:
            await asyncio.to_thread(self._reporter.sync, self.dra.compute_domains())
        except KubeError as e:  # the next claim change or resync tries again
            log.warning("ComputeDomain report not written: %s", e)

    async def set_health(self, unhealthy: Mapping[HealthKey, str]) -> None:
        if self._started:
            await self.dra.set_health(unhealthy)

    async def on_inventory(self, inventory: Inventory) -> None:
        if not self._started:
            await self._start(inventory)
            return
        await self.dra.on_inventory(inventory)
        self._ctx.set_status(self.name, f"{len(self.dra.devices)} device(s)")

    async def withdraw(self, gpu_indices: set[int]) -> None:
        if self._started:
            await self.dra.withdraw(gpu_indices)

    async def readvertise(self, gpu_indices: set[int]) -> None:
        if self._started:
            await self.dra.readvertise(gpu_indices)

    async def hold_out(self, gpu_indices: set[int], reason: str, effect: str) -> None:
        if self._started:
            await self.dra.hold_out(gpu_indices, reason, effect)

    async def offer_again(self, gpu_indices: set[int]) -> None:
        if self._started:
            await self.dra.offer_again(gpu_indices)

    async def update(self, inventory: Inventory) -> None:
        await self.on_inventory(inventory)

    async def set_foreign(self, gpu_indices: frozenset[int]) -> None:
        await self.dra.set_foreign(gpu_indices)

    def claims_on(self, gpu_indices: frozenset[int]) -> dict[int, tuple[ClaimRef, ...]]:
        return self.dra.claims_on(gpu_indices) if self._started else {}

    async def set_vfio(self, devices: Sequence[DraDevice]) -> None:
        if self._started:
            await self.dra.set_vfio(devices)
            self._ctx.set_status(self.name, f"{len(self.dra.devices)} device(s)")
        else:
            self.dra.vfio_devices = list(devices)

    def mps_manager(self) -> Any:
        return self.dra.mps.manager if self.dra.mps is not None else None

    def monitor(self) -> Any:
        """The plane's own health monitor (plane "dra" alone; None beside the device plugin)."""
        return self.dra.monitor if self._started else None

    async def resync(self) -> None:
        if self._started:
            self.dra.reverify()
            if self._reporter is not None:
                await self._report_domains()

    def _plane_goes_away(self) -> bool:
        if self._ctx.exiting:
            return False
        new = self._ctx.config  # a reload swaps the config in before it stops what changed
        return (new.device_plugin.plane == "device-plugin" or not new.kube or new.kubeconfig != self._kubeconfig
                or new.resolved_node_name() != self._node_name)

    # -- moves between the planes (plane "both") -------------------------------------------------------------

    def check_reload(self, new: AgentConfig) -> None:
        inventory = self._ctx.inventory
        if new.device_plugin.plane == "both" and inventory is not None:
            check_dra_gpus(new.dra.gpus, [g.index for g in inventory.gpus], new.source or "config")

    async def reconfigure(self, old: AgentConfig, new: AgentConfig, changed: frozenset[str]) -> bool:
        """A new ``[dra] gpus`` with plane "both": withdraw what changes plane from the plane it leaves now
        (the move loop offers it in the other once nothing holds it there)."""
        ledger, inventory = self._ctx.shared.planes, self._ctx.inventory
        if not only_the_split_changed(old, new, changed) or not self._started or ledger.split is None \
                or inventory is None:
            return False
        async with self._split_lock:
            split = ledger.split.toward(frozenset(new.dra.gpus), [g.index for g in inventory.gpus])
            log.info("planes: [dra] gpus = [%s]: %s", ", ".join(map(str, new.dra.gpus)), _describe_split(split))
            await self._apply_split(split)
        self._wake.set()
        return True

    async def _apply_split(self, split: PlaneSplit) -> None:
        """Make both planes offer what ``split`` says: the device plugin's lists re-sent, the slices written
        in the background. Each step only withdraws or only adds (``toward`` withdraws, ``settle`` adds), and
        the move loop settles only once the API holds the slices as wanted, so no GPU is offered by both
        planes at any moment (an API that does not answer keeps the moves waiting, not the plugin's lists)."""
        self._ctx.shared.planes.split = split
        await self._ctx.shared.planes.exclude_from_plugin()
        await self.dra.set_gpus(split.dra_served, split.to_plugin)

    async def _slices_written(self) -> bool:
        """Whether the API holds the slices as wanted (waits up to one poll for a write under way)."""
        try:
            await self.dra.wait_published(MOVE_POLL_S)
        except TimeoutError:
            return False
        return True

    async def _move_loop(self) -> None:
        """Finish each move once nothing holds its GPU on the plane it leaves: pods given one of its
        device-plugin devices (the kubelet's PodResources), claims prepared on it (the claim checkpoint
        and PodResources). Looks again every second while a move waits, and at once after an unprepare."""
        from nodeagent.daemon.components.mig import GpuHolderSources
        from nodeagent.dra import DRIVER_NAME
        from nodeagent.errors import NodeAgentError

        assert self._pod_resources is not None
        holders = GpuHolderSources(self._pod_resources, self._ctx.shared.device_plugin.device_gpus, self,
                                   pool=self._node_name, driver=DRIVER_NAME, who="planes")
        why_not = ""  # why the moves cannot be finished now (logged once per cause)
        while True:
            split = self._ctx.shared.planes.split
            if split is None or not split.moving:
                self._waiting.clear()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._wake.clear()
            held: Mapping[int, tuple[object, ...]] = {}
            try:
                held = await holders(split.moving)
                cause = "" if await self._slices_written() else \
                    f"the ResourceSlices are not written yet ({self.dra.last_error or 'under way'})"
            except NodeAgentError as e:
                cause = f"the holders are unknown: {e}"
            if cause and cause != why_not:
                log.warning("planes: GPU(s) %s wait: %s", ", ".join(map(str, sorted(split.moving))), cause)
            why_not = cause
            if not cause:
                split = await self._settle(split, held)
            self._ctx.set_status(self.name, f"{len(self.dra.devices)} device(s)"
                                 + (f"; GPU(s) {', '.join(map(str, sorted(split.moving)))} waiting to move"
                                    if split.moving else ""))
            with contextlib.suppress(TimeoutError):
                await within(self._wake.wait(), MOVE_POLL_S)

    async def _settle(self, split: PlaneSplit, held: Mapping[int, tuple[object, ...]]) -> PlaneSplit:
        """Finish the moves nothing holds (the slices without the GPUs leaving DRA are in the API), report
        the ones still held; the split after."""
        from nodeagent.errors import NodeAgentError

        moves, after = split.settle(held)
        async with self._split_lock:
            if self._ctx.shared.planes.split != split:  # a reload changed it meanwhile: look again
                return self._ctx.shared.planes.split or split
            if moves:
                try:
                    await self._apply_split(after)
                except NodeAgentError as e:  # the plugin refused its new lists (a broken plugin config)
                    log.warning("planes: %s: %s", ", ".join(map(str, moves)), e)
        for move in moves:
            self._waiting.pop(move.gpu, None)
            await self._report("GpuPlaneMoved", f"{move} (nothing held it)")
        for gpu, move in after.blocked(held).items():
            what = ", ".join(f"pod {h}" if isinstance(h, str) else str(h) for h in held[gpu])
            if self._waiting.get(gpu) != what:
                self._waiting[gpu] = what
                await self._report("GpuPlaneMoveWaiting",
                                   f"{move} waits: held by {what} (withdrawn from {move.source} meanwhile)")
        return after

    async def _report(self, reason: str, message: str) -> None:
        """One log line and one Event on the Node (``[publish] events``) per move and per new set of holders."""
        log.info("planes: %s: %s", reason, message)
        if not self._ctx.config.publish.events:
            return
        from nodeagent.errors import NodeAgentError
        from nodeagent.kube.node import NodeClient

        try:
            await NodeClient(self._ctx.kube, self._node_name).acreate_event(reason, message[:1000], "Normal")
        except (NodeAgentError, OSError) as e:
            log.warning("planes: Event %s not recorded: %s", reason, e)

    async def stop(self) -> None:
        if self._mover is not None:
            self._mover.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._mover
            self._mover = None
        if self._pod_resources is not None:
            close_quietly(self._pod_resources)
            self._pod_resources = None
        self._ctx.shared.health.detach(self)
        self._ctx.shared.dra.detach(self)
        self._ctx.shared.conditions.unsubscribe(self._imex_changed)
        withdraw = self._plane_goes_away()
        await self.dra.stop(withdraw_slices=withdraw)
        if withdraw:
            log.info("DRA plane removed: ResourceSlices of node %s withdrawn", self._node_name)


class DraLeftoversComponent(Component):
    """Plane "device-plugin" with the Kubernetes API: the ResourceSlices an earlier run with DRA left for this
    node (driver ``gpu.nodeagent.io``, ``spec.nodeName`` this node) are deleted once, in the background, so
    the scheduler stops placing claims on GPUs no DRA driver serves any more (the kubelet would delete them
    only after its grace period for a driver that does not come back). A failure the API may get over (an
    outage) is tried again at the next resync; a token without the DRA ClusterRole (403) or an API server
    without ``resource.k8s.io/v1`` (404) means this node never published slices: nothing to do."""

    name = "dra"

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self._ctx = ctx
        self._done = False
        self._task: asyncio.Task[None] | None = None

    async def start(self, ctx: Context) -> None:
        self._task = ctx.spawn(self._remove(), "DRA leftover slices")

    async def resync(self) -> None:
        if not self._done and (self._task is None or self._task.done()):
            self._task = self._ctx.spawn(self._remove(), "DRA leftover slices")

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = None

    async def _remove(self) -> None:
        from nodeagent.dra.publisher import SlicePublisher
        from nodeagent.errors import KubeError

        node = self._ctx.node_name
        try:
            deleted = await asyncio.to_thread(SlicePublisher(self._ctx.kube, node).remove)
        except KubeError as e:
            if e.status in (403, 404):
                self._done = True
                log.debug("no DRA ResourceSlices of %s to look at (HTTP %s)", node, e.status)
            else:
                log.warning("DRA ResourceSlices of %s left by an earlier run not deleted (tried again at the "
                            "next resync): %s", node, e)
            return
        self._done = True
        if deleted:
            log.info("deleted %d DRA ResourceSlice(s) of %s left by an earlier run (plane is device-plugin)",
                     deleted, node)
