"""The supervisor: one asyncio loop running the components of the node.

Shape:

    Daemon ── GpuSource.discover() ──► Inventory ──► every Component.on_inventory()
      │  apscheduler AsyncIOScheduler: resync (rediscover + publish), watchdog, and the components' own jobs
      │  signals: SIGTERM/SIGINT → stop;  SIGHUP → reload config, rebuild only what changed;
      │           SIGUSR1 → one log line counting asyncio tasks, threads and open fds (leak hunting)
      └─ sd_notify: READY once the components that gate readiness are ready (device plugin registered)

Every part of the node (device-plugin servers, MIG reconciler, node publisher, metrics, runtime check)
is a ``Component`` built by a ``ComponentSpec`` from the config; each is optional and injected, so the
daemon's own logic is tested with small components and the real ones plug in through ``wiring``.
Components reach each other only through the typed links of ``ctx.shared`` (see ``shared``), never by
name. A component that fails to start is reported in the status line and retried on the next resync; it
never takes the others down. Stopping never touches node labels: the node keeps what it last published.

A reload (SIGHUP) is all or nothing: a config or named file that fails validation changes nothing, and
every reload ends with READY=1, whatever happened.
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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from nodeagent.agentrecord import Fault, OtherAgent
from nodeagent.config import AgentConfig
from nodeagent.daemon.component import Component, ComponentSpec, Context, GpuSource
from nodeagent.daemon.files import ConfigFiles
from nodeagent.daemon.shared import Shared
from nodeagent.daemon.support import TRIM_AFTER_READY_S, RunRecorder, close_quietly, one_line, trim_heap
from nodeagent.deadline import within
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.health import EventPumps
from nodeagent.gpu.inventory import Inventory
from nodeagent.grpcadapter.loops import quiet_closed_poller
from nodeagent.hostpaths import HostPaths
from nodeagent.logs import setup_logging
from nodeagent.sdnotify import Notifier

if TYPE_CHECKING:
    from nodeagent.kube.node import NodeWatchHub

# (the parts and helpers that moved to ``component`` and ``support``, importable from here as before)
__all__ = ["GLOBAL_SECTIONS", "READY_FALLBACK", "STOP_TIMEOUT", "Component", "ComponentSpec", "Context", "Daemon",
           "GpuSource", "RunRecorder", "close_quietly", "run_daemon", "trim_heap"]

log = logging.getLogger(__name__)

STOP_TIMEOUT = 3.0  # seconds all components together get to stop (the unit allows 5)
READY_FALLBACK = 60.0  # READY=1 is sent after this long even if the kubelet never answered


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
        recorder: RunRecorder | None = None,
    ) -> None:
        # The named files first: a broken one must stop the start before anything is opened or served.
        self._read_files = read_files
        self.files = read_files(config, paths) if read_files is not None else ConfigFiles()
        self.config = config
        self.paths = paths
        self._gpu_factory = gpu_factory
        self._kube_factory = kube_factory
        self._reload_config = reload_config
        self._recorder = recorder
        self.notifier = notifier if notifier is not None else Notifier()
        self._ready_fallback = ready_fallback
        self.node_name = config.resolved_node_name()
        self.gpu: GpuSource = gpu_factory(config, paths)
        self.kube: Any = kube_factory(config) if kube_factory is not None and config.kube else None
        self.inventory: Inventory | None = None
        self.scheduler = AsyncIOScheduler()
        self.shared = Shared()
        self.pumps = EventPumps()  # outlives every health monitor (and GPU source) a reload replaces
        self._node_watches: NodeWatchHub | None = None
        self.ctx = Context(self)
        self._slots = [_Slot(spec) for spec in specs]
        self._stop = asyncio.Event()
        self._resync_wanted = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._status: dict[str, str] = {}
        self._ready_sent = False
        self.exiting = False
        self.started_at = time.monotonic()
        self.reloads = 0
        self.resyncs = 0
        if recorder is not None:  # the GPUs' health and the conflicts as the components report them, for doctor
            self.shared.conditions.subscribe(self.record_state)

    # -- public -----------------------------------------------------------------------------------------

    @property
    def errors(self) -> dict[str, str]:
        """Components that failed to build or start, with the reason."""
        return {s.spec.name: s.error for s in self._slots if s.error}

    @property
    def components(self) -> dict[str, Component]:
        return {s.spec.name: s.component for s in self._slots if s.component is not None}

    def node_watches(self) -> NodeWatchHub:
        """Built on first use (only components that talk to the API need it); kept across reloads."""
        if self._node_watches is None:
            from nodeagent.kube.node import NodeWatchHub

            self._node_watches = NodeWatchHub()
        return self._node_watches

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
        if self._recorder is not None:
            self._recorder.started(self.config.source)
        try:
            await self._start()
            self.record_state()
            await self._main_loop()
        finally:
            await self._shutdown()
            if self._recorder is not None:
                self._recorder.stopped()
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
        return {"tasks": len(tasks), "threads": threading.active_count(), "fds": fds,
                "task_kinds": dict(kinds)}

    def log_diagnostics(self) -> None:
        d = self.diagnostics()
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(d["task_kinds"].items()))
        log.info("diagnostics: %d asyncio task(s), %d thread(s), %d open fd(s); tasks: %s",
                 d["tasks"], d["threads"], d["fds"], kinds)

    # -- start / stop -----------------------------------------------------------------------------------

    async def _start(self) -> None:
        log.info(
            "starting nodeagent on node %s (config %s%s%s)",
            self.node_name,
            self.config.source or "defaults",
            f", simulating {self.config.simulate.machine}" if self.config.simulate.machine else "",
            f", host paths under {self.paths.root}" if self.paths.root != Path("/") else "",
        )
        self.notifier.status("discovering GPUs")
        await self._discover()
        if self.inventory is not None:  # a config these GPUs can never serve stops the start (exit 2)
            self.files.check(self.inventory)
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
            log.debug("component %s could not be built", slot.spec.name, exc_info=True)
            self._slot_failed(slot, f"cannot build: {one_line(e)}")
            return
        if slot.component is None:
            self._status.pop(slot.spec.name, None)
            return
        try:
            await slot.component.start(self.ctx)
            if self.inventory is not None:
                await slot.component.on_inventory(self.inventory)
        except Exception as e:
            log.debug("component %s failed to start", slot.spec.name, exc_info=True)
            self._slot_failed(slot, f"failed to start: {one_line(e)}")
            with contextlib.suppress(Exception):
                await within(slot.component.stop(), STOP_TIMEOUT)
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
            await within(comp.stop(), timeout)
        except TimeoutError:
            log.warning("component %s did not stop within %.1fs", slot.spec.name, timeout)
        except Exception as e:
            log.debug("component %s failed while stopping", slot.spec.name, exc_info=True)
            log.error("component %s failed while stopping: %s", slot.spec.name, one_line(e))

    async def _shutdown(self) -> None:
        log.info("stopping")
        self.exiting = True
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
        close_quietly(self.gpu)
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
                    log.debug("component %s resync failed", slot.spec.name, exc_info=True)
                    log.warning("component %s resync failed: %s", slot.spec.name, one_line(e))
                    self.set_status(slot.spec.name, f"resync failed: {one_line(e)}")

    async def _discover(self) -> bool:
        """Rediscover; True when the Inventory differs from the previous one."""
        # While the agent changes the GPUs (a MIG apply), or when it changed them during the discovery, what a
        # discovery reads may be a layout half-way: not published. The change publishes its own result and
        # asks for the next resync.
        changes = self.shared.gpu_changes
        mark = changes.mark()
        if mark is None:
            log.debug("a change of the GPUs runs; discovery left to the resync it asks for")
            return False
        try:
            inv = await asyncio.to_thread(self.gpu.discover)
        except NodeAgentError as e:
            log.error("GPU discovery failed: %s", e)
            self.set_status("discovery", f"failed: {e}")
            return False
        self._status.pop("discovery", None)
        if changes.mark() != mark:
            log.debug("discovery overlapped a change of the GPUs; not published")
            return False
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
                        "not registered with the kubelet after %.0fs; reporting ready anyway",
                        self._ready_fallback,
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
        """SIGHUP: read the config again; rebuild only the components whose sections changed. All or nothing:
        a rejected config changes nothing; every reload ends with READY=1."""
        if self._reload_config is None:
            log.warning("SIGHUP ignored: no config source to reload")
            return
        self.notifier.reloading()
        try:
            await self._reload()
        except Exception as e:  # a bug must not leave systemd waiting in "reloading" for good
            log.exception("reload failed")
            self.set_status("config", f"reload failed: {e}")
            self._record_reload("failed", one_line(e))
        finally:
            self.notifier.ready(self.status_line())

    def _reject_reload(self, e: Exception) -> None:
        """A reload that cannot be taken: logged (a traceback only for the unexpected) and shown in the status;
        the running config stays."""
        if isinstance(e, NodeAgentError):
            log.error("reload rejected, keeping the running config: %s", e)
        else:
            log.exception("reload rejected, keeping the running config")
        self.set_status("config", f"reload rejected: {e}")
        self._record_reload("rejected", one_line(e))

    def record_state(self) -> None:
        """The GPUs' health, the other agents found and the device plugin's registrations, into the agent's
        record (each written only when it changed)."""
        if self._recorder is None:
            return
        conditions = self.shared.conditions
        health = conditions.health
        self._recorder.health(() if health is None else tuple(
            Fault(gpu=f.index, xid=f.xid, gi=f.gi_id, recovery=f.recovery, lost=f.lost) for f in health.faults))
        self._recorder.observed(tuple(OtherAgent(c.kind, c.subject, c.owner, c.detail) for c in conditions.conflicts),
                                self.shared.device_plugin.registrations())

    def _record_reload(self, outcome: Literal["applied", "unchanged", "rejected", "failed"], detail: str) -> None:
        if self._recorder is not None:
            self._recorder.reloaded(outcome, detail, self.config.source)

    async def _reload(self) -> None:
        assert self._reload_config is not None
        try:  # everything is read and checked before anything changes, off the loop (files are never
            # waited for: a FIFO or device in a config file's place is refused at once, see fileio.read_regular)
            new = await asyncio.to_thread(self._reload_config)
            read_files = self._read_files
            files = await asyncio.to_thread(read_files, new, self.paths) if read_files is not None \
                else ConfigFiles()
            if self.inventory is not None:
                files.check(self.inventory)
        except Exception as e:
            self._reject_reload(e)
            return
        changed = self.config.sections_changed(new)
        changed |= {k for k in set(files.digests) | set(self.files.digests)
                    if files.digests.get(k) != self.files.digests.get(k)}
        try:  # what only the running components can judge (the GPUs the node has), still before any change
            for slot in self._slots:
                if slot.component is not None and slot.spec.sections & changed:
                    slot.component.check_reload(new)
        except Exception as e:
            self._reject_reload(e)
            return
        self.reloads += 1
        self._status.pop("config", None)
        if not changed:
            log.info("reload: config unchanged")
            self._record_reload("unchanged", "")
            return
        log.info("reload: changed %s", ", ".join(sorted(changed)))
        opened: tuple[GpuSource, Any] | None = None
        if changed & GLOBAL_SECTIONS:
            # Another machine, cluster or node: open the new GPU source and API client before anything
            # stops, so a reload that cannot open them changes nothing either.
            try:
                opened = self._open_sources(new)
            except Exception as e:
                self._reject_reload(e)
                return
        old, self.config, self.files = self.config, new, files
        if changed & {"log_format", "log_level"}:
            setup_logging(new.log_format, new.log_level)
        if opened is not None:
            await self._rebuild_all(*opened)
        else:
            if "resync_interval" in changed:
                self._schedule_core_jobs()
            for slot in self._slots:
                if slot.spec.sections & changed or (slot.component is None and slot.error):
                    if await self._reconfigured(slot, old, new, frozenset(changed)):
                        continue
                    await self._stop_slot(slot)
                    await self._start_slot(slot)
        failed = self.errors
        self._record_reload("applied", "changed " + ", ".join(sorted(changed)) + "".join(
            f"; {name}: {why}" for name, why in sorted(failed.items())))
        self.request_resync()

    async def _reconfigured(self, slot: _Slot, old: AgentConfig, new: AgentConfig, changed: frozenset[str]) -> bool:
        """The running component took the change itself (no rebuild); a failure there rebuilds it."""
        if slot.component is None or not slot.started:
            return False
        try:
            return await slot.component.reconfigure(old, new, changed)
        except Exception as e:
            log.debug("component %s could not take the change", slot.spec.name, exc_info=True)
            log.warning("component %s could not take the change live (rebuilt): %s", slot.spec.name, one_line(e))
            return False

    def _open_sources(self, config: AgentConfig) -> tuple[GpuSource, Any]:
        gpu = self._gpu_factory(config, self.paths)
        try:
            kube = self._kube_factory(config) if self._kube_factory and config.kube else None
        except BaseException:
            close_quietly(gpu)
            raise
        return gpu, kube

    async def _rebuild_all(self, gpu: GpuSource, kube: Any) -> None:
        for slot in reversed(self._slots):
            await self._stop_slot(slot)
        close_quietly(self.gpu)
        if self.kube is not None:
            close_quietly(self.kube)
        self.node_name = self.config.resolved_node_name()
        self.gpu, self.kube = gpu, kube
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


def run_daemon(daemon: Daemon, install_signals: bool = True, exit_hard: bool = True) -> int:
    """Run the daemon on a new loop; returns its exit code.

    A blocking call that cannot be interrupted (an HTTP request to an unreachable API server, an NVML call)
    may still hold a worker thread after every component stopped. Waiting for it could break the promise
    to exit within seconds of SIGTERM, so with ``exit_hard`` such stragglers end with the process.
    """
    loop = asyncio.new_event_loop()
    quiet_closed_poller(loop)
    try:
        code = loop.run_until_complete(daemon.run(install_signals=install_signals))
        loop.run_until_complete(loop.shutdown_asyncgens())
        with contextlib.suppress(asyncio.TimeoutError):
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_default_executor(), 1.0))
    finally:
        loop.close()
    stragglers = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if stragglers and exit_hard:
        log.warning("exiting with %d blocked thread(s): %s", len(stragglers),
                    ", ".join(t.name for t in stragglers))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
