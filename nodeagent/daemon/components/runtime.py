"""The containerd runtime check (and the RuntimeClass) as a daemon component."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex

from nodeagent.daemon.supervisor import Component, Context
from nodeagent.errors import NodeAgentError

log = logging.getLogger(__name__)

# a missing RuntimeClass is read again after a random moment within this many seconds before it is created,
# so that of a fleet starting at once one agent creates it and the others find it (in a task: start waits not)
RUNTIME_CLASS_SPREAD_S = 3.0


class RuntimeCheckComponent(Component):
    """Checks (never writes) that containerd still carries the NVIDIA runtime; ``bootstrap`` writes it.

    With the API reachable it also keeps the ``nvidia`` RuntimeClass in place.
    """

    name = "runtime"

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self._ctx = ctx
        self.drift: bool | None = None
        self.warnings: tuple[str, ...] = ()
        self.runtime_class_done = False

    async def start(self, ctx: Context) -> None:
        interval = ctx.config.runtime.check_interval
        if interval > 0:
            ctx.scheduler.add_job(self.check, "interval", seconds=interval, id="runtime-check",
                                  replace_existing=True, coalesce=True, max_instances=1)
        ctx.spawn(self.check(), "runtime check")
        if ctx.kube is not None:
            ctx.spawn(self._runtime_class(), "runtime class")

    async def check(self) -> None:
        from nodeagent.runtime.configure import configure, options_from_settings

        cfg = self._ctx.config
        plugin_config = self._ctx.files.plugin_config if cfg.device_plugin.enabled else None
        strategies = plugin_config.flags.plugin.device_list_strategy if plugin_config is not None else ()
        opts = options_from_settings(cfg.runtime, dry_run=True, kubelet_dir=cfg.kubelet.dir,
                                     device_list_strategies=strategies)
        try:
            result = await asyncio.to_thread(configure, self._ctx.paths, opts)
        except NodeAgentError as e:
            self._ctx.set_status(self.name, f"check failed: {e}")
            self._ctx.shared.conditions.report_runtime(wired=None, detail=f"the runtime check failed: {e}")
            log.warning("runtime check failed: %s", e)
            return
        warnings = tuple(result.warnings)
        if warnings != self.warnings:  # each warning once, until it changes
            for w in warnings:
                log.warning("runtime check: %s", w)
        self.warnings = warnings
        drift = result.changed
        pending = ", ".join(f.path for f in result.files if f.action != "unchanged")
        self._ctx.shared.conditions.report_runtime(wired=not drift, detail=f"{pending} not as wanted" if drift else "")
        if drift != self.drift:
            if drift:
                files = ", ".join(f.path for f in result.files if f.action != "unchanged")
                sim = self._ctx.config.simulate
                flags = (f" --simulate {shlex.quote(sim.machine)}" if sim.machine else "") + (
                    f" --sim-state {shlex.quote(sim.state)}" if sim.state else "") + (
                    "" if self._ctx.config.kube else " --no-kube")  # (else bootstrap wants credentials)
                log.warning("containerd is not wired for the NVIDIA runtime (%s); run `%s`", files,
                            self._ctx.paths.command("bootstrap" + flags))
            else:
                log.info("containerd carries the NVIDIA runtime")
        self.drift = drift
        self._ctx.set_status(self.name, "containerd not wired" if drift else "containerd wired")

    async def _runtime_class(self) -> None:
        from nodeagent.kube.runtimeclass import desired_classes, ensure_runtime_classes

        classes = desired_classes(cdi=self._ctx.config.runtime.cdi)
        try:
            done = await asyncio.to_thread(ensure_runtime_classes, self._ctx.kube, classes,
                                           spread=RUNTIME_CLASS_SPREAD_S)
        except NodeAgentError as e:
            log.warning("RuntimeClass not ensured (retried at the next resync): %s", e)
            return
        self.runtime_class_done = True
        log.info("RuntimeClass: %s", ", ".join(f"{k} {v}" for k, v in done.items()))

    async def resync(self) -> None:
        if self._ctx.kube is not None and not self.runtime_class_done:
            await self._runtime_class()

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._ctx.scheduler.remove_job("runtime-check")
