"""The DRA driver ``gpu.nodeagent.io`` as a daemon component (``[device_plugin] plane = "dra"`` or ``"both"``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from nodeagent.daemon.supervisor import Component, Context
from nodeagent.gpu.health import HealthKey
from nodeagent.gpu.inventory import Gpu, Inventory

if TYPE_CHECKING:
    from nodeagent.dra.service import ClaimRef

log = logging.getLogger(__name__)


class DraPlaneComponent(Component):
    """Runs ``nodeagent.dra.component.DraComponent``: the kubelet's DRA sockets and the node's ResourceSlices.

    Plane "dra": every GPU, with its own health monitor on the daemon's event pumps (no device plugin runs).
    Plane "both": only ``[dra] gpus``; health comes from the device plugin's monitor through
    ``ctx.shared.health`` (one NVML source feeds one monitor).

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
        served = frozenset(cfg.dra.gpus)

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
        )
        self._started = False

    async def start(self, ctx: Context) -> None:
        if ctx.inventory is None:
            return  # discovery failed: the first inventory starts the plane
        await self._start(ctx.inventory)

    async def _start(self, inventory: Inventory) -> None:
        await self.dra.start(inventory)
        self._started = True
        if self._plane == "both":
            await self._ctx.shared.health.attach(self)
        self._ctx.shared.dra.attach(self)
        gpus = sorted({d.gpu_index for d in self.dra.devices})
        log.info("DRA driver gpu.nodeagent.io serves %d device(s) on GPU(s) %s", len(self.dra.devices),
                 ", ".join(map(str, gpus)) or "none")
        self._ctx.set_status(self.name, f"{len(self.dra.devices)} device(s)")

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

    async def update(self, inventory: Inventory) -> None:
        await self.on_inventory(inventory)

    def claims_on(self, gpu_indices: frozenset[int]) -> dict[int, tuple[ClaimRef, ...]]:
        return self.dra.claims_on(gpu_indices) if self._started else {}

    async def resync(self) -> None:
        if self._started:
            self.dra.reverify()

    def _plane_goes_away(self) -> bool:
        if self._ctx.exiting:
            return False
        new = self._ctx.config  # a reload swaps the config in before it stops what changed
        return (new.device_plugin.plane == "device-plugin" or not new.kube or new.kubeconfig != self._kubeconfig
                or new.resolved_node_name() != self._node_name)

    async def stop(self) -> None:
        self._ctx.shared.health.detach(self)
        self._ctx.shared.dra.detach(self)
        withdraw = self._plane_goes_away()
        await self.dra.stop(withdraw_slices=withdraw)
        if withdraw:
            log.info("DRA plane removed: ResourceSlices of node %s withdrawn", self._node_name)
