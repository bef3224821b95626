"""What the daemon runs and what a running part may use of it: ``Component`` (one part of the node: start,
inventory, resync, reload, stop), ``ComponentSpec`` (how the config builds one), ``Context`` (the daemon as a
component sees it) and ``GpuSource`` (what they use of the NVML adapter). The daemon itself is
``supervisor.Daemon``; ``Context`` reaches it through ``Host``, the part of it a component may use."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from nodeagent.config import AgentConfig
from nodeagent.daemon.files import ConfigFiles
from nodeagent.daemon.shared import Shared
from nodeagent.gpu.health import EventPumps, HealthSource
from nodeagent.gpu.inventory import Inventory
from nodeagent.gpu.ports import GpuDiscovery, GpuTelemetry, MigAdministration
from nodeagent.hostpaths import HostPaths

if TYPE_CHECKING:
    from nodeagent.kube.node import NodeWatchHub
    from nodeagent.kube.podresources import PodResourcesClient


class GpuSource(GpuDiscovery, MigAdministration, HealthSource, GpuTelemetry, Protocol):
    """What the daemon and its components use of the NVML adapter: the ports of ``nodeagent.gpu.ports``
    (discovery and MIG administration, health events, telemetry) and ``close``. ``open_nvml`` and
    ``adapter_for_sim`` return one; tests hand in small fakes of the same shape."""

    def discover(self, *, partial: bool = False) -> Inventory: ...

    def close(self) -> None: ...


class Host(Protocol):
    """What ``Context`` uses of the daemon (``supervisor.Daemon``)."""

    config: AgentConfig
    paths: HostPaths
    gpu: GpuSource
    exiting: bool
    pumps: EventPumps
    inventory: Inventory | None
    node_name: str
    scheduler: AsyncIOScheduler
    files: ConfigFiles
    kube: Any
    shared: Shared

    def node_watches(self) -> NodeWatchHub: ...

    def request_resync(self) -> None: ...

    def record_state(self) -> None: ...

    def set_status(self, component: str, text: str) -> None: ...

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]: ...


class Context:
    """What a component may use from the daemon: config, paths, the scheduler and a few callbacks."""

    def __init__(self, daemon: Host) -> None:
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
    def exiting(self) -> bool:
        """True once the process is on its way out (components stop for good, not for a reload)."""
        return self._daemon.exiting

    @property
    def pumps(self) -> EventPumps:
        """The NVML event pumps of every health monitor; owned by the daemon, kept across reloads."""
        return self._daemon.pumps

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

    @property
    def shared(self) -> Shared:
        """The links between components (device plugin, metrics); they outlive reloads."""
        return self._daemon.shared

    @property
    def node_watches(self) -> NodeWatchHub:
        """The one watch of the own Node every component subscribes to (owned by the daemon)."""
        return self._daemon.node_watches()

    def host_path(self, host_path: str) -> Path:
        return self._daemon.paths(host_path)

    def pod_resources_client(self) -> PodResourcesClient:
        """A client of the kubelet's PodResources socket (``[kubelet]``'s, under the root); its channel opens
        at the first call. The caller closes it (``close_quietly``)."""
        from nodeagent.kube.podresources import PodResourcesClient

        return PodResourcesClient(self.host_path(self.config.kubelet.pod_resources()))

    def request_resync(self) -> None:
        """Ask for a rediscovery pass soon (after a MIG apply, a health change, ...)."""
        self._daemon.request_resync()

    def record_state(self) -> None:
        """What the agent's record holds of the components changed (a registration with the kubelet, why one
        is not made): written to it now, for doctor."""
        self._daemon.record_state()

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

    def check_reload(self, new: AgentConfig) -> None:
        """Refuse (``NodeAgentError``) a reloaded config this running component could not take, before
        anything changes (e.g. a GPU index the node does not have)."""

    async def reconfigure(self, old: AgentConfig, new: AgentConfig, changed: frozenset[str]) -> bool:
        """Take the change of ``changed`` sections while running (``ctx.config`` is ``new`` already);
        True: done, the component is not rebuilt. The default rebuilds."""
        return False


@dataclass(frozen=True)
class ComponentSpec:
    """How to build one component from the config, and which config sections it depends on."""

    name: str
    sections: frozenset[str]
    build: Callable[[Context], Component | None]  # None = disabled by this config
