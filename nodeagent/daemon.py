"""The long-running agent: one asyncio loop wiring discovery, device plugin, health, MIG, publishers.

Shape:

    Daemon ── GpuSource.discover() ──► Inventory ──► every Component.on_inventory()
      │  apscheduler AsyncIOScheduler: resync (rediscover + publish), watchdog, and the components' own jobs
      │  signals: SIGTERM/SIGINT → stop;  SIGHUP → reload config, rebuild only what changed;
      │           SIGUSR1 → one log line counting asyncio tasks, threads and open fds (leak hunting)
      └─ sd_notify: READY once the components that gate readiness are ready (device plugin registered)

Every part of the node (device-plugin servers, MIG reconciler, node publisher, metrics, runtime check)
is a ``Component`` built by a ``ComponentSpec`` from the config; each is optional and injected, so the
daemon's own logic is tested with small components and the real ones plug in through ``wiring``.
A component that fails to start is reported in the status line and retried on the next resync; it never
takes the others down. Stopping never touches node labels: the node keeps what it last published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from nodeagent.config import AgentConfig, require_named_file
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths
from nodeagent.logs import setup_logging
from nodeagent.sdnotify import Notifier

if TYPE_CHECKING:
    from nodeagent.metrics import Metrics

log = logging.getLogger(__name__)

STOP_TIMEOUT = 3.0  # seconds all components together get to stop (the unit allows 5)
READY_FALLBACK = 60.0  # READY=1 is sent after this long even if the kubelet never answered


class GpuSource(Protocol):
    """What the daemon needs from the NVML adapter."""

    def discover(self) -> Inventory: ...


@dataclass(frozen=True)
class ConfigFiles:
    """The files the agent config names, read and validated together with it (at start and on SIGHUP).

    Components use these parsed contents, never the files directly, so a broken edit of one of them is
    refused as a whole like a broken config.toml, and the running config stays. ``digests`` maps a config
    section to a fingerprint of its files, so SIGHUP also rebuilds a component whose file alone changed.
    """

    plugin_config: Any = None  # sharing.spec.PluginConfig; None = the built-in defaults
    mig: Any = None  # mig.pipeline.MigSources; None = the MIG reconciler does not run
    digests: Mapping[str, str] = field(default_factory=dict)


def read_config_files(config: AgentConfig, paths: HostPaths) -> ConfigFiles:
    """Read and validate every file ``config`` names and will use; ConfigError names the file and the problem.

    The device-plugin config is read when the device plugin is on; the MIG config and hooks files when the
    MIG reconciler runs (``mig.enabled`` with the API). A missing file is an error, except the default
    ``mig.config_file``, whose absence means the standard configs.
    """
    import hashlib

    digests: dict[str, str] = {}
    plugin_config = None
    dp = config.device_plugin
    if dp.enabled and dp.config:
        from nodeagent.sharing.spec import parse_plugin_config

        path = paths(dp.config)
        text = require_named_file(path, "device-plugin config", "device_plugin.config")
        plugin_config = parse_plugin_config(text, source=str(path))
        digests["device_plugin"] = hashlib.sha256(text.encode()).hexdigest()
    mig_sources = None
    if config.mig.enabled and config.kube:
        from nodeagent.mig.pipeline import load_configured_sources

        mig_sources = load_configured_sources(config.mig, paths)
        digests["mig"] = mig_sources.digest
    return ConfigFiles(plugin_config, mig_sources, digests)


class Context:
    """What a component may use from the daemon: config, paths, the scheduler and a few callbacks."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    @property
    def config(self) -> AgentConfig:
        return self._daemon.config

    @property
    def paths(self) -> HostPaths:
        return self._daemon.paths

    @property
    def gpu(self) -> GpuSource:
        return self._daemon.gpu

    @property
    def inventory(self) -> Inventory | None:
        return self._daemon.inventory

    @property
    def node_name(self) -> str:
        return self._daemon.node_name

    @property
    def scheduler(self) -> AsyncIOScheduler:
        return self._daemon.scheduler

    @property
    def files(self) -> ConfigFiles:
        """The validated contents of the files the config names (device-plugin config, MIG config)."""
        return self._daemon.files

    @property
    def kube(self) -> Any:
        """The shared ``KubeClient`` (None with ``kube = false``)."""
        return self._daemon.kube

    def host_path(self, host_path: str) -> Path:
        return self._daemon.paths(host_path)

    def request_resync(self) -> None:
        """Ask for a rediscovery pass soon (after a MIG apply, a health change, ...)."""
        self._daemon.request_resync()

    def set_status(self, component: str, text: str) -> None:
        self._daemon.set_status(component, text)

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        """A background task owned by the daemon (cancelled on stop, logged if it dies)."""
        return self._daemon.spawn(coro, name)


class Component:
    """One part of the node. Override what applies; every hook is awaited on the daemon's loop."""

    name = "component"
    gates_ready = False  # READY=1 waits for ``ready`` of every component that sets this

    def __init__(self) -> None:
        self.ready = asyncio.Event()

    async def start(self, ctx: Context) -> None:
        """Start serving; return quickly (long work goes to ``ctx.spawn`` tasks)."""

    async def on_inventory(self, inventory: Inventory) -> None:
        """A new Inventory (first discovery, or the GPUs changed)."""

    async def resync(self) -> None:
        """The periodic full pass: re-publish what may have drifted."""

    async def stop(self) -> None:
        """Stop serving and release every socket, task and thread."""


@dataclass(frozen=True)
class ComponentSpec:
    """How to build one component from the config, and which config sections it depends on."""

    name: str
    sections: frozenset[str]
    build: Callable[[Context], Component | None]  # None = disabled by this config


@dataclass
class _Slot:
    spec: ComponentSpec
    component: Component | None = None
    error: str = ""
    started: bool = False


# Sections whose change rebuilds everything (a different machine, cluster or node).
GLOBAL_SECTIONS = frozenset({"simulate", "kube", "kubeconfig", "node_name"})


class Daemon:
    def __init__(
        self,
        config: AgentConfig,
        paths: HostPaths,
        *,
        gpu_factory: Callable[[AgentConfig, HostPaths], GpuSource],
        specs: Sequence[ComponentSpec],
        kube_factory: Callable[[AgentConfig], Any] | None = None,
        reload_config: Callable[[], AgentConfig] | None = None,
        notifier: Notifier | None = None,
        ready_fallback: float = READY_FALLBACK,
        read_files: Callable[[AgentConfig, HostPaths], ConfigFiles] | None = None,
    ) -> None:
        # The named files first: a broken one must stop the start before anything is opened or served.
        self._read_files = read_files
        self.files = read_files(config, paths) if read_files is not None else ConfigFiles()
        self.config = config
        self.paths = paths
        self._gpu_factory = gpu_factory
        self._kube_factory = kube_factory
        self._reload_config = reload_config
        self.notifier = notifier if notifier is not None else Notifier()
        self._ready_fallback = ready_fallback
        self.node_name = config.resolved_node_name()
        self.gpu: GpuSource = gpu_factory(config, paths)
        self.kube: Any = kube_factory(config) if kube_factory is not None and config.kube else None
        self.inventory: Inventory | None = None
        self.scheduler = AsyncIOScheduler()
        self.ctx = Context(self)
        self._slots = [_Slot(spec) for spec in specs]
        self._stop = asyncio.Event()
        self._resync_wanted = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._status: dict[str, str] = {}
        self._ready_sent = False
        self.started_at = time.monotonic()
        self.reloads = 0
        self.resyncs = 0

    # -- public -----------------------------------------------------------------------------------------

    @property
    def errors(self) -> dict[str, str]:
        """Components that failed to build or start, with the reason."""
        return {s.spec.name: s.error for s in self._slots if s.error}

    @property
    def components(self) -> dict[str, Component]:
        return {s.spec.name: s.component for s in self._slots if s.component is not None}

    def request_stop(self) -> None:
        self._stop.set()

    def request_resync(self) -> None:
        self._resync_wanted.set()

    def request_reload(self) -> None:
        self.spawn(self.reload(), "reload")

    def set_status(self, component: str, text: str) -> None:
        if self._status.get(component) == text:
            return
        self._status[component] = text
        self.notifier.status(self.status_line())

    def status_line(self) -> str:
        gpus = len(self.inventory.gpus) if self.inventory else 0
        parts = [f"{gpus} GPU(s)"]
        parts += [f"{k}: {v}" for k, v in sorted(self._status.items()) if v]
        return "; ".join(parts)

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    async def run(self, install_signals: bool = True) -> int:
        """Run until SIGTERM/SIGINT (or ``request_stop``); returns the exit code (0)."""
        loop = asyncio.get_running_loop()
        if install_signals:
            loop.add_signal_handler(signal.SIGTERM, self.request_stop)
            loop.add_signal_handler(signal.SIGINT, self.request_stop)
            loop.add_signal_handler(signal.SIGHUP, self.request_reload)
            loop.add_signal_handler(signal.SIGUSR1, self.log_diagnostics)
        try:
            await self._start()
            await self._main_loop()
        finally:
            await self._shutdown()
            if install_signals:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
                    loop.remove_signal_handler(sig)
        return 0

    def diagnostics(self) -> dict[str, Any]:
        """Counts of what a leak would grow: asyncio tasks (by coroutine), threads, open file descriptors."""
        tasks = asyncio.all_tasks()
        kinds = Counter(getattr(t.get_coro(), "__qualname__", "?") for t in tasks)
        try:
            fds = len(os.listdir("/proc/self/fd"))
        except OSError:
            fds = -1
        return {"tasks": len(tasks), "threads": threading.active_count(), "fds": fds, "task_kinds": dict(kinds)}

    def log_diagnostics(self) -> None:
        d = self.diagnostics()
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(d["task_kinds"].items()))
        log.info("diagnostics: %d asyncio task(s), %d thread(s), %d open fd(s); tasks: %s",
                 d["tasks"], d["threads"], d["fds"], kinds)

    # -- start / stop -----------------------------------------------------------------------------------

    async def _start(self) -> None:
        log.info(
            "starting nodeagent on node %s (config %s%s)",
            self.node_name,
            self.config.source or "defaults",
            f", simulating {self.config.simulate.machine}" if self.config.simulate.machine else "",
        )
        self.notifier.status("discovering GPUs")
        await self._discover()
        self.scheduler.start()
        self._schedule_core_jobs()
        for slot in self._slots:
            await self._start_slot(slot)
        self.spawn(self._announce_ready(), "ready")

    def _schedule_core_jobs(self) -> None:
        # Jobs are coroutines so they run on the loop itself: a wedged loop then stops the watchdog pings
        # (and systemd restarts the agent), and the jobs may touch asyncio objects safely.
        self.scheduler.add_job(
            self._resync_job,
            "interval",
            seconds=self.config.resync_interval,
            id="resync",
            replace_existing=True,
            coalesce=True,
            max_instances=1,
        )
        interval = self.notifier.watchdog_interval
        if interval:
            self.scheduler.add_job(
                self._watchdog_job, "interval", seconds=interval, id="watchdog", replace_existing=True,
                coalesce=True, max_instances=1,
            )
            self.notifier.watchdog()

    async def _resync_job(self) -> None:
        self.request_resync()

    async def _watchdog_job(self) -> None:
        self.notifier.watchdog()

    async def _start_slot(self, slot: _Slot) -> None:
        try:
            slot.component = slot.spec.build(self.ctx)
        except NodeAgentError as e:
            self._slot_failed(slot, f"cannot build: {e}")
            return
        except Exception as e:
            log.exception("component %s could not be built", slot.spec.name)
            self._slot_failed(slot, f"cannot build: {e}")
            return
        if slot.component is None:
            self._status.pop(slot.spec.name, None)
            return
        try:
            await slot.component.start(self.ctx)
            if self.inventory is not None:
                await slot.component.on_inventory(self.inventory)
        except Exception as e:
            if not isinstance(e, NodeAgentError):
                log.exception("component %s failed to start", slot.spec.name)
            self._slot_failed(slot, f"failed to start: {e}")
            with contextlib.suppress(Exception):
                await asyncio.wait_for(slot.component.stop(), STOP_TIMEOUT)
            slot.component = None
            return
        slot.started = True
        slot.error = ""
        log.info("component %s started", slot.spec.name)

    def _slot_failed(self, slot: _Slot, why: str) -> None:
        slot.error = why
        slot.started = False
        log.error("component %s %s (retried on the next resync)", slot.spec.name, why)
        self.set_status(slot.spec.name, why)

    async def _stop_slot(self, slot: _Slot, timeout: float = STOP_TIMEOUT) -> None:
        comp, slot.component, slot.started = slot.component, None, False
        if comp is None:
            return
        try:
            await asyncio.wait_for(comp.stop(), timeout)
        except TimeoutError:
            log.warning("component %s did not stop within %.1fs", slot.spec.name, timeout)
        except Exception:
            log.exception("component %s failed while stopping", slot.spec.name)

    async def _shutdown(self) -> None:
        log.info("stopping")
        self.notifier.stopping()
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        # Components stop in reverse start order, all within one shared deadline.
        deadline = time.monotonic() + STOP_TIMEOUT
        for slot in reversed(self._slots):
            await self._stop_slot(slot, max(0.1, deadline - time.monotonic()))
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)
        close = getattr(self.gpu, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                close()
        if self.kube is not None:
            with contextlib.suppress(Exception):
                self.kube.close()
        self.notifier.close()
        log.info("stopped")

    # -- loop -------------------------------------------------------------------------------------------

    async def _main_loop(self) -> None:
        stop_wait = asyncio.ensure_future(self._stop.wait())
        try:
            while not self._stop.is_set():
                resync_wait = asyncio.ensure_future(self._resync_wanted.wait())
                await asyncio.wait({stop_wait, resync_wait}, return_when=asyncio.FIRST_COMPLETED)
                if not resync_wait.done():
                    resync_wait.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await resync_wait
                if self._stop.is_set():
                    break
                self._resync_wanted.clear()
                await self.resync()
        finally:
            stop_wait.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stop_wait

    async def resync(self) -> None:
        """Rediscover, restart failed components, and let every component re-publish."""
        self.resyncs += 1
        changed = await self._discover()
        for slot in self._slots:
            if slot.component is None and slot.error:
                await self._start_slot(slot)
            elif slot.component is not None:
                try:
                    if changed and self.inventory is not None:
                        await slot.component.on_inventory(self.inventory)
                    await slot.component.resync()
                except Exception as e:
                    if not isinstance(e, NodeAgentError):
                        log.exception("component %s resync failed", slot.spec.name)
                    else:
                        log.warning("component %s resync failed: %s", slot.spec.name, e)
                    self.set_status(slot.spec.name, f"resync failed: {e}")

    async def _discover(self) -> bool:
        """Rediscover; True when the Inventory differs from the previous one."""
        try:
            inv = await asyncio.to_thread(self.gpu.discover)
        except NodeAgentError as e:
            log.error("GPU discovery failed: %s", e)
            self.set_status("discovery", f"failed: {e}")
            return False
        self._status.pop("discovery", None)
        if inv == self.inventory:
            return False
        first = self.inventory is None
        self.inventory = inv
        log.info(
            "%s %d GPU(s), %d MIG device(s), driver %s",
            "discovered" if first else "GPUs changed:",
            len(inv.gpus),
            sum(len(g.mig_devices) for g in inv.gpus),
            inv.driver_version,
        )
        self.notifier.status(self.status_line())
        return True

    async def _announce_ready(self) -> None:
        gates = [
            asyncio.ensure_future(s.component.ready.wait())
            for s in self._slots
            if s.component and s.component.gates_ready
        ]
        try:
            if gates:
                _, pending = await asyncio.wait(gates, timeout=self._ready_fallback)
                if pending:
                    log.warning(
                        "not registered with the kubelet after %.0fs; reporting ready anyway", self._ready_fallback
                    )
        finally:
            for g in gates:
                g.cancel()
        self._ready_sent = True
        took = time.monotonic() - self.started_at
        log.info("ready after %.2fs", took)
        self.notifier.ready(self.status_line())
        asyncio.get_running_loop().call_later(TRIM_AFTER_READY_S, trim_heap)

    # -- reload -----------------------------------------------------------------------------------------

    async def reload(self) -> None:
        """SIGHUP: read the config again; rebuild only the components whose sections changed."""
        if self._reload_config is None:
            log.warning("SIGHUP ignored: no config source to reload")
            return
        self.notifier.reloading()
        try:
            new = self._reload_config()
            files = self._read_files(new, self.paths) if self._read_files is not None else ConfigFiles()
        except NodeAgentError as e:
            log.error("reload rejected, keeping the running config: %s", e)
            self.set_status("config", f"reload rejected: {e}")
            self.notifier.ready(self.status_line())
            return
        changed = self.config.sections_changed(new)
        changed |= {k for k in set(files.digests) | set(self.files.digests)
                    if files.digests.get(k) != self.files.digests.get(k)}
        self.reloads += 1
        self._status.pop("config", None)
        if not changed:
            log.info("reload: config unchanged")
            self.notifier.ready(self.status_line())
            return
        log.info("reload: changed %s", ", ".join(sorted(changed)))
        old, self.config, self.files = self.config, new, files
        if changed & {"log_format", "log_level"}:
            setup_logging(new.log_format, new.log_level)
        if changed & GLOBAL_SECTIONS:
            await self._rebuild_all(old)
        else:
            if "resync_interval" in changed:
                self._schedule_core_jobs()
            for slot in self._slots:
                if slot.spec.sections & changed or (slot.component is None and slot.error):
                    await self._stop_slot(slot)
                    await self._start_slot(slot)
        self.request_resync()
        self.notifier.ready(self.status_line())

    async def _rebuild_all(self, old: AgentConfig) -> None:
        for slot in reversed(self._slots):
            await self._stop_slot(slot)
        close = getattr(self.gpu, "close", None)
        if callable(close):
            close()
        if self.kube is not None:
            self.kube.close()
        self.node_name = self.config.resolved_node_name()
        self.gpu = self._gpu_factory(self.config, self.paths)
        self.kube = self._kube_factory(self.config) if self._kube_factory and self.config.kube else None
        self.inventory = None
        await self._discover()
        self._schedule_core_jobs()
        for slot in self._slots:
            await self._start_slot(slot)

    # -- helpers ----------------------------------------------------------------------------------------

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("background task %s failed: %s", task.get_name(), exc, exc_info=exc)


TRIM_AFTER_READY_S = 5.0  # start-up publishing has settled by then


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the kernel (glibc ``malloc_trim``). Start-up (imports, the first
    discovery and publish) frees about 1 MiB that glibc would otherwise keep resident for good in an idle
    daemon. False where the C library has no ``malloc_trim``."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def run_daemon(daemon: Daemon, install_signals: bool = True, exit_hard: bool = True) -> int:
    """Run the daemon on a new loop; returns its exit code.

    A blocking call that cannot be interrupted (an HTTP request to an unreachable API server, an NVML call)
    may still hold a worker thread after every component stopped. Waiting for it could break the promise
    to exit within seconds of SIGTERM, so with ``exit_hard`` such stragglers end with the process.
    """
    loop = asyncio.new_event_loop()
    try:
        code = loop.run_until_complete(daemon.run(install_signals=install_signals))
        loop.run_until_complete(loop.shutdown_asyncgens())
        with contextlib.suppress(TimeoutError):
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_default_executor(), 1.0))
    finally:
        loop.close()
    stragglers = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if stragglers and exit_hard:
        log.warning("exiting with %d blocked thread(s): %s", len(stragglers), ", ".join(t.name for t in stragglers))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# -- wiring of the real parts --------------------------------------------------------------------------


def open_gpu(config: AgentConfig, paths: HostPaths) -> GpuSource:
    """The NVML adapter (real, or the simulator with ``simulate.machine``)."""
    from nodeagent.gpu import open_nvml

    state = Path(config.simulate.state) if config.simulate.state else None
    adapter: GpuSource = open_nvml(config.simulate.machine or None, state, paths)
    return adapter


def open_kube(config: AgentConfig, paths: HostPaths) -> Any:
    from nodeagent.kube.client import KubeClient, connect

    kubeconfig = Path(config.kubeconfig) if config.kubeconfig else None
    return KubeClient(connect(kubeconfig))


def build_daemon(
    config: AgentConfig,
    paths: HostPaths,
    *,
    reload_config: Callable[[], AgentConfig] | None = None,
    notifier: Notifier | None = None,
) -> Daemon:
    holder: list[Daemon] = []
    daemon = Daemon(
        config,
        paths,
        gpu_factory=open_gpu,
        kube_factory=lambda cfg: open_kube(cfg, paths),
        specs=default_specs(lambda: holder[0]),
        reload_config=reload_config,
        notifier=notifier,
        read_files=read_config_files,
    )
    holder.append(daemon)
    return daemon


# -- the components --------------------------------------------------------------------------------------


def _close_quietly(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        with contextlib.suppress(Exception):
            close()


class DevicePluginComponent(Component):
    """The kubelet device-plugin servers; gates READY until every resource is registered."""

    name = "device-plugin"
    gates_ready = True

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        from nodeagent.deviceplugin.service import DevicePluginService
        from nodeagent.gpu.health import HealthSettings as GpuHealthSettings

        cfg = ctx.config
        self.plugin_config = ctx.files.plugin_config  # read and validated with the config (start / SIGHUP)
        health = GpuHealthSettings.from_env(
            recovery_window_s=cfg.health.window, poll_interval_s=cfg.health.poll_interval
        )
        nvml = ctx.gpu if hasattr(ctx.gpu, "wait_events") and hasattr(ctx.gpu, "gpu_healthy") else None
        self.service = DevicePluginService(
            plugin_dir=ctx.host_path(cfg.kubelet.device_plugins),
            plugin_config=self.plugin_config,
            nvml=nvml,  # type: ignore[arg-type]
            health=health,
        )
        self._ctx = ctx
        self._started = False
        monitor = self.service.monitor
        if monitor is not None:
            # A health change reaches the kubelet through the servers (the service's own hook) and then the
            # Node at once: GpuUnhealthy/GpuHealthy Events and GPU object state do not wait for the resync.
            to_kubelet = monitor.on_change

            async def health_changed() -> None:
                try:
                    await to_kubelet()
                finally:
                    ctx.request_resync()

            monitor.on_change = health_changed

    async def start(self, ctx: Context) -> None:
        if ctx.inventory is not None:
            await self.on_inventory(ctx.inventory)
        ctx.spawn(self._watch_registration(), "device-plugin ready")

    async def on_inventory(self, inventory: Inventory) -> None:
        if not self._started:
            await self.service.start(inventory)
            self._started = True
        else:
            await self.service.update(inventory)

    async def _watch_registration(self) -> None:
        while True:
            served = set(self.service.resources())
            done = set(self.service.registrations)
            if self._started and served <= done:
                self.ready.set()
                self._ctx.set_status(self.name, f"registered {len(served)} resource(s)")
                return
            await asyncio.sleep(0.02)

    def served(self) -> list[str]:
        return sorted(self.service.resources())

    def health(self) -> dict[int, bool]:
        monitor = self.service.monitor
        if monitor is None or self._ctx.inventory is None:
            return {}
        return {g.index: monitor.is_healthy(g.index) for g in self._ctx.inventory.gpus}

    async def stop(self) -> None:
        await self.service.stop()


class _DevicePluginProxy:
    """Forwards MIG's withdraw/update to whichever device-plugin component is current (reloads replace it)."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    def _dp(self) -> DevicePluginComponent | None:
        comp = self._daemon.components.get(DevicePluginComponent.name)
        return comp if isinstance(comp, DevicePluginComponent) else None

    async def withdraw(self, gpu_indices: set[int]) -> None:
        dp = self._dp()
        if dp is not None:
            await dp.service.withdraw(gpu_indices)

    async def update(self, inventory: Inventory) -> None:
        dp = self._dp()
        if dp is not None:
            await dp.on_inventory(inventory)


class MigComponent(Component):
    """Label-driven MIG reconfiguration (needs the API: the label is the input)."""

    name = "mig"

    def __init__(self, ctx: Context, daemon: Daemon) -> None:
        super().__init__()
        from nodeagent.kube.node import NodeClient
        from nodeagent.kube.podnames import CHECKPOINT_NAME, PodNameLookup
        from nodeagent.kube.podresources import PodResourcesClient
        from nodeagent.mig.reconciler import MigReconciler, MigReconcilerOptions, read_boot_id

        cfg = ctx.config.mig
        files = ctx.files  # the MIG config and hooks as validated with the config (start / SIGHUP)
        if files.mig is None or files.mig.configs is None:
            log.info("mig: %s does not exist; using the standard configs for these GPUs", cfg.config_file)
        proc = ctx.paths.proc
        # A busy-GPU refusal names namespace/pod: the kubelet's device checkpoint maps the process's pod UID
        # to devices, PodResources those devices to the pod (the channel opens only when a refusal asks).
        self.pod_resources = PodResourcesClient(ctx.host_path(ctx.config.kubelet.pod_resources()))
        checkpoint = ctx.host_path(ctx.config.kubelet.device_plugins) / CHECKPOINT_NAME
        self.reconciler = MigReconciler(
            NodeClient(ctx.kube, ctx.node_name),
            ctx.gpu,  # type: ignore[arg-type]
            ctx.paths.mig_state_dir,
            publisher=_DevicePluginProxy(daemon),
            options=MigReconcilerOptions(sources=files.mig, with_reboot=cfg.with_reboot),
            reboot=_reboot_host,
            boot_id=lambda: read_boot_id(proc),
            proc_root=proc,
            on_inventory=self._after_apply,
            on_result=self._observe,
            pod_name=PodNameLookup(checkpoint, self.pod_resources.list),
        )
        self._ctx = ctx
        self._daemon = daemon
        self._task: asyncio.Task[Any] | None = None

    def _observe(self, result: str, seconds: float) -> None:
        metrics = _running_metrics(self._daemon)
        if metrics is not None:
            metrics.observe_reconcile("mig", result, seconds)

    async def _after_apply(self, inventory: Inventory) -> None:
        self._ctx.request_resync()

    async def start(self, ctx: Context) -> None:
        (ctx.paths.mig_state_dir).mkdir(parents=True, exist_ok=True)
        self._task = ctx.spawn(self.reconciler.run(), "mig reconciler")

    async def resync(self) -> None:
        if self._task is not None and self._task.done():
            self._task = self._ctx.spawn(self.reconciler.run(), "mig reconciler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        _close_quietly(self.pod_resources)


def _reboot_host() -> None:
    import subprocess

    subprocess.run(["systemctl", "reboot"], check=False, timeout=60)


class PublisherComponent(Component):
    """Labels, unserved extended resources and GPU objects; publishes in its own task (never blocks the loop)."""

    name = "publisher"

    def __init__(self, ctx: Context, daemon: Daemon) -> None:
        super().__init__()
        from nodeagent.kube.podresources import PodResourcesClient
        from nodeagent.kube.publisher import NodePublisher, PublisherConfig

        self.pod_resources = PodResourcesClient(ctx.host_path(ctx.config.kubelet.pod_resources()))
        self.publisher = NodePublisher(
            ctx.kube,
            ctx.node_name,
            PublisherConfig.from_settings(ctx.config.publish),
            paths=ctx.paths,
            pod_resources=self.pod_resources,
        )
        self._daemon = daemon
        self._ctx = ctx
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None
        self.passes = 0
        self.last_error = ""

    async def start(self, ctx: Context) -> None:
        self._task = ctx.spawn(self._worker(), "publisher")
        self._wanted.set()

    async def on_inventory(self, inventory: Inventory) -> None:
        self._wanted.set()

    async def resync(self) -> None:
        self._wanted.set()

    async def _worker(self) -> None:
        watching = False
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            inv = self._ctx.inventory
            if inv is None:
                continue
            dp = self._daemon.components.get(DevicePluginComponent.name)
            served = dp.served() if isinstance(dp, DevicePluginComponent) else []
            plugin_config = dp.plugin_config if isinstance(dp, DevicePluginComponent) else None
            health = dp.health() if isinstance(dp, DevicePluginComponent) else None
            try:
                res = await self.publisher.apublish(inv, served, plugin_config, health=health or None)
                if not watching:
                    await asyncio.to_thread(self.publisher.start_watch)
                    watching = True
            except NodeAgentError as e:
                if str(e) != self.last_error:
                    log.warning("publishing to node %s failed (retried at the next resync): %s",
                                self._ctx.node_name, e)
                self.last_error = str(e)
                self._ctx.set_status(self.name, "API unreachable")
                continue
            self.passes += 1
            if self.last_error:
                log.info("publishing to node %s works again", self._ctx.node_name)
            self.last_error = ""
            self._ctx.set_status(self.name, "published")
            if res.writes:
                log.info("published to node %s: %d write(s)", self._ctx.node_name, res.writes)
                metrics = _running_metrics(self._daemon)
                if metrics is not None:
                    metrics.count_publish(res)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await asyncio.to_thread(self.publisher.close)
        _close_quietly(self.pod_resources)


def _running_metrics(daemon: Daemon | None) -> Metrics | None:
    """The registry of the metrics component when it runs (None with ``metrics.address = ""`` or while a
    reload rebuilds it: what happens meanwhile is not counted)."""
    comp = daemon.components.get(MetricsComponent.name) if daemon is not None else None
    return comp.metrics if isinstance(comp, MetricsComponent) else None


class MetricsComponent(Component):
    """Prometheus exposition on the configured address (``metrics.address``: 127.0.0.1:9400 by default,
    "" = no listener; the component is then not built).

    GPU readings get pod/namespace/container from the kubelet PodResources API; the shared ``KubeClient``
    reports every API request to the agent's own counters while this component runs. An address that cannot
    be bound (port in use, address not on this host) is logged once as an error and the agent runs on
    without the listener; every resync tries again quietly and logs once when it listens.
    """

    name = "metrics"

    def __init__(self, ctx: Context, daemon: Daemon | None = None) -> None:
        super().__init__()
        from nodeagent.kube.podresources import PodResourcesClient
        from nodeagent.metrics import Metrics

        self.metrics = Metrics(ctx.node_name)
        self.pod_resources = PodResourcesClient(ctx.host_path(ctx.config.kubelet.pod_resources()))
        self._assignments: list[Any] = []
        self._pod_resources_error = ""
        self._daemon = daemon
        self._ctx = ctx
        self._server: Any = None
        self._bind_error = ""
        self._kube: Any = None

    async def start(self, ctx: Context) -> None:
        self._bind()
        if ctx.kube is not None:
            self.metrics.attach_kube(ctx.kube)
            self._kube = ctx.kube
        ctx.scheduler.add_job(self.sample, "interval", seconds=ctx.config.metrics.interval, id="metrics",
                              replace_existing=True, coalesce=True, max_instances=1)
        await self.sample()

    def _bind(self) -> None:
        address = self._ctx.config.metrics.address
        try:
            self._server = self.metrics.serve(address)
        except OSError as e:
            why = e.strerror or str(e)
            if why != self._bind_error:
                log.error("metrics: cannot listen on %s: %s; running without the metrics endpoint (retried at "
                          "every resync; set [metrics] address to another HOST:PORT, or \"\" for none)",
                          address, why)
            self._bind_error = why
            self._ctx.set_status(self.name, f"cannot listen on {address}: {why}")
            return
        if self._bind_error:
            log.info("metrics: %s is free again", address)
        self._bind_error = ""
        log.info("metrics on http://%s/metrics", address)
        self._ctx.set_status(self.name, f"on {address}")

    async def resync(self) -> None:
        if self._server is None:
            self._bind()

    def _read_assignments(self) -> list[Any]:
        from nodeagent.errors import KubeletError

        try:
            self._assignments = list(self.pod_resources.list())
        except KubeletError as e:
            if str(e) != self._pod_resources_error:
                log.info("metrics without pod labels for now: %s", e)
            self._pod_resources_error = str(e)
            return self._assignments
        if self._pod_resources_error:
            log.info("PodResources answers again: metrics carry pod labels")
        self._pod_resources_error = ""
        return self._assignments

    def _health(self) -> dict[int, bool] | None:
        if self._daemon is None:
            return None
        dp = self._daemon.components.get(DevicePluginComponent.name)
        if not isinstance(dp, DevicePluginComponent):
            return None
        return dp.health() or None

    async def sample(self) -> None:
        inv = self._ctx.inventory
        gpu = self._ctx.gpu
        read = getattr(gpu, "metrics", None)
        if inv is None or not callable(read):
            return

        def collect() -> tuple[dict[int, Any], list[Any]]:
            out: dict[int, Any] = {}
            for g in inv.gpus:
                with contextlib.suppress(NodeAgentError):
                    out[g.index] = read(g.index)
            return out, self._read_assignments()

        samples, assignments = await asyncio.to_thread(collect)
        self.metrics.update_gpus(inv, samples, assignments, self._health())

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._ctx.scheduler.remove_job("metrics")
        if self._kube is not None:
            self.metrics.detach_kube(self._kube)
            self._kube = None
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
            self._server = None
        _close_quietly(self.pod_resources)


class RuntimeCheckComponent(Component):
    """Checks (never writes) that containerd still carries the NVIDIA runtime; ``bootstrap`` writes it.

    With the API reachable it also keeps the ``nvidia`` RuntimeClass in place.
    """

    name = "runtime"

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self._ctx = ctx
        self.drift: bool | None = None

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

        opts = options_from_settings(self._ctx.config.runtime, dry_run=True)
        try:
            result = await asyncio.to_thread(configure, self._ctx.paths, opts)
        except NodeAgentError as e:
            self._ctx.set_status(self.name, f"check failed: {e}")
            log.warning("runtime check failed: %s", e)
            return
        drift = result.changed
        if drift != self.drift:
            if drift:
                files = ", ".join(f.path for f in result.files if f.action != "unchanged")
                log.warning("containerd is not wired for the NVIDIA runtime (%s); run `nodeagent bootstrap`", files)
            else:
                log.info("containerd carries the NVIDIA runtime")
        self.drift = drift
        self._ctx.set_status(self.name, "containerd not wired" if drift else "containerd wired")

    async def _runtime_class(self) -> None:
        from nodeagent.kube.runtimeclass import desired_classes, ensure_runtime_classes

        classes = desired_classes(cdi=self._ctx.config.runtime.cdi)
        try:
            done = await asyncio.to_thread(ensure_runtime_classes, self._ctx.kube, classes)
        except NodeAgentError as e:
            log.warning("RuntimeClass not ensured (retried at the next start or reload): %s", e)
            return
        log.info("RuntimeClass: %s", ", ".join(f"{k} {v}" for k, v in done.items()))

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._ctx.scheduler.remove_job("runtime-check")


def default_specs(daemon_ref: Callable[[], Daemon]) -> list[ComponentSpec]:
    """The real parts of the node, in start order."""

    def device_plugin(ctx: Context) -> Component | None:
        return DevicePluginComponent(ctx) if ctx.config.device_plugin.enabled else None

    def mig(ctx: Context) -> Component | None:
        if not ctx.config.mig.enabled or ctx.kube is None:
            return None
        return MigComponent(ctx, daemon_ref())

    def publisher(ctx: Context) -> Component | None:
        p = ctx.config.publish
        if ctx.kube is None or not (p.labels or p.extended_resources or p.gpu_objects):
            return None
        return PublisherComponent(ctx, daemon_ref())

    def metrics(ctx: Context) -> Component | None:
        return MetricsComponent(ctx, daemon_ref()) if ctx.config.metrics.address else None

    def runtime(ctx: Context) -> Component | None:
        return RuntimeCheckComponent(ctx) if ctx.config.runtime.enabled else None

    return [
        ComponentSpec("device-plugin", frozenset({"device_plugin", "kubelet", "health"}), device_plugin),
        ComponentSpec("mig", frozenset({"mig"}), mig),
        ComponentSpec("publisher", frozenset({"publish", "kubelet"}), publisher),
        ComponentSpec("metrics", frozenset({"metrics", "kubelet"}), metrics),
        ComponentSpec("runtime", frozenset({"runtime"}), runtime),
    ]
