"""The kubelet device-plugin servers as a daemon component; gates READY until every resource is registered."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodeagent.agentrecord import Registration
from nodeagent.config import AgentConfig
from nodeagent.daemon.components.conditions import report_gpu_health
from nodeagent.daemon.planes import LEDGER_FILE, check_dra_gpus, only_the_split_changed
from nodeagent.daemon.supervisor import Component, Context
from nodeagent.gpu.inventory import Inventory


def _soon(record: Callable[[], None]) -> None:
    """Record once the service's step that made the change is over (a registration is done only once its
    task has left the service's registering set, right after the count)."""
    try:
        asyncio.get_running_loop().call_soon(record)
    except RuntimeError:
        record()


class _Registrations(dict[str, int]):
    """The service's count of successful Register calls per resource, waking a waiter on every change."""

    def __init__(self, changed: asyncio.Event, record: Callable[[], None]) -> None:
        super().__init__()
        self._changed = changed
        self._record = record

    def __setitem__(self, key: str, value: int) -> None:
        super().__setitem__(key, value)
        self._changed.set()
        _soon(self._record)


class _Failures(dict[str, str]):
    """The service's reasons why a resource is not registered, told to the agent's record when one changes."""

    def __init__(self, record: Callable[[], None]) -> None:
        super().__init__()
        self._record = record

    def __setitem__(self, key: str, value: str) -> None:
        if self.get(key) != value:
            super().__setitem__(key, value)
            _soon(self._record)

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            value = super().pop(key)
            _soon(self._record)
            return value
        return super().pop(key, *default)


class DevicePluginComponent(Component):
    """Serves and registers the resources; attached to ``ctx.shared.device_plugin`` while it runs, so the
    publisher reads what it serves and the MIG reconciler withdraws and re-advertises through it."""

    name = "device-plugin"
    gates_ready = True

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        from nodeagent.deviceplugin.service import DevicePluginService
        from nodeagent.gpu.health import HealthMonitorSettings

        cfg = ctx.config
        ctx.shared.planes.bind(ctx.paths.state_dir / LEDGER_FILE, ctx.paths)  # a move under way before a restart
        if cfg.device_plugin.plane != "both" or ctx.kube is None:
            ctx.shared.planes.split = None  # no DRA plane beside this plugin: nothing moves, nothing to keep
        self._plugin_config = ctx.files.plugin_config  # read and validated with the config (start / SIGHUP)
        health = HealthMonitorSettings.from_env(
            recovery_window_s=cfg.health.window, poll_interval_s=cfg.health.poll_interval
        )
        from nodeagent.nvmlsource import mps_manager

        mps = mps_manager(ctx.paths, cfg.cdi.driver_root, cfg.simulate.machine or None,
                          Path(cfg.simulate.state) if cfg.simulate.state else None, ctx.gpu)
        self.service = DevicePluginService(
            plugin_dir=ctx.host_path(cfg.kubelet.device_plugins),
            plugin_config=self._plugin_config,
            nvml=ctx.gpu,
            health=health,
            pumps=ctx.pumps,  # the daemon's: an XID in flight while a reload rebuilds the plugin is not lost
            # plane "both": the GPUs DRA serves, or that move between the planes, are not advertised here
            # (the monitor still watches them)
            exclude_gpus=ctx.shared.planes.plugin_excluded(cfg.dra.gpus) if cfg.device_plugin.plane == "both"
            else (),
            take_over=cfg.adopt.take_over,
            mps=mps,
            under_root=ctx.host_path,
            publish=ctx.paths.publish,
            root=ctx.paths,
        )
        self._changed = asyncio.Event()  # a registration succeeded or the served resources changed
        self.service.registrations = _Registrations(self._changed, ctx.record_state)
        self.service.failures = _Failures(ctx.record_state)
        self._ctx = ctx
        self._started = False
        monitor = self.service.monitor
        if monitor is not None:
            # A health change reaches the kubelet through the servers (the service's own hook) and then the
            # Node at once: GpuUnhealthy/GpuHealthy Events and GPU object state do not wait for the resync.
            to_kubelet = monitor.on_change
            link = ctx.shared.health  # the DRA plane beside the plugin (plane "both") follows this monitor

            async def health_changed() -> None:
                try:
                    await to_kubelet()
                    await link.publish(monitor.unhealthy())
                    await report_gpu_health(ctx, self.service)
                finally:
                    ctx.request_resync()

            monitor.on_change = health_changed

    @property
    def plugin_config(self) -> Any:
        return self._plugin_config

    async def start(self, ctx: Context) -> None:
        ctx.shared.adoption.attach(self.service)  # the holds conflict detection decided, before registering
        if ctx.config.device_plugin.plane == "both":
            ctx.shared.planes.attach_plugin(self.service.set_excluded)  # the DRA plane moves GPUs through it
        if ctx.inventory is not None:
            await self.on_inventory(ctx.inventory)
        ctx.shared.device_plugin.attach(self)
        ctx.spawn(self._watch_registration(), "device-plugin ready")

    async def on_inventory(self, inventory: Inventory) -> None:
        if not self._started:
            if self.service.monitor is not None:  # GPUs a killed predecessor's remediation took out stay out
                from nodeagent.daemon.components.remediation import held_at_start

                self.service.monitor.held.update(await asyncio.to_thread(held_at_start, self._ctx, inventory))
            await self.service.start(inventory)
            self._started = True
            if self.service.monitor is not None:  # what a replaced monitor handed over, for the DRA plane
                await self._ctx.shared.health.publish(self.service.monitor.unhealthy())
        else:
            await self.service.update(inventory)
        self._changed.set()
        await report_gpu_health(self._ctx, self.service)

    async def update(self, inventory: Inventory) -> None:
        await self.on_inventory(inventory)

    async def withdraw(self, gpu_indices: set[int]) -> None:
        await self.service.withdraw(gpu_indices)

    async def readvertise(self, gpu_indices: set[int]) -> None:
        await self.service.readvertise(gpu_indices)

    def device_gpus(self, gpu_indices: frozenset[int]) -> dict[tuple[str, str], int]:
        return self.service.device_gpus(gpu_indices)

    async def _watch_registration(self) -> None:
        while True:
            self._changed.clear()
            served = set(self.service.resources())
            if self._started and served <= set(self.service.registrations):
                self.ready.set()
                self._ctx.set_status(self.name, f"registered {len(served)} resource(s)")
                return
            await self._changed.wait()

    def served(self) -> list[str]:
        return sorted(self.service.resources())

    def mps(self) -> list[Any]:
        return list(self.service.mps_states())

    def mps_manager(self) -> Any:
        return self.service.mps_manager()

    def health(self) -> dict[int, bool]:
        monitor = self.service.monitor
        if monitor is None or self._ctx.inventory is None:
            return {}
        return {g.index: monitor.is_healthy(g.index) for g in self._ctx.inventory.gpus}

    def last_xids(self) -> dict[int, int]:
        return self.service.last_xids()

    def monitor(self) -> Any:
        return self.service.monitor

    def registered(self) -> dict[str, bool]:
        return self.service.registered()

    def registrations(self) -> list[Registration]:
        """Each resource served (or held back) with its socket, whether the kubelet holds its registration,
        and why not (the agent's record)."""
        registered = self.service.registered()
        return [Registration(name, self.service.server(name).endpoint, registered.get(name, False),
                             "" if registered.get(name) else self.service.failures.get(name, ""))
                for name in sorted(self.service.resources())]

    def allocations(self) -> dict[tuple[str, str], int]:
        return self.service.allocations()

    def check_reload(self, new: AgentConfig) -> None:
        inventory = self._ctx.inventory
        if new.device_plugin.plane == "both" and inventory is not None:
            check_dra_gpus(new.dra.gpus, [g.index for g in inventory.gpus], new.source or "config")

    async def reconfigure(self, old: AgentConfig, new: AgentConfig, changed: frozenset[str]) -> bool:
        # the running DRA plane moves the GPUs through set_excluded; without one (no API) the plugin is rebuilt
        shared = self._ctx.shared
        return only_the_split_changed(old, new, changed) and shared.dra.attached and shared.planes.split is not None

    async def stop(self) -> None:
        self._ctx.shared.planes.detach_plugin(self.service.set_excluded)
        self._ctx.shared.adoption.detach(self.service)
        self._ctx.shared.device_plugin.detach(self)
        await self.service.stop()
