"""``DraComponent``: the DRA plane as one piece the daemon starts, feeds and stops.

    dra = DraComponent(paths=paths, kube=kube, node_name=node)
    await dra.start(inventory)          # checkpoint recovery, sockets, first ResourceSlice sync
    await dra.on_inventory(inventory)   # after every inventory change (MIG reconfigured, GPU lost)
    await dra.set_health(monitor.unhealthy())   # from HealthMonitor.on_change
    await dra.stop()                    # sockets down, ResourceSlices withdrawn

Health: with ``nvml=`` the component runs its own ``HealthMonitor`` (only when no device plugin runs on
the same NVML source: a source serves one monitor); otherwise pass the device plugin's monitor changes
to ``set_health``. ``gpu_filter`` limits the pool to some GPUs, so two planes on one node never hand
out the same GPU; ``pumps`` is the NVML event-pump registry of whoever outlives the component (the
daemon's, so a rebuild hands over what its monitor held). ``reverify()`` (e.g. from the daemon's periodic
resync) compares the pool with the API.

Dynamic MIG (``dynamic_mig=True`` with ``mig=`` the MIG port): a GPU in MIG mode whose GPU instances are
all ones this driver created for claims (none at first) publishes its placements and counters
(``nodeagent.dra.devices``); prepare creates the instance. A GPU carrying any other instance (a static
layout, e.g. from mig-parted or the MIG manager) keeps publishing its existing MIG devices and is never
changed by this driver.

Shared GPUs (``shared_gpus``, consumable capacity): those GPUs' whole device or static MIG devices allow
multiple allocations, each consuming memory and a compute share (``nodeagent.dra.devices``); published so
on an API server with the feature (Kubernetes 1.36 and later, or ``consumable=True``), as ordinary devices
on older ones. Prepare writes each allocation's limits into the claim's CDI spec (``nodeagent.dra.cdi``).

Slice writes run in a background task: a failed write (API server down) is retried with backoff and a
fresh comparison against what the API holds, so nothing is written twice and nothing is lost. The kubelet
deletes a node's ResourceSlices when it starts and when a driver stays away too long, so the pool is also
checked (one LIST, no write when intact) every ``verify_interval_s`` and whenever the kubelet registers the
driver again; missing or foreign-changed slices are written anew with the next generation. The periodic
check is a job on ``scheduler`` (the daemon's apscheduler); without one the component runs its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nodeagent.backoff import Backoff
from nodeagent.cdi.host import collect as collect_host_facts
from nodeagent.deadline import cancel_all, within
from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.cdi import ClaimSpecs
from nodeagent.dra.channels import channel_dra_device, channel_nodes
from nodeagent.dra.checkpoint import Checkpoint, PreparedDevice
from nodeagent.dra.devices import (
    DraDevice,
    build_counter_sets,
    build_devices,
    dynamic_mig_gpu,
    pci_bus_id,
    read_pcie_roots,
)
from nodeagent.dra.health import HealthFeed, HealthKey, HealthUpdates, unhealthy_devices
from nodeagent.dra.metadata import DATA_SUBDIR, ClaimMetadata
from nodeagent.dra.mps import ClaimMps
from nodeagent.dra.publisher import SlicePublisher
from nodeagent.dra.server import DraServer
from nodeagent.dra.service import ClaimPreparer, ClaimRef
from nodeagent.dra.slices import MAX_DEVICES, PoolContent, pool_content
from nodeagent.dra.status import ClaimStatusWriter, device_status
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.fabric import decide as decide_clique
from nodeagent.gpu.health import EventPumps, HealthMonitor, HealthMonitorSettings, HealthSource, shared_pumps
from nodeagent.gpu.inventory import Gpu, Inventory
from nodeagent.gpu.ports import MigAdministration
from nodeagent.hostpaths import KUBELET_DIR, HostPaths
from nodeagent.kube.client import KubeClient

if TYPE_CHECKING:
    from apscheduler.schedulers.asyncio import AsyncIOScheduler

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "dra-claims.json"
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
VERIFY_INTERVAL_S = 60.0


class DraComponent:
    def __init__(
        self,
        *,
        paths: HostPaths,
        kube: KubeClient,
        node_name: str,
        driver: str = DRIVER_NAME,
        kubelet_dir: Path | None = None,
        cdi_dir: Path | None = None,
        checkpoint_path: Path | None = None,
        health_source: HealthUpdates | None = None,
        max_devices_per_slice: int = MAX_DEVICES,
        verify_interval_s: float = VERIFY_INTERVAL_S,
        nvml: HealthSource | None = None,
        health_settings: HealthMonitorSettings | None = None,
        gpu_filter: Callable[[Gpu], bool] | None = None,
        pumps: EventPumps | None = None,
        kubelet_host_dir: Path | None = None,
        mig: MigAdministration | None = None,
        dynamic_mig: bool = False,
        slice_layout: str | None = None,
        scheduler: AsyncIOScheduler | None = None,
        shared_gpus: Iterable[int] = (),
        consumable: bool | None = None,
        device_status: bool = True,
        mps: ClaimMps | None = None,
        leaving: Iterable[int] = (),
        device_metadata: bool = True,
    ) -> None:
        self.paths = paths
        self.mps = mps  # MPS daemons for claims whose opaque config asks for MPS
        self.kube = kube
        self.node_name = node_name
        self.driver = driver
        self.kubelet_dir = kubelet_dir or paths(KUBELET_DIR)
        # the kubelet's directory as the kubelet sees it (default: the same)
        self.kubelet_host_dir = kubelet_host_dir
        self.cdi_dir = cdi_dir or paths("/var/run/cdi")
        self.checkpoint_path = checkpoint_path or paths.state_dir / CHECKPOINT_NAME
        self.health_source = health_source
        # KEP-5304: each prepared request's DeviceMetadata file and the CDI spec mounting it in the container
        self.device_metadata = device_metadata
        self.verify_interval_s = verify_interval_s
        self.scheduler = scheduler
        self._own_scheduler: AsyncIOScheduler | None = None
        self._verify_job: str | None = None
        self.gpu_filter = gpu_filter
        self.mig = mig
        self.dynamic_mig = dynamic_mig and mig is not None
        # GPUs whose whole device or static MIG devices allow multiple allocations (consumable capacity)
        self.shared_gpus = frozenset(shared_gpus)
        # each newly prepared claim's status.devices (device, UUID, MIG placement), written in the background
        self.status_writer = ClaimStatusWriter(kube, driver) if device_status else None
        self._status_tasks: set[asyncio.Task[bool]] = set()
        self.publisher = SlicePublisher(kube, node_name, driver=driver, max_devices=max_devices_per_slice,
                                        layout=slice_layout, consumable=consumable)
        self._inventory: Inventory | None = None
        self.feed = HealthFeed()
        self.devices: list[DraDevice] = []
        # the GPUs on a VFIO driver while the node is in vm-passthrough (``set_vfio``), beside the inventory's
        self.vfio_devices: list[DraDevice] = []
        self._unhealthy: dict[HealthKey, str] = {}
        self._withdrawn: frozenset[int] = frozenset()  # GPUs left out of the slices until re-advertised
        # GPUs a remediation holds out, listed tainted (GPU → its taint) while the API server keeps device taints
        self._held_out: dict[int, dict[str, str]] = {}
        # GPUs leaving this plane for the device plugin: out of the slices, no new claim, until ``set_gpus``
        self._leaving: frozenset[int] = frozenset(leaving)
        # GPUs another DRA driver publishes (or a claim of it still holds): never in this driver's slices too
        self._foreign: frozenset[int] = frozenset()
        self.on_claims_changed: Callable[[], None] | None = None  # after every prepare and unprepare
        self.clique: str | None = None  # the node's NVLink clique (nvidia.com/gpu.clique), from the inventory
        self.preparer: ClaimPreparer | None = None
        self.server: DraServer | None = None
        self._wanted: PoolContent | None = None
        self._published: PoolContent | None = None
        self._dirty = asyncio.Event()
        self._synced = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self.last_error: str = ""
        # With ``nvml`` the component runs its own health monitor (plane "dra" alone). Beside the device
        # plugin (plane "both") the plugin's monitor is the only one allowed on the source: feed
        # ``set_health`` from its on_change instead.
        self.monitor: HealthMonitor | None = None
        if nvml is not None:
            self.monitor = HealthMonitor(nvml, health_settings or HealthMonitorSettings.from_env(),
                                         on_change=self._monitor_changed,
                                         pumps=pumps if pumps is not None else shared_pumps())

    async def _monitor_changed(self) -> None:
        assert self.monitor is not None
        await self.set_health(self.monitor.unhealthy())

    def _report_prepared(self, ref: ClaimRef, prepared: tuple[PreparedDevice, ...]) -> None:
        """Write the claim's device status in the background (prepare has answered already)."""
        if self.status_writer is None:
            return
        entries = device_status(self.driver, prepared, {d.name: d for d in self.devices})
        task = asyncio.create_task(asyncio.to_thread(self.status_writer.write, ref.namespace, ref.name, ref.uid,
                                                     entries), name=f"dra-status-{ref.uid}")
        self._status_tasks.add(task)
        task.add_done_callback(self._status_tasks.discard)

    async def wait_status_written(self) -> None:
        """Wait for the device status writes under way (tests, benchmarks)."""
        while self._status_tasks:
            await asyncio.gather(*list(self._status_tasks), return_exceptions=True)

    def _read_claim(self, namespace: str, name: str) -> dict[str, object]:
        return self.kube.get_resource_claim(namespace, name)

    async def start(self, inventory: Inventory) -> None:
        """Bring the plane up. A damaged checkpoint raises ``InputError`` and starts nothing."""
        checkpoint = await asyncio.to_thread(Checkpoint.load, self.checkpoint_path, self.paths)
        metadata = ClaimMetadata(self.driver, self.kubelet_dir / "plugins" / self.driver / DATA_SUBDIR,
                                 self.cdi_dir, root=self.paths, published=self.paths.published) \
            if self.device_metadata else None
        specs = ClaimSpecs(self.cdi_dir, self.paths)
        specs.channel_nodes = channel_nodes(self.paths)  # IMEX channels made on the node as claims need them
        self.preparer = ClaimPreparer(checkpoint, specs, self._read_claim, self.node_name,
                                      driver=self.driver, mig=self.mig,  # MIG claims unprepare with the knob off
                                      mps=self.mps, on_prepared=self._report_prepared, metadata=metadata)
        self._set_withdrawn(self._withdrawn)  # a MIG change may have withdrawn GPUs before the start
        await self._set_inventory(inventory)
        if self.mps is not None:  # the MPS edits of claims prepared before, so their specs stay as written
            self.preparer.specs.extra_edits.update(self.mps.load(self.preparer.devices))
        if await asyncio.to_thread(self.preparer.recover, inventory) and self.mig is not None:
            await self._set_inventory(await asyncio.to_thread(self.mig.discover))
        if self.mps is not None:
            await self.mps.resume(set(self.preparer.checkpoint.claims))
        self.server = DraServer(self.kubelet_dir, self.preparer, self.feed, driver=self.driver,
                                on_registered=self.reverify, kubelet_host_dir=self.kubelet_host_dir,
                                on_claims_changed=self._claims_changed, root=self.paths)
        await self.server.start()
        self._tasks.append(asyncio.create_task(self._publish_loop(), name="dra-slices"))
        self._schedule_verify()
        if self.health_source is not None:
            self._tasks.append(asyncio.create_task(self._follow_health(), name="dra-health"))
        if self.monitor is not None:
            await self.monitor.start(g.index for g in inventory.gpus)

    async def _set_inventory(self, inventory: Inventory) -> None:
        roots = await asyncio.to_thread(read_pcie_roots, inventory, self.paths.sys_pci_devices)
        self._inventory = inventory
        # a GPU on a VFIO driver is offered only as such (an inventory from before its switch still has it)
        on_vfio = {d.vfio.bdf for d in self.vfio_devices if d.vfio is not None}
        by_index = {g.index: pci_bus_id(g.pci_bus_id) for g in inventory.gpus}
        self.devices = [d for d in build_devices(inventory, roots, self.gpu_filter,
                                                 self._dynamic if self.dynamic_mig else None,
                                                 self._shared if self.shared_gpus else None)
                        if by_index.get(d.gpu_index) not in on_vfio] + self.vfio_devices
        # the node's NVLink clique from its GPUs' fabric info: with one, the pool holds the IMEX channel device
        self.clique = decide_clique(inventory).value
        if self.clique:
            self.devices.append(channel_dra_device(self.clique))
        assert self.preparer is not None
        self.preparer.set_devices(self.devices)
        # the device nodes as the node-wide CDI spec names them (host paths under --root, stand-in numbers)
        try:
            facts = await asyncio.to_thread(collect_host_facts, self.paths, inventory)
            self.preparer.specs.node_facts = facts.nodes
        except NodeAgentError as e:  # e.g. an unreadable mig-minors table: name the nodes by path alone
            log.warning("DRA CDI specs: host device facts unavailable (%s); naming device nodes by path", e)
            self.preparer.specs.node_facts = {}
        await self.preparer.refresh_metadata()  # prepared claims' metadata follows the devices' attributes
        await self._refresh()

    def compute_domains(self) -> set[str]:
        """The ComputeDomains (UIDs) whose channel claims are prepared on this node."""
        return self.preparer.domains() if self.preparer is not None else set()

    def _dynamic(self, gpu: Gpu) -> bool:
        """Dynamic MIG on this GPU: every GPU instance on it belongs to a claim record of this driver."""
        assert self.preparer is not None
        return dynamic_mig_gpu(gpu, self.preparer.owned_instances().get(gpu.index, set()))

    def _shared(self, gpu: Gpu) -> bool:
        return gpu.index in self.shared_gpus

    async def on_inventory(self, inventory: Inventory) -> None:
        if self.monitor is not None:
            self.monitor.set_gpus(g.index for g in inventory.gpus)
        await self._set_inventory(inventory)  # withdrawn GPUs stay out until ``readvertise``

    def claims_on(self, gpu_indices: frozenset[int]) -> dict[int, tuple[ClaimRef, ...]]:
        """GPU index → the claims prepared on it (the checkpoint's record; nothing before ``start``)."""
        return self.preparer.claims_on(gpu_indices) if self.preparer is not None else {}

    async def withdraw(self, gpu_indices: Iterable[int]) -> None:
        """Leave these GPUs' devices out of the ResourceSlices (a MIG change on them) until ``readvertise``
        names them, whatever inventories come meanwhile; claims already prepared on them stay answered, new
        ones are refused (the kubelet retries) so that the MIG change's wait for its GPUs cannot be
        overtaken."""
        self._set_withdrawn(self._withdrawn | frozenset(gpu_indices))
        await self._refresh()

    async def readvertise(self, gpu_indices: Iterable[int]) -> None:
        """List these withdrawn GPUs' devices again, as the current inventory gives them."""
        gone = self._withdrawn & frozenset(gpu_indices)
        if not gone:
            return
        self._set_withdrawn(self._withdrawn - gone)
        if self._inventory is not None:
            await self._refresh()

    def _set_withdrawn(self, gpu_indices: frozenset[int]) -> None:
        """The withdrawn GPUs: left out of the slices, and no new claim prepared on them meanwhile."""
        self._withdrawn = gpu_indices
        if self.preparer is not None:
            self.preparer.withdrawn = gpu_indices | self._leaving | frozenset(self._held_out)

    async def hold_out(self, gpu_indices: Iterable[int], reason: str, effect: str = "NoSchedule") -> bool:
        """A remediation takes these GPUs out of service: where the API server keeps device taints their
        devices stay listed with the taint ``gpu.nodeagent.io/remediation`` (``effect`` NoSchedule, or
        NoExecute); otherwise they are left out of the slices (``withdraw``). No new claim is prepared on them
        either way. True when tainted."""
        from nodeagent.dra.slices import remediation_taint

        gpus = frozenset(gpu_indices)
        taint = remediation_taint(reason, effect)
        if not await asyncio.to_thread(self.publisher.device_taints):
            await self.withdraw(gpus)
            return False
        for g in gpus:
            self._held_out[g] = taint
        self._set_withdrawn(self._withdrawn)
        await self._refresh()
        return True

    async def offer_again(self, gpu_indices: Iterable[int]) -> None:
        """The end of ``hold_out``: the taint removed (or the devices listed again)."""
        gpus = frozenset(gpu_indices)
        tainted = gpus & frozenset(self._held_out)
        for g in tainted:
            del self._held_out[g]
        self._set_withdrawn(self._withdrawn)
        if tainted and self._inventory is not None:
            await self._refresh()
        await self.readvertise(gpus - tainted)

    async def set_gpus(self, served: frozenset[int], leaving: frozenset[int] = frozenset()) -> None:
        """Serve only these GPUs (a move between the planes): ``leaving`` ones stay known, so the claims
        prepared on them keep their answers, health and unprepare, but are out of the slices and take no
        new claim. The slices are written in the background (``wait_published``)."""
        self.gpu_filter = lambda gpu: gpu.index in served
        self._leaving = frozenset(leaving)
        self._set_withdrawn(self._withdrawn)
        if self._inventory is not None and self.preparer is not None:
            await self._set_inventory(self._inventory)

    async def set_vfio(self, devices: Sequence[DraDevice]) -> None:
        """The node's GPUs on a VFIO driver (``dra.devices.build_vfio_devices``; empty: none), published
        with the inventory's devices from now on."""
        self.vfio_devices = list(devices)
        if self._inventory is not None and self.preparer is not None:
            await self._set_inventory(self._inventory)

    async def set_foreign(self, gpu_indices: Iterable[int]) -> None:
        """The GPUs another DRA driver has (``nodeagent.adopt.detect.ForeignDraGpus``): left out of the
        ResourceSlices, so no GPU is offered twice; claims already prepared on them stay answered."""
        foreign = frozenset(gpu_indices)
        if foreign == self._foreign:
            return
        if foreign:
            log.warning("DRA: GPU(s) %s are another DRA driver's: left out of the ResourceSlices of %s",
                        ",".join(map(str, sorted(foreign))), self.node_name)
        self._foreign = foreign
        if self._inventory is not None:
            await self._refresh()

    async def set_health(self, unhealthy: Mapping[HealthKey, str]) -> None:
        """The health monitor's current unhealthy map (``HealthMonitor.unhealthy()``)."""
        self._unhealthy = dict(unhealthy)
        await self._refresh()

    async def _claims_changed(self) -> None:
        """A claim was prepared or unprepared: a fault on one GPU instance follows the devices holding
        instances now (a placement whose instance is gone is no longer hit by it)."""
        if self.on_claims_changed is not None:
            self.on_claims_changed()
        if any(gi is not None for _, gi in self._unhealthy):
            await self._refresh()

    async def _refresh(self) -> None:
        live = self.preparer.live_instances() if self.preparer is not None else {}
        bad = unhealthy_devices(self.devices, self._unhealthy, live)
        await self.feed.update([d.name for d in self.devices], bad)
        kept = [d for d in self.devices if d.gpu_index not in self._withdrawn | self._leaving | self._foreign]
        counters = build_counter_sets(kept, self._inventory) if self._inventory is not None else []
        held = {d.name: [self._held_out[d.gpu_index]] for d in kept if d.gpu_index in self._held_out}
        self._wanted = pool_content(kept, bad, counters, held)
        if self._wanted != self._published:
            self._dirty.set()

    def reverify(self) -> None:
        """Compare the pool with the API again soon (rewrite what is missing or changed)."""
        self.publisher.invalidate()
        self._dirty.set()

    def _schedule_verify(self) -> None:
        """The periodic comparison with the API as a scheduler job (on the loop: it touches asyncio objects)."""
        scheduler = self.scheduler
        if scheduler is None:
            from apscheduler.schedulers.asyncio import AsyncIOScheduler

            scheduler = self._own_scheduler = AsyncIOScheduler()
            scheduler.start()
        job = scheduler.add_job(self._verify, "interval", seconds=self.verify_interval_s,
                                id=f"dra-verify-{self.driver}", replace_existing=True, coalesce=True,
                                max_instances=1)
        self._verify_job = job.id

    async def _verify(self) -> None:
        self.reverify()

    def _unschedule_verify(self) -> None:
        scheduler = self._own_scheduler or self.scheduler
        if scheduler is not None and self._verify_job is not None:
            with contextlib.suppress(Exception):  # gone already (the daemon's scheduler shut down first)
                scheduler.remove_job(self._verify_job)
        self._verify_job = None
        if self._own_scheduler is not None:
            if self._own_scheduler.running:
                self._own_scheduler.shutdown(wait=False)
            self._own_scheduler = None

    async def _follow_health(self) -> None:
        assert self.health_source is not None
        async for unhealthy in self.health_source():
            await self.set_health(unhealthy)

    async def _publish_loop(self) -> None:
        backoff = Backoff(RETRY_MIN_S, RETRY_MAX_S, jitter=False)
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            wanted = self._wanted
            if wanted is None:
                continue
            try:
                await asyncio.to_thread(self.publisher.sync, wanted)
            except NodeAgentError as e:
                self.last_error = str(e)
                delay = backoff.next()
                log.warning("DRA ResourceSlices of %s not written (retry in %.1fs): %s",
                            self.node_name, delay, e)
                self.publisher.invalidate()
                await asyncio.sleep(delay)
                self._dirty.set()
                continue
            backoff.reset()
            self.last_error = ""
            async with self._synced:
                self._published = wanted
                self._synced.notify_all()

    async def wait_published(self, timeout: float = 10.0) -> int:
        """Wait until the current content is in the API; the pool generation."""
        async with self._synced:
            await within(self._synced.wait_for(lambda: self._published == self._wanted), timeout)
        return self.publisher.generation

    async def stop(self, *, withdraw_slices: bool = True) -> None:
        """Close the sockets and (by default) delete the pool's ResourceSlices. Prepared claims stay
        recorded: their containers keep running and a later start answers for them again."""
        try:
            if self.monitor is not None:
                await self.monitor.stop()
            self._unschedule_verify()
            await self.wait_status_written()
        finally:  # whatever failed above, the loops end and the kubelet's sockets close
            tasks, self._tasks = self._tasks, []
            await cancel_all(tasks, log)
            if self.server is not None:
                await self.server.stop()
                self.server = None
        if self.mps is not None:  # the daemons end with the agent; a restart starts them again
            await self.mps.stop()
        if withdraw_slices:
            try:
                await asyncio.to_thread(self.publisher.remove)
            except NodeAgentError as e:
                log.warning("DRA ResourceSlices of %s not withdrawn: %s", self.node_name, e)
        self._published = None
