"""The label-driven node switches as daemon components: the workload config (``[vfio]``) and the CC mode
(``[cc]``), each a ``labelswitch.SwitchReconciler`` over its switch, waiting for the pods and claims that
hold the GPUs as the MIG component does, with the fleet's disruption budget when one is attached
(``[mig] fleet_namespace``: components/fleetlink.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nodeagent.daemon.components.mig import GpuHolderSources, PlaneClaims, plugin_device_ids
from nodeagent.daemon.supervisor import Component, Context, close_quietly

log = logging.getLogger(__name__)


def _dra_gpus(ctx: Context) -> frozenset[int] | None:
    cfg = ctx.config
    if cfg.device_plugin.plane == "device-plugin" or ctx.kube is None:
        return frozenset()
    if cfg.device_plugin.plane == "dra":
        return None
    split = ctx.shared.planes.split
    return split.dra_served if split is not None else frozenset(cfg.dra.gpus)


def _vfio_to_dra(ctx: Context, slots: Mapping[str, int]) -> frozenset[str]:
    """The bus ids of the VFIO GPUs the DRA plane publishes (the others the device plugin serves): all with
    plane "dra", none with "device-plugin" or without the API, with "both" the GPUs of ``[dra] gpus`` (by
    the GPU index, which for GPUs on a VFIO driver is their slot)."""
    served = _dra_gpus(ctx)
    return frozenset(b for b, slot in slots.items() if served is None or slot in served)


def vfio_device_ids(resources: Mapping[str, Mapping[str, Any]], slots: Mapping[str, int],
                    gpu_indices: frozenset[int]) -> dict[tuple[str, str], int]:
    """(resource, device ID) → GPU index of the VFIO resources' devices (the device ID is the bus id, the
    GPU index its slot): what PodResources names for a pod holding a GPU on vfio-pci."""
    return {(r, bdf): slots[bdf] for r, devs in resources.items() for bdf in devs
            if bdf in slots and slots[bdf] in gpu_indices}


class SwitchComponent(Component):
    """Runs one ``SwitchReconciler``; ``kind`` is ``vfio`` or ``cc``."""

    def __init__(self, ctx: Context, kind: str) -> None:
        super().__init__()
        from nodeagent.dra import DRIVER_NAME
        from nodeagent.kube.node import NodeClient
        from nodeagent.labelswitch import SwitchOptions, SwitchReconciler
        from nodeagent.nvmlsource import cc_tool, pci_kernel

        self.name = kind
        self._ctx = ctx
        paths = ctx.paths
        sim = ctx.config.simulate
        state = Path(sim.state) if sim.state else None
        machine = sim.machine or None
        gpu: Any = ctx.gpu  # the NVML adapter: discovery, processes, persistence mode, CC state, reset
        switch: Any
        if kind == "vfio":
            from nodeagent.deviceplugin.vfio import VfioDevicePlugin
            from nodeagent.vfio.switch import VfioSwitch
            from nodeagent.vfio.sysfs import PciSysfs

            store = getattr(getattr(gpu, "nvml", None), "store", None)  # an in-memory simulated machine's
            kernel = pci_kernel(paths, machine, state, store if state is None else None)
            switch = VfioSwitch(paths, gpu, PciSysfs(paths, after_write=kernel))
            timeout = ctx.config.vfio.release_timeout
            self.vfio_plugin: Any = VfioDevicePlugin(ctx.host_path(ctx.config.kubelet.device_plugins), root=paths)
        else:
            from nodeagent.ccmode.switch import CcSwitch

            if machine is not None or state is not None:
                pci_kernel(paths, machine, state)  # the simulated host's sysfs: the CPU's TEE
            tool, env = cc_tool(paths, machine, state, ctx.config.cc.tool or None)
            switch = CcSwitch(paths, gpu, tool, env)
            timeout = ctx.config.cc.release_timeout
        self.switch = switch
        self.pod_resources = ctx.pod_resources_client()
        holders = GpuHolderSources(self.pod_resources, self._device_ids,
                                   PlaneClaims(ctx.shared.dra, lambda: _dra_gpus(ctx)),
                                   pool=ctx.node_name, driver=DRIVER_NAME, who=kind)
        from nodeagent.daemon.components.fleetlink import SwitchSlots, fleet_gate

        node = NodeClient(ctx.kube, ctx.node_name, watches=ctx.node_watches)
        fleet = fleet_gate(ctx, node)  # the switch empties every GPU: a slot of the fleet's budget first
        self.reconciler: Any = SwitchReconciler(
            node, switch, holders=holders, budget=SwitchSlots(fleet) if fleet is not None else None,
            options=SwitchOptions(release_timeout_s=timeout), on_state=self._on_state,
            after=self._after if kind == "vfio" else None, hold=self if kind == "vfio" else None)
        self._task: asyncio.Task[Any] | None = None
        self._held: set[int] = set()

    def _device_ids(self, gpu_indices: frozenset[int]) -> dict[tuple[str, str], int]:
        dp = self._ctx.config.device_plugin
        plugin = self._ctx.shared.device_plugin
        if not dp.enabled or dp.plane == "dra":
            ids = dict(plugin.device_gpus(gpu_indices))
        else:
            ids = plugin_device_ids(plugin, self._ctx.gpu.discover(), self._ctx.files.plugin_config, gpu_indices)
        if self.name == "vfio":
            ids.update(vfio_device_ids(self.switch.resources(), self.switch.slots(), gpu_indices))
        return ids

    def _on_state(self, label: str, value: str) -> None:
        self._ctx.set_status(self.name, f"{label}={value}")
        self._ctx.request_resync()  # the GPUs NVML shows, and so what the plugin and the labels say, changed

    # -- labelswitch.GpuHold: nothing new lands on the GPUs from before the wait until the switch is over ----
    async def hold(self, wanted: Any) -> None:
        """Withdraw the GPUs from the device plugin and the DRA plane and, on the way back to container, stop
        serving them to VMs."""
        self._held = set(await asyncio.to_thread(self.switch.gpus))
        await self._ctx.shared.advertiser.withdraw(self._held)
        if wanted == "container":
            await self.vfio_plugin.stop()
            await self._ctx.shared.dra.set_vfio(())

    async def release(self, wanted: Any, applied: bool) -> None:
        """Offer the GPUs again: as NVML shows them now when the switch applied, as before when it failed."""
        held, self._held = self._held, set()
        if applied:
            await self._ctx.shared.advertiser.update(await asyncio.to_thread(self._ctx.gpu.discover))
        await self._ctx.shared.advertiser.readvertise(held)
        if not applied and wanted == "container":
            await self._after("vm-passthrough")  # still there: serve the VMs again

    async def _after(self, state: str) -> None:
        """vm-passthrough: the VFIO resources are served (anew) by the device plugin and/or the DRA plane,
        as the plane config splits the GPUs; container: they go."""
        from nodeagent.dra.devices import build_vfio_devices
        from nodeagent.errors import NodeAgentError

        if state == "container":
            await self.vfio_plugin.stop()
            await self._ctx.shared.dra.set_vfio(())
        elif state == "vm-passthrough":
            try:
                resources, slots, names = await asyncio.to_thread(
                    lambda: (self.switch.resources(), self.switch.slots(), self.switch.product_names()))
                to_dra = _vfio_to_dra(self._ctx, slots)
                await self.vfio_plugin.serve(
                    {r: kept for r, devs in resources.items()
                     if (kept := {b: d for b, d in devs.items() if b not in to_dra})})
                await self._ctx.shared.dra.set_vfio(build_vfio_devices(
                    {r: {b: d for b, d in devs.items() if b in to_dra} for r, devs in resources.items()}, slots, names))
            except NodeAgentError as e:
                log.error("vfio: the VFIO resources are not served: %s", e)
        await self._report_passthrough()

    async def _report_passthrough(self) -> None:
        """Tell the Node conditions whether every GPU is bound for VMs (GPUReady says so, not "no GPU")."""
        from nodeagent.errors import NodeAgentError
        from nodeagent.kube.conditions import PassthroughInput
        from nodeagent.vfio.plan import VFIO_DRIVERS

        def read() -> PassthroughInput | None:
            if self.switch.current() != "vm-passthrough":
                return None
            bound = [f for f in self.switch.sysfs.functions() if f.is_gpu and f.driver in VFIO_DRIVERS]
            return PassthroughInput(len(bound), tuple(sorted({str(f.driver) for f in bound})),
                                    tuple(sorted(self.switch.resources())))

        try:
            found = await asyncio.to_thread(read)
        except NodeAgentError as e:
            log.warning("vfio: the PCI tree could not be read for the node conditions: %s", e)
            found = None
        self._ctx.shared.conditions.report_passthrough(found)

    async def start(self, ctx: Context) -> None:
        if self.name == "vfio" and await asyncio.to_thread(self.switch.current) == "vm-passthrough":
            await self._after("vm-passthrough")
        self._task = ctx.spawn(self.reconciler.run(), f"{self.name} switch")

    async def resync(self) -> None:
        if self._task is not None and self._task.done():
            self._task = self._ctx.spawn(self.reconciler.run(), f"{self.name} switch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self.name == "vfio":
            await self.vfio_plugin.stop()
        close_quietly(self.pod_resources)
