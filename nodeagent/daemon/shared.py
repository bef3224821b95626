"""What one component publishes and another reads, as typed objects the daemon owns across reloads.

A component never looks another one up: the device plugin attaches itself to ``DevicePluginLink`` while
it runs (the publisher reads its served resources, plugin config and health, the metrics its last XIDs;
the MIG reconciler withdraws and re-advertises through it, and asks which device IDs a GPU gives to find
the pods holding it), the DRA plane to ``DraLink`` (the MIG reconciler withdraws through it and asks which
claims are prepared on a GPU), the metrics component attaches its registry to
``MetricsLink`` (the MIG reconciler and the publisher count into it), and the device plugin's health
changes reach the DRA plane beside it through ``HealthLink``. While nothing is attached (disabled, or being rebuilt
by a reload) reads are empty and writes are dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

from nodeagent import fileio
from nodeagent.agentrecord import Registration
from nodeagent.daemon.planes import PlaneSplit
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.health import HealthKey
from nodeagent.gpu.inventory import Inventory

if TYPE_CHECKING:
    from nodeagent.dra.devices import DraDevice
    from nodeagent.dra.service import ClaimRef
    from nodeagent.kube.conditions import (
        ConditionSnapshot,
        ConflictInput,
        GpuHealthInput,
        ImexInput,
        PassthroughInput,
        StatusStage,
    )

log = logging.getLogger(__name__)

T = TypeVar("T")


class ServedDevices(Protocol):
    """What the running device plugin offers the other components."""

    @property
    def plugin_config(self) -> Any: ...  # sharing.spec.PluginConfig | None

    def served(self) -> list[str]: ...

    def health(self) -> dict[int, bool]: ...

    def last_xids(self) -> dict[int, int]:
        """GPU index → the last XID it reported (critical or not), for DCGM_FI_DEV_XID_ERRORS."""
        ...

    def registered(self) -> dict[str, bool]:
        """Resource name → whether the kubelet holds its registration now."""
        ...

    def allocations(self) -> dict[tuple[str, str], int]:
        """(resource, "answered" | "refused") → the kubelet's Allocate calls since the start."""
        ...

    async def withdraw(self, gpu_indices: set[int]) -> None: ...

    async def readvertise(self, gpu_indices: set[int]) -> None: ...

    async def update(self, inventory: Inventory) -> None: ...

    def device_gpus(self, gpu_indices: frozenset[int]) -> dict[tuple[str, str], int]:
        """(resource, device ID) → GPU index of every device these GPUs give, withdrawn ones included."""
        ...


class MetricsSink(Protocol):
    """The parts of ``nodeagent.metrics.Metrics`` other components count into."""

    def observe_reconcile(self, component: str, result: str, seconds: float) -> None: ...

    def count_publish(self, writes: Mapping[str, int]) -> None: ...


@dataclass(frozen=True)
class DevicePluginSnapshot:
    served: tuple[str, ...] = ()
    plugin_config: Any = None
    health: Mapping[int, bool] = field(default_factory=dict)


class _Slot(Generic[T]):
    """Holds the one attached object; detaching an object that is no longer the attached one does nothing
    (a rebuilt component attached its successor first)."""

    def __init__(self) -> None:
        self._held: T | None = None

    def attach(self, it: T) -> None:
        self._held = it

    def detach(self, it: T) -> None:
        if self._held is it:
            self._held = None

    @property
    def attached(self) -> bool:
        return self._held is not None


class DevicePluginLink(_Slot[ServedDevices]):
    """The device plugin as the other components see it (the MIG reconciler's ``ResourcePublisher``)."""

    def snapshot(self) -> DevicePluginSnapshot:
        p = self._held
        if p is None:
            return DevicePluginSnapshot()
        return DevicePluginSnapshot(tuple(p.served()), p.plugin_config, p.health())

    def health(self) -> dict[int, bool]:
        return self._held.health() if self._held is not None else {}

    def last_xids(self) -> dict[int, int]:
        return self._held.last_xids() if self._held is not None else {}

    def registered(self) -> dict[str, bool]:
        return self._held.registered() if self._held is not None else {}

    def monitor(self) -> Any:
        """The plugin's health monitor (``gpu.health.HealthMonitor``; None while none runs)."""
        get = getattr(self._held, "monitor", None)
        return get() if get is not None else None

    def allocations(self) -> dict[tuple[str, str], int]:
        return self._held.allocations() if self._held is not None else {}

    def registrations(self) -> tuple[Registration, ...]:
        """The resources the plugin serves with their registration with the kubelet (none while none runs)."""
        states = getattr(self._held, "registrations", None)
        return tuple(states()) if states is not None else ()

    def mps_manager(self) -> Any:
        """The plugin's MPS manager (``gpu.mps.MpsManager``; None while none runs)."""
        get = getattr(self._held, "mps_manager", None)
        return get() if get is not None else None

    def mps(self) -> list[Any]:
        """The MPS control daemons the plugin runs (``gpu.mps.MpsDaemonState``; none from a plugin without them)."""
        states = getattr(self._held, "mps", None)
        return list(states()) if states is not None else []

    async def withdraw(self, gpu_indices: set[int]) -> None:
        if self._held is not None:
            await self._held.withdraw(gpu_indices)

    async def readvertise(self, gpu_indices: set[int]) -> None:
        if self._held is not None:
            await self._held.readvertise(gpu_indices)

    def device_gpus(self, gpu_indices: frozenset[int]) -> dict[tuple[str, str], int]:
        return self._held.device_gpus(gpu_indices) if self._held is not None else {}

    async def update(self, inventory: Inventory) -> None:
        if self._held is not None:
            await self._held.update(inventory)


class MetricsLink(_Slot[MetricsSink]):
    """The running metrics registry; what happens while none runs is not counted."""

    def observe_reconcile(self, component: str, result: str, seconds: float) -> None:
        if self._held is not None:
            self._held.observe_reconcile(component, result, seconds)

    def count_publish(self, writes: Mapping[str, int]) -> None:
        if self._held is not None:
            self._held.count_publish(writes)

    def registry(self) -> Any:
        """The running registry (``prometheus_client.CollectorRegistry``) for a component's own metrics."""
        return getattr(self._held, "registry", None)


class CdiLink:
    """The node's CDI spec writer while it runs: refreshed before any device name is advertised."""

    def __init__(self) -> None:
        self._refresh: Callable[[Inventory], Awaitable[object]] | None = None

    def attach(self, refresh: Callable[[Inventory], Awaitable[object]]) -> None:
        self._refresh = refresh

    def detach(self, refresh: Callable[[Inventory], Awaitable[object]]) -> None:
        if self._refresh == refresh:
            self._refresh = None

    async def refresh(self, inventory: Inventory) -> None:
        if self._refresh is not None:
            await self._refresh(inventory)


class Advertiser:
    """What the MIG reconciler advertises through: the CDI spec is written first, so every device name
    the device plugin then hands out resolves; withdrawing needs no spec change (stale names resolve to
    nothing the kubelet can still ask for). The DRA plane, when one runs, withdraws the same GPUs from
    its ResourceSlices and lists the new layout after the device plugin."""

    def __init__(self, cdi: CdiLink, plugin: DevicePluginLink, dra: DraLink | None = None) -> None:
        self._cdi = cdi
        self._plugin = plugin
        self._dra = dra

    async def withdraw(self, gpu_indices: set[int]) -> None:
        await self._plugin.withdraw(gpu_indices)
        if self._dra is not None:
            await self._dra.withdraw(gpu_indices)

    async def readvertise(self, gpu_indices: set[int]) -> None:
        await self._plugin.readvertise(gpu_indices)
        if self._dra is not None:
            await self._dra.readvertise(gpu_indices)

    async def update(self, inventory: Inventory) -> None:
        await self._cdi.refresh(inventory)
        await self._plugin.update(inventory)
        if self._dra is not None:
            await self._dra.update(inventory)


class PreparedClaims(Protocol):
    """The ResourceClaims the DRA plane has prepared, by GPU (its own claim checkpoint)."""

    def claims_on(self, gpu_indices: frozenset[int]) -> dict[int, tuple[ClaimRef, ...]]:
        """GPU index → the claims prepared on it (whole GPU, MIG device or dynamic MIG instance); GPUs no
        claim uses are absent."""
        ...


class DraPool(PreparedClaims, Protocol):
    """What the MIG reconciler needs of the DRA plane: leave GPUs out of the ResourceSlices (whatever
    inventories come meanwhile), list them again (the new layout) when re-advertised, and which claims hold
    them meanwhile."""

    async def withdraw(self, gpu_indices: set[int]) -> None: ...

    async def readvertise(self, gpu_indices: set[int]) -> None: ...

    async def update(self, inventory: Inventory) -> None: ...


@runtime_checkable
class ForeignAware(Protocol):
    """A DRA plane that leaves the GPUs another DRA driver has out of its slices."""

    async def set_foreign(self, gpu_indices: frozenset[int]) -> None: ...


class DraLink(_Slot[DraPool]):
    """The DRA plane while it runs; while none runs withdrawing and advertising are no-ops and no claim is
    known. ``vfio`` keeps the node's GPUs on a VFIO driver (the workload switch's) for a plane that starts
    later."""

    def __init__(self) -> None:
        super().__init__()
        self.vfio: tuple[DraDevice, ...] = ()

    async def set_vfio(self, devices: Sequence[DraDevice]) -> None:
        self.vfio = tuple(devices)
        setter = getattr(self._held, "set_vfio", None)  # the daemon's DRA plane (a MIG-only pool has none)
        if setter is not None:
            await setter(self.vfio)

    def claims_on(self, gpu_indices: frozenset[int]) -> dict[int, tuple[ClaimRef, ...]]:
        return self._held.claims_on(gpu_indices) if self._held is not None else {}

    async def withdraw(self, gpu_indices: set[int]) -> None:
        if self._held is not None:
            await self._held.withdraw(gpu_indices)

    async def readvertise(self, gpu_indices: set[int]) -> None:
        if self._held is not None:
            await self._held.readvertise(gpu_indices)

    async def update(self, inventory: Inventory) -> None:
        if self._held is not None:
            await self._held.update(inventory)

    foreign: frozenset[int] = frozenset()  # the last set, for a plane that starts (or is rebuilt) later

    async def set_foreign(self, gpu_indices: frozenset[int]) -> None:
        """The GPUs another DRA driver has: out of the DRA plane's slices (conflict detection says which)."""
        self.foreign = gpu_indices
        if isinstance(self._held, ForeignAware):
            await self._held.set_foreign(gpu_indices)

    def mps_manager(self) -> Any:
        """The DRA plane's MPS manager (``gpu.mps.MpsManager``; None while none runs)."""
        get = getattr(self._held, "mps_manager", None)
        return get() if get is not None else None

    async def hold_out(self, gpu_indices: set[int], reason: str, effect: str = "NoSchedule") -> None:
        """A remediation's: the GPUs' devices tainted where the API server keeps device taints, else left out
        (a plane without taints only withdraws)."""
        hold = getattr(self._held, "hold_out", None)
        if hold is not None:
            await hold(gpu_indices, reason, effect)
        elif self._held is not None:
            await self._held.withdraw(gpu_indices)

    async def offer_again(self, gpu_indices: set[int]) -> None:
        offer = getattr(self._held, "offer_again", None)
        if offer is not None:
            await offer(gpu_indices)
        elif self._held is not None:
            await self._held.readvertise(gpu_indices)

    def monitor(self) -> Any:
        """The DRA plane's own health monitor (``gpu.health.HealthMonitor``): plane "dra" alone runs one;
        None beside the device plugin (whose monitor feeds it) and while none runs."""
        get = getattr(self._held, "monitor", None)
        return get() if get is not None else None


class HealthSink(Protocol):
    """What takes the device plugin's health monitor changes (the DRA plane beside it, plane "both")."""

    async def set_health(self, unhealthy: Mapping[HealthKey, str]) -> None: ...


class HealthLink:
    """The device plugin's unhealthy map (``HealthMonitor.unhealthy()``), forwarded to whoever serves GPUs
    beside it on the same NVML source: one source feeds one monitor. The last map is kept, so a sink
    attached later (rebuilt by a reload) starts from it."""

    def __init__(self) -> None:
        self._sink: HealthSink | None = None
        self._last: dict[HealthKey, str] = {}

    def current(self) -> dict[HealthKey, str]:
        return dict(self._last)

    async def attach(self, sink: HealthSink) -> None:
        self._sink = sink
        await sink.set_health(self.current())

    def detach(self, sink: HealthSink) -> None:
        if self._sink is sink:
            self._sink = None

    async def publish(self, unhealthy: Mapping[HealthKey, str]) -> None:
        self._last = dict(unhealthy)
        if self._sink is not None:
            await self._sink.set_health(self.current())


class Registrations(Protocol):
    """What the conflict detection may tell the device plugin: which resources to hold back (another
    plugin serves them) and whether to replace another process's socket at nodeagent's names."""

    def hold(self, held: dict[str, str], *, stop: bool = False) -> None: ...

    def set_take_over(self, take_over: bool) -> None: ...


class AdoptionLink:
    """The holds and the take-over decided by the conflict detection (the adopt component), forwarded to the
    device plugin; kept, so a device plugin rebuilt by a reload starts from them. ``take_over`` None: the
    config's ``[adopt] take_over`` stands."""

    def __init__(self) -> None:
        self._sink: Registrations | None = None
        self.held: dict[str, str] = {}
        self.stop = False  # the held resources are not even served (their sockets gone), not only unregistered
        self.take_over: bool | None = None

    def attach(self, sink: Registrations) -> None:
        self._sink = sink
        sink.hold(dict(self.held), stop=self.stop)
        if self.take_over is not None:
            sink.set_take_over(self.take_over)

    def detach(self, sink: Registrations) -> None:
        if self._sink is sink:
            self._sink = None

    def hold(self, held: dict[str, str], *, stop: bool = False) -> None:
        self.held, self.stop = dict(held), stop
        if self._sink is not None:
            self._sink.hold(dict(held), stop=stop)

    def set_take_over(self, take_over: bool) -> None:
        self.take_over = take_over
        if self._sink is not None:
            self._sink.set_take_over(take_over)


class PlaneLedger:
    """With plane "both": which plane offers each GPU (``planes.PlaneSplit``), kept across reloads so a
    move under way survives a rebuild of either plane, and in a file (``bind``) so it survives a restart:
    a GPU waiting for its holders is not offered by the next process either. The DRA plane owns the moves;
    the running device plugin attaches the one call that changes the GPUs it leaves out (``set_excluded``).
    None: one plane (the file is removed)."""

    def __init__(self) -> None:
        self._split: PlaneSplit | None = None
        self._path: Path | None = None
        self._root: fileio.Root | None = None
        self._exclude: Callable[[frozenset[int]], Awaitable[None]] | None = None

    def bind(self, path: Path, root: fileio.Root | None = None) -> None:
        """The ledger's file (the state directory's ``planes.json``): read once, then written at every
        change, resolved inside ``root`` each time. A damaged file is one error line and is not used (the
        config's split stands)."""
        if self._path is not None:
            return
        self._path, self._root = path, root
        if self._split is not None:
            return
        try:
            text = fileio.read_text(path, root=root)
            if text is None:
                return
            self._split = PlaneSplit.from_dict(json.loads(text))
        except (ValueError, NodeAgentError) as e:
            log.error("planes: %s is damaged (%s): not used, the split of [dra] gpus stands", path, e)

    @property
    def split(self) -> PlaneSplit | None:
        return self._split

    @split.setter
    def split(self, split: PlaneSplit | None) -> None:
        if split == self._split:
            return
        self._split = split
        if self._path is None:
            return
        try:
            if split is None:
                fileio.remove(self._path, root=self._root)
            else:
                fileio.atomic_write(self._path, json.dumps(split.to_dict()) + "\n", mode=0o600, backup=False,
                                    root=self._root, parents=True)
        except OSError as e:
            log.error("planes: %s not written (%s): a restart now would take the split of [dra] gpus",
                      self._path, e)

    def plugin_excluded(self, dra_gpus: Iterable[int]) -> frozenset[int]:
        """What a device plugin starting beside DRA leaves out: the ledger's, else the config's DRA GPUs."""
        return self.split.plugin_excluded if self.split is not None else frozenset(dra_gpus)

    def attach_plugin(self, exclude: Callable[[frozenset[int]], Awaitable[None]]) -> None:
        self._exclude = exclude

    def detach_plugin(self, exclude: Callable[[frozenset[int]], Awaitable[None]]) -> None:
        if self._exclude == exclude:
            self._exclude = None

    async def exclude_from_plugin(self) -> None:
        """Tell the running device plugin (if one runs) what the ledger leaves out of it now."""
        if self._exclude is not None and self.split is not None:
            await self._exclude(self.split.plugin_excluded)


class GpuChanges:
    """Changes the agent makes to the GPUs themselves (a MIG apply and its publication): a discovery that
    overlapped one may have read a layout half-way and must not be published after it (``mark``)."""

    def __init__(self) -> None:
        self.generation = 0
        self.running = 0

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        self.running += 1
        self.generation += 1
        try:
            yield
        finally:
            self.running -= 1

    def mark(self) -> int | None:
        """None while a change runs; else a value that differs once one has run since."""
        return None if self.running else self.generation


@dataclass
class Shared:
    """Every link, owned by the daemon: components come and go with reloads, the links stay."""

    device_plugin: DevicePluginLink = field(default_factory=DevicePluginLink)
    metrics: MetricsLink = field(default_factory=MetricsLink)
    health: HealthLink = field(default_factory=HealthLink)
    cdi: CdiLink = field(default_factory=CdiLink)
    dra: DraLink = field(default_factory=DraLink)
    conditions: ConditionInputs = field(default_factory=lambda: ConditionInputs())
    adoption: AdoptionLink = field(default_factory=AdoptionLink)
    planes: PlaneLedger = field(default_factory=PlaneLedger)
    # what the publisher stages for the conditions writer's next Node status patch (one write for both)
    node_status: StatusStage = field(default_factory=lambda: _status_stage())
    gpu_changes: GpuChanges = field(default_factory=GpuChanges)

    @property
    def advertiser(self) -> Advertiser:
        return Advertiser(self.cdi, self.device_plugin, self.dra)


def _status_stage() -> StatusStage:
    from nodeagent.kube.conditions import StatusStage

    return StatusStage()


class ConditionInputs:
    """What the Node conditions are built from, reported by the components as they learn it (kept across
    reloads: a value reported before the conditions writer runs is not lost); ``changed`` wakes the writer.

    The device plugin reports GPU health (with XIDs and recovery actions) on every health change, the MIG
    component the result of each reconcile, the runtime component each containerd check, the CDI component
    each spec write, the conflict detection what else serves or configures the GPUs."""

    def __init__(self) -> None:
        from nodeagent.kube.conditions import MigInput, RuntimeInput

        self.health: GpuHealthInput | None = None
        self.mig = MigInput()
        self.runtime = RuntimeInput()
        self.conflicts: tuple[ConflictInput, ...] = ()
        self.imex: ImexInput | None = None
        self.passthrough: PassthroughInput | None = None
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _changed(self) -> None:
        for listener in list(self._listeners):
            listener()

    def snapshot(self) -> ConditionSnapshot:
        from nodeagent.kube.conditions import ConditionSnapshot

        return ConditionSnapshot(self.health, self.mig, self.runtime, self.conflicts, imex=self.imex,
                                 passthrough=self.passthrough)

    def report_passthrough(self, passthrough: PassthroughInput | None) -> None:
        """The workload switch: the GPUs bound for VMs while the node is in vm-passthrough, else None."""
        if passthrough != self.passthrough:
            self.passthrough = passthrough
            self._changed()

    def report_imex(self, imex: ImexInput | None) -> None:
        if imex != self.imex:
            self.imex = imex
            self._changed()

    def report_health(self, health: GpuHealthInput | None) -> None:
        if health != self.health:
            self.health = health
            self._changed()

    def report_conflicts(self, conflicts: tuple[ConflictInput, ...]) -> None:
        found = tuple(sorted(conflicts))
        if found != self.conflicts:
            self.conflicts = found
            self._changed()

    def report_mig(self, *, enabled: bool = True, state: str | None = None, config: str = "",
                   error: str = "") -> None:
        from nodeagent.kube.conditions import MigInput

        mig = MigInput(enabled, state, config, error)
        if mig != self.mig:
            self.mig = mig
            self._changed()

    def report_runtime(self, *, enabled: bool = True, wired: bool | None = None, detail: str = "") -> None:
        rt = dataclasses.replace(self.runtime, check_enabled=enabled, containerd_wired=wired,
                                 containerd_detail=detail)
        if rt != self.runtime:
            self.runtime = rt
            self._changed()

    def report_cdi(self, *, enabled: bool = True, current: bool | None = None, detail: str = "") -> None:
        rt = dataclasses.replace(self.runtime, cdi_enabled=enabled, cdi_current=current, cdi_detail=detail)
        if rt != self.runtime:
            self.runtime = rt
            self._changed()
