"""The device-plugin side of nodeagent as one object the daemon drives.

``DevicePluginService`` turns an Inventory + NVIDIA plugin config into one server per resource,
registers each with the kubelet (retrying with backoff, logging each cause once), re-registers when
the kubelet restarts, follows live Inventory/config changes without a restart, and feeds health
changes into every ListAndWatch stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent import fileio
from nodeagent.backoff import Backoff
from nodeagent.deviceplugin.registrar import KubeletWatcher, register
from nodeagent.deviceplugin.server import ForeignPluginError, ResourceServer, socket_name
from nodeagent.errors import ConfigError, NodeAgentError
from nodeagent.gpu.health import (
    EventPumps,
    HealthMonitor,
    HealthMonitorSettings,
    HealthSource,
    shared_pumps,
    to_xid_event,
)
from nodeagent.gpu.inventory import Inventory
from nodeagent.gpu.mps import MpsDaemonState, MpsManager
from nodeagent.gpu.topology import score_matrix
from nodeagent.hostpaths import HostPaths
from nodeagent.sharing.devices import AdvertisedDevice, Resource, build_resources, device_gpus, resource_ids
from nodeagent.sharing.mps import plan_daemons, with_access
from nodeagent.sharing.spec import DEFAULT_CONFIG, ImexChannelRef, PluginConfig

log = logging.getLogger(__name__)

BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 5.0


@dataclass
class XidTrackingMonitor(HealthMonitor):
    """The health monitor, also remembering the last XID each GPU reported (critical or not): the value
    dcgm-exporter publishes as DCGM_FI_DEV_XID_ERRORS."""

    last_xid: dict[int, int] = field(default_factory=dict)

    async def handle_events(self, events: Iterable[Any]) -> bool:
        batch = list(events)
        for raw in batch:
            ev = to_xid_event(raw)
            if ev is not None and ev.gpu_index in self.gpu_indices:
                self.last_xid[ev.gpu_index] = ev.xid
        return await super().handle_events(batch)


class DevicePluginService:
    """All device-plugin servers of this node."""

    def __init__(
        self,
        *,
        plugin_dir: Path,
        plugin_config: PluginConfig | None = None,
        nvml: HealthSource | None = None,
        health: HealthMonitorSettings | None = None,
        pumps: EventPumps | None = None,
        exclude_gpus: Iterable[int] = (),
        register_timeout_s: float = 5.0,
        backoff_max_s: float = BACKOFF_MAX_S,
        take_over: bool = False,
        mps: MpsManager | None = None,
        under_root: Callable[[str], Path] | None = None,
        publish: Callable[[str], str] | None = None,
        root: fileio.Root | None = None,
    ) -> None:
        self._root = root  # the sockets' directory is resolved inside it whenever a socket is made
        self.take_over = take_over  # replace another process's live socket at our socket's name
        self.plugin_dir = plugin_dir.absolute()  # a relative --root must still give unix:///abs/path
        self.config = plugin_config or DEFAULT_CONFIG
        self._register_timeout = register_timeout_s
        self._backoff_max = backoff_max_s
        self._inventory: Inventory | None = None
        self._withdrawn: frozenset[int] = frozenset()
        # GPUs another plane (DRA) serves: never advertised here, still watched by the health monitor
        self._excluded: frozenset[int] = frozenset(exclude_gpus)
        self._servers: dict[str, ResourceServer] = {}
        self._registering: dict[str, asyncio.Task[None]] = {}
        self._last_cause: dict[str, str] = {}
        self._lock = asyncio.Lock()
        self._watcher = KubeletWatcher(plugin_dir, self._on_kubelet_start, root)
        self._restart_task: asyncio.Task[None] | None = None
        self._restart_pending = False
        self._scores: dict[tuple[int, int], int] = {}
        self._started = False
        self.registrations: dict[str, int] = {}  # successful Register calls per resource
        self.failures: dict[str, str] = {}  # resource → why it is neither served nor registered right now
        # resource → why nodeagent holds back its registration (another plugin serves it; see ``hold``)
        self.held: dict[str, str] = {}
        self.held_stopped: frozenset[str] = frozenset()  # held and not even served
        # (resource, "answered" | "refused") → Allocate calls since the start, across server restarts
        self._allocations: dict[tuple[str, str], int] = {}
        self._allocations_lock = threading.Lock()
        # MPS control daemons of the resources shared with MPS (none without a manager: MPS is refused)
        self._mps = mps
        self._under_root: Callable[[str], Path] = under_root or Path
        # a host path as the kubelet and the runtime name it (the mounts of an Allocate answer)
        self._publish: Callable[[str], str] = publish or (lambda p: str(self._under_root(p)))
        if mps is not None:
            mps.on_change = self._health_changed  # a daemon became ready or died: re-send the health
        self.monitor: XidTrackingMonitor | None = None
        if nvml is not None:
            self.monitor = XidTrackingMonitor(
                source=nvml, settings=health or HealthMonitorSettings.from_env(), on_change=self._health_changed,
                pumps=pumps if pumps is not None else shared_pumps(),
            )

    # ------------------------------------------------------------------ public interface
    @staticmethod
    def _checked(resources: dict[str, Resource], source: str) -> dict[str, Resource]:
        """Refuse (changing nothing) a set of resources where two would share one socket."""
        owners: dict[str, str] = {}
        for name in resources:
            other = owners.setdefault(socket_name(name), name)
            if other != name:
                raise ConfigError(
                    f"{source}: resources {other} and {name} would both be served on socket {socket_name(name)}; "
                    "rename one of them",
                    subject=name,
                )
        return resources

    def _build(self, inventory: Inventory, config: PluginConfig, withdrawn: frozenset[int]) -> dict[str, Resource]:
        resources = self._checked(build_resources(inventory, config, withdrawn=withdrawn), config.source)
        if any(r.sharing == "mps" for r in resources.values()):
            if self._mps is None:
                raise ConfigError(f"{config.source}: sharing.mps is not available here (no MPS control daemon "
                                  "can be run by this process)", subject=config.source)
            why = self._mps.unavailable()
            if why:
                raise ConfigError(f"{config.source}: sharing.mps needs the MPS control daemon, but {why}",
                                  subject=config.source)
            resources = with_access(resources, self._publish)
        return resources

    async def _apply_mps(self, resources: dict[str, Resource]) -> None:
        """Start (and wait for) the daemons the resources need, before they are advertised; stop the others."""
        if self._mps is not None:
            await self._mps.apply(plan_daemons(resources, self._under_root))

    def mps_manager(self) -> MpsManager | None:
        """The manager of the served resources' MPS control daemons (a GPU reset pauses them)."""
        return self._mps

    def mps_states(self) -> list[MpsDaemonState]:
        """The MPS control daemons running for the served resources."""
        return self._mps.states() if self._mps is not None else []

    async def start(self, inventory: Inventory) -> None:
        """Serve and register every resource of ``inventory``."""
        async with self._lock:
            if self._started:
                raise RuntimeError("DevicePluginService already started")
            resources = self._build(inventory, self.config, self._withdrawn | self._excluded)
            self._inventory = inventory
            self._scores = score_matrix(inventory)
            self._started = True
            self._watcher.start()
            if self.monitor is not None:
                await self.monitor.start(g.index for g in inventory.gpus)
            await self._apply(resources)

    async def update(self, inventory: Inventory, plugin_config: PluginConfig | None = None) -> None:
        """Follow a new Inventory and/or config; raises ConfigError (changing nothing) when invalid."""
        async with self._lock:
            config = plugin_config or self.config
            resources = self._build(inventory, config, self._withdrawn | self._excluded)
            # GPUs withdrawn for a MIG change stay withdrawn (``readvertise`` ends that): an inventory that
            # a resync brings while their change waits for a pod must not offer them to new pods
            self.config, self._inventory = config, inventory
            self._scores = score_matrix(inventory)
            if self.monitor is not None:
                self.monitor.set_gpus(g.index for g in inventory.gpus)
            if self._started:
                await self._apply(resources)

    async def withdraw(self, gpu_indices: set[int]) -> None:
        """Stop advertising these GPUs' devices (e.g. during MIG reconfiguration) until ``readvertise``
        names them; updates meanwhile keep them out."""
        async with self._lock:
            self._withdrawn = self._withdrawn | frozenset(gpu_indices)
            if self._inventory is None:
                return
            await self._apply(self._build(self._inventory, self.config, self._withdrawn | self._excluded))

    async def readvertise(self, gpu_indices: set[int]) -> None:
        """Advertise these withdrawn GPUs' devices again, as the current inventory gives them."""
        async with self._lock:
            if not self._withdrawn & frozenset(gpu_indices):
                return
            self._withdrawn = self._withdrawn - frozenset(gpu_indices)
            if self._inventory is None or not self._started:
                return
            await self._apply(self._build(self._inventory, self.config, self._withdrawn | self._excluded))

    async def set_excluded(self, gpu_indices: frozenset[int]) -> None:
        """The GPUs another plane serves or a move between the planes holds (never advertised here) are now
        these: the device lists are re-sent at once."""
        async with self._lock:
            if gpu_indices == self._excluded:
                return
            self._excluded = frozenset(gpu_indices)
            if self._inventory is not None and self._started:
                await self._apply(self._build(self._inventory, self.config, self._withdrawn | self._excluded))

    def device_gpus(self, gpu_indices: frozenset[int]) -> dict[tuple[str, str], int]:
        """(resource, device ID) → GPU index for every device of these GPUs the current inventory gives,
        withdrawn or excluded or not (the IDs a pod may hold while they are not advertised: a GPU leaving
        for the DRA plane keeps the IDs it had here)."""
        if self._inventory is None:
            return {}
        return device_gpus(self._inventory, self.config, gpu_indices, excluded=self._excluded - gpu_indices)

    def hold(self, held: dict[str, str], *, stop: bool = False) -> None:
        """Do not serve or register these resources (resource → why) while another device plugin serves them:
        a registration already accepted stays, none is sent (no kubelet restart brings one) until the hold is
        lifted; a lifted hold serves and registers at the next retry of the resource's register loop. ``stop``:
        not even served (the GPU Operator's device plugin takes the socket name): a running server stops."""
        self.held = dict(held)
        self.held_stopped = frozenset(held) if stop else frozenset()
        for name in held:
            self.failures[name] = held[name]
            server = self._servers.get(name)
            if stop and server is not None and server.running:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    continue
                loop.create_task(self._stop_held(name), name=f"stop serving {name}").add_done_callback(
                    self._report_task)

    async def _stop_held(self, name: str) -> None:
        """Stop serving a resource put on hold while it was served: its socket goes (unless another plugin has
        replaced it), the kubelet keeps what it allocated; served and registered again when the hold lifts."""
        async with self._lock:
            server = self._servers.get(name)
            why = self.held.get(name)
            if server is None or why is None or name not in self.held_stopped or not server.running:
                return
            await self._cancel_registration(name)
            await server.stop()
            log.warning("%s is no longer served: %s", name, why)
            self._last_cause[name] = why
            self._start_registration(name)

    def set_take_over(self, take_over: bool) -> None:
        """Replace (True) or leave alone (False) another process's live socket at our sockets' names."""
        self.take_over = take_over
        for server in self._servers.values():
            server.take_over = take_over

    def served_resources(self) -> dict[str, list[str]]:
        return resource_ids({n: s.resource for n, s in self._servers.items()})

    def resources(self) -> dict[str, Resource]:
        return {n: s.resource for n, s in self._servers.items()}

    def server(self, resource_name: str) -> ResourceServer:
        return self._servers[resource_name]

    def last_xids(self) -> dict[int, int]:
        """GPU index → the last XID it reported (GPUs without one are absent)."""
        return dict(self.monitor.last_xid) if self.monitor is not None else {}

    def _count_allocate(self, resource: str, ok: bool) -> None:
        key = (resource, "answered" if ok else "refused")
        with self._allocations_lock:
            self._allocations[key] = self._allocations.get(key, 0) + 1

    def allocations(self) -> dict[tuple[str, str], int]:
        """(resource, "answered" | "refused") → Allocate calls of the kubelet since the start."""
        with self._allocations_lock:
            return dict(self._allocations)

    def registered(self) -> dict[str, bool]:
        """Resource served → whether its last registration with the kubelet succeeded and none is under way
        (after a kubelet restart, until the kubelet has accepted the new one)."""
        return {n: n in self.registrations and n not in self._registering for n in self._servers}

    async def stop(self) -> None:
        """Stop every server, watcher, health task and registration attempt."""
        async with self._lock:
            self._started = False
            if self._restart_task is not None:
                self._restart_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._restart_task
                self._restart_task = None
            await self._watcher.stop()
            if self.monitor is not None:
                await self.monitor.stop()
            for name in list(self._registering):
                await self._cancel_registration(name)
            for server in list(self._servers.values()):
                await server.stop()
            self._servers.clear()
            if self._mps is not None:
                await self._mps.stop()

    # ------------------------------------------------------------------ internals
    def _healthy(self, device: AdvertisedDevice) -> bool:
        if self.monitor is None:
            return True
        mig = device.physical.mig
        return self.monitor.is_healthy(device.physical.gpu_index, mig.gi_id if mig else None)

    def _imex_channels(self) -> tuple[ImexChannelRef, ...]:
        """The plugin config's IMEX channels, made under the root as nvidia-modprobe would when missing; one
        that cannot be made is left out (logged as an error when ``imex.required``, as NVIDIA's plugin warns or
        fails)."""
        from nodeagent.imex import channels as imex

        paths = self._root if isinstance(self._root, HostPaths) else HostPaths()
        out: list[ImexChannelRef] = []
        for number in self.config.imex.channel_ids:
            try:
                ch = imex.ensure_channel(paths, number)
            except NodeAgentError as e:
                level = logging.ERROR if self.config.imex.required else logging.WARNING
                log.log(level, "IMEX channel %d not handed out: %s", number, e)
                continue
            out.append(ImexChannelRef(ch.number, ch.path, ch.host_path))
        return tuple(out)

    def _health_for(self, name: str) -> Callable[[AdvertisedDevice], bool]:
        def healthy(device: AdvertisedDevice) -> bool:
            if self._mps is not None and self._mps.daemon(name) is not None and not self._mps.ready(name):
                return False  # its control daemon does not answer: MPS clients would fail
            return self._healthy(device)

        return healthy

    async def _apply(self, resources: dict[str, Resource]) -> None:
        await self._apply_mps(resources)
        flags, policy = self.config.flags.plugin, self.config.allocation_policy
        if self.config.imex.channel_ids:
            flags = dataclasses.replace(flags, imex_channels=await asyncio.to_thread(self._imex_channels))
        for name in [n for n in self._servers if n not in resources]:
            self.failures.pop(name, None)
            await self._cancel_registration(name)
            await self._servers.pop(name).stop()
        for name, resource in resources.items():
            server = self._servers.get(name)
            if server is None:
                server = ResourceServer(
                    self.plugin_dir, resource, flags, scores=self._scores, policy=policy,
                    health_of=self._health_for(name),
                    take_over=self.take_over, on_allocate=self._count_allocate, root=self._root,
                )
                try:
                    if name not in self.held_stopped:  # served once its hold lifts
                        await server.start()
                except ForeignPluginError as e:
                    # not a failure of the component: the register loop serves once the other one is gone
                    self.failures[name] = str(e)
                self._servers[name] = server
                self._start_registration(name)
            elif await server.set_resource(resource, flags, self._scores, policy):
                log.info("%s: device list changed (%d devices), re-sent", name, len(resource.devices))

    def _start_registration(self, name: str) -> None:
        old = self._registering.pop(name, None)
        if old is not None:
            old.cancel()
        task = asyncio.create_task(self._register_loop(name), name=f"register {name}")
        task.add_done_callback(self._report_task)
        self._registering[name] = task

    def _report_task(self, task: asyncio.Task[None]) -> None:
        """A supervised task ended: an exception is logged as one error line, never left unretrieved."""
        if task.cancelled():
            return
        e = task.exception()
        if e is not None:
            log.error("device plugin: %s failed: %s: %s", task.get_name(), type(e).__name__, e)

    async def _cancel_registration(self, name: str) -> None:
        task = self._registering.pop(name, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _register_loop(self, name: str) -> None:
        """Serve (when the server is down, e.g. after a kubelet restart) and register, retrying with backoff;
        every new cause is logged once and kept in ``failures`` until the resource is registered."""
        backoff = Backoff(BACKOFF_START_S, self._backoff_max, jitter=False)
        while True:
            server = self._servers.get(name)
            if server is None:
                return
            held = self.held.get(name)
            if held is not None:
                self.failures[name] = held
                if self._last_cause.get(name) != held:
                    self._last_cause[name] = held
                    log.warning("%s is not registered: %s", name, held)
                await asyncio.sleep(backoff.next())
                continue
            try:
                if not server.running:
                    await server.start()
                await register(self.plugin_dir, name, server.endpoint, timeout=self._register_timeout)
            except (NodeAgentError, OSError) as e:
                message = str(e)
                self.failures[name] = message
                if self._last_cause.get(name) != message:
                    self._last_cause[name] = message
                    if server.running:
                        log.warning("registering %s failed, retrying with backoff: %s", name, message)
                    else:
                        log.error("%s is not served (retrying with backoff): %s", name, message)
                await asyncio.sleep(backoff.next())
                continue
            self._last_cause.pop(name, None)
            self.failures.pop(name, None)
            self.registrations[name] = self.registrations.get(name, 0) + 1
            log.info("registered %s with the kubelet (endpoint %s)", name, server.endpoint)
            if self._registering.get(name) is asyncio.current_task():
                del self._registering[name]
            return

    def _on_kubelet_start(self) -> None:
        """kubelet.sock appeared: the kubelet (re)started and wiped our sockets; serve and register again."""
        if not self._started:
            return
        self._restart_pending = True
        if self._restart_task is None or self._restart_task.done():
            self._restart_task = asyncio.create_task(self._restart_all(), name="kubelet restart")
            self._restart_task.add_done_callback(self._report_task)

    async def _restart_all(self) -> None:
        while self._restart_pending:
            self._restart_pending = False
            await self._restart_once()

    async def _restart_once(self) -> None:
        async with self._lock:
            if not self._started:
                return
            log.info("kubelet.sock re-created: restarting %d server(s) and registering again", len(self._servers))
            for name, server in self._servers.items():
                await self._cancel_registration(name)
                await server.stop()
            # each registration loop serves again before registering: a server that cannot start (its socket
            # path is taken by a directory, ...) is reported and retried without holding up the others
            for name in self._servers:
                self._start_registration(name)

    async def _health_changed(self) -> None:
        for server in list(self._servers.values()):
            await server.health_changed()

    # convenience for callers holding only GPU indices
    def gpu_indices(self) -> Iterable[int]:
        return sorted({d.physical.gpu_index for s in self._servers.values() for d in s.resource.devices})
