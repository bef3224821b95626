"""Taking a node over without a fight, as a daemon component: the conflict detection at start and at every
resync, and with ``[adopt] gpu_operator = true`` the hand-over from NVIDIA's GPU Operator.

Each pass looks at the device-plugin directory (sockets not served by this process that answer the
device-plugin API; the kubelet's checkpoint) and, with the API, at the node's ResourceSlices, the Node's
managedFields and NFD's label ownership (``nodeagent.adopt.detect``). What it finds goes to the Node
condition GPUReady (the conflict's reason), the ``nodeagent_conflict`` metric (both through
``ctx.shared.conditions``) and one Warning Event per new conflict; a resource another device plugin serves
under another socket name is held back from registration (``ctx.shared.adoption``) until that plugin is gone.
The other plugin at nodeagent's own socket name is left alone by the device plugin itself (never replaced).

The hand-over switches the replaced operands off through the operator's ``nvidia.com/gpu.deploy.*`` labels,
holds every resource back until the operands' pods have left the node, then takes over: resources are served
and registered, a socket left at nodeagent's names is replaced. The driver operand stays.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nodeagent.daemon.supervisor import Component, Context
from nodeagent.errors import LabelValueError, NodeAgentError
from nodeagent.gpu.inventory import Inventory

if TYPE_CHECKING:
    from nodeagent.adopt.detect import Conflict, Requests
    from nodeagent.config import AgentConfig
    from nodeagent.kube.events import EventRecorder

log = logging.getLogger(__name__)

HANDOVER_POLL_S = 5.0
# How long the start waits for the first pass that reads the API (the GPU Operator's switch, other drivers)
# before the device plugin starts; an API that answers later is read in the background.
FIRST_API_PASS_S = 3.0
EVENT_REASON_HANDED_OVER = "GpuOperatorHandedOver"


class AdoptComponent(Component):
    name = "adopt"

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self._ctx = ctx
        self._events: EventRecorder | None = None
        if ctx.kube is not None:
            from nodeagent.kube.events import EventRecorder
            from nodeagent.kube.node import NodeClient

            self._events = EventRecorder(NodeClient(ctx.kube, ctx.node_name, watches=ctx.node_watches),
                                         enabled=ctx.config.publish.events)
        self._reported: set[tuple[str, str, str]] = set()  # conflicts an Event was recorded for (still there)
        self._lock = asyncio.Lock()
        self.handing_over = ctx.config.adopt.gpu_operator and ctx.kube is not None
        self.conflicts: list[Conflict] = []  # the last pass's
        self.unread: tuple[str, ...] = ()
        self.poll_s = HANDOVER_POLL_S
        self._looked_at: Inventory | None = None
        self._api_reads = 0  # reads of the API begun, and the number of the last one applied
        self._api_applied = 0
        from nodeagent.adopt.detect import ForeignDraGpus

        self.foreign_dra = ForeignDraGpus()  # GPUs another DRA driver has: out of nodeagent's slices

    async def start(self, ctx: Context) -> None:
        # before the device plugin starts (it comes after this component), so that a resource left to another
        # plugin is held back before it is ever served
        await self._look()
        if self.handing_over:
            ctx.spawn(self._hand_over(), "gpu operator hand-over")
        if ctx.kube is not None:
            ctx.spawn(self._follow_operator_switch(), "gpu operator switch")

    async def on_inventory(self, inventory: Inventory) -> None:
        if inventory is not self._looked_at:  # the start has just looked with this one
            await self._look()

    async def resync(self) -> None:
        await self._look()

    async def _look(self) -> None:
        """A pass over the device-plugin directory, then one that reads the API too, waited for at most
        ``FIRST_API_PASS_S``: an API that does not answer by then must not hold up the kubelet side (nor
        the other components), so its pass goes on in the background and applies what it reads when it
        comes."""
        self._looked_at = self._ctx.inventory
        await self.detect(api=False)
        if self._ctx.kube is None:
            return
        task = self._ctx.spawn(self.detect(), "conflict detection")
        done, _ = await asyncio.wait({task}, timeout=FIRST_API_PASS_S)
        if not done:
            log.info("conflict detection: no answer from the API within %.0f s; going on, the API is read in "
                     "the background", FIRST_API_PASS_S)

    async def reconfigure(self, old: AgentConfig, new: AgentConfig, changed: frozenset[str]) -> bool:
        """A move between the planes: what the device plugin serves is read from the ledger at each pass."""
        from nodeagent.daemon.planes import only_the_split_changed

        return only_the_split_changed(old, new, changed)

    # -- detection ---------------------------------------------------------------------------------------------
    def _wanted(self, inventory: Inventory) -> tuple[dict[str, str], dict[str, list[str]]]:
        """Resource name → the socket nodeagent serves it on, and → the device IDs it advertises (both empty
        when the device plugin is off)."""
        cfg = self._ctx.config
        if not cfg.device_plugin.enabled or cfg.device_plugin.plane == "dra":
            return {}, {}
        from nodeagent.deviceplugin.server import socket_name
        from nodeagent.sharing.devices import build_resources, resource_ids
        from nodeagent.sharing.spec import DEFAULT_CONFIG

        plugin = self._ctx.files.plugin_config or DEFAULT_CONFIG
        excluded = self._ctx.shared.planes.plugin_excluded(cfg.dra.gpus) if cfg.device_plugin.plane == "both" \
            else ()
        try:
            resources = build_resources(inventory, plugin, withdrawn=excluded)
        except NodeAgentError:
            return {}, {}
        return {n: socket_name(n) for n in resources}, resource_ids(resources)

    def _label_keys(self, inventory: Inventory) -> set[str]:
        from nodeagent.kube.labels import desired_labels, sharing_facts

        return set(desired_labels(inventory, sharing_facts(self._ctx.files.plugin_config)))

    async def detect(self, *, api: bool = True) -> None:
        """One pass: find the conflicts, report them, hold back what another plugin serves (``api`` False:
        the device-plugin directory only, the API's conflicts of the last pass kept). The API is read before
        the pass takes its lock, so a read that hangs holds up no other pass; a read that ends after a later
        one was applied counts as none."""
        from nodeagent.adopt import detect as d
        from nodeagent.dra import DRIVER_NAME

        inv = self._ctx.inventory
        if inv is None or not self._ctx.config.adopt.detect:
            return
        facts: d.KubeFacts | None = None
        read = 0
        if api and self._ctx.kube is not None:
            self._api_reads += 1
            read = self._api_reads
            facts = await asyncio.to_thread(d.read_kube_facts, self._ctx.kube, self._ctx.node_name)
        async with self._lock:
            if facts is not None and read < self._api_applied:
                facts, api = None, False  # stale: a later read was applied meanwhile
            inv = self._ctx.inventory or inv
            wanted, ids = self._wanted(inv)
            uuids = d.inventory_uuids(inv)
            directory = self._ctx.host_path(self._ctx.config.kubelet.device_plugins)
            me = os.getpid()
            local = await asyncio.to_thread(d.read_plugin_dir, directory, lambda pid: pid == me, 1.0, self._ctx.paths)
            found = d.plugin_conflicts(local.foreign, local.checkpoint, wanted, uuids, ids)
            unread: tuple[str, ...] = self.unread
            if facts is not None:
                self._api_applied = read
                keys = d.gpu_keys(inv)
                found += d.kube_conflicts(facts, our_driver=DRIVER_NAME, uuids=uuids,
                                          label_keys=self._label_keys(inv), keys=keys,
                                          through_nfd=self._ctx.config.publish.through_nodefeature)
                if facts.slices is not None:
                    await self._leave_foreign_gpus(facts.slices, keys)
                if facts.node is not None and not self.handing_over:
                    found += d.operator_conflicts(facts.node, wanted)
                unread = facts.unread
            elif not api:
                found += [c for c in self.conflicts if c.kind != "device-plugin"]
            if unread != self.unread and unread:
                log.info("conflict detection could not read: %s", "; ".join(unread))
            self.unread = unread
            self.conflicts = sorted(found)
            await self._report(self.conflicts)
            self._hold(wanted, self.conflicts)

    async def _leave_foreign_gpus(self, slices: tuple[Mapping[str, Any], ...], keys: dict[str, int]) -> None:
        """Keep the GPUs another DRA driver has out of nodeagent's ResourceSlices (none with ``[adopt]
        take_over``): those its slices list, and those a pod still uses through one of its claims."""
        from nodeagent.dra import DRIVER_NAME

        if self._ctx.config.adopt.take_over:
            await self._ctx.shared.dra.set_foreign(frozenset())
            return
        held = await asyncio.to_thread(self._claimed_devices) if self.foreign_dra.remembered else set()
        await self._ctx.shared.dra.set_foreign(self.foreign_dra.update(slices, DRIVER_NAME, keys, held))

    def _claimed_devices(self) -> set[tuple[str, str, str]] | None:
        """(driver, pool, device) of every device the pods of this node use through claims (the kubelet's
        PodResources); None when the kubelet cannot be asked."""
        from nodeagent.daemon.supervisor import close_quietly

        try:
            client = self._ctx.pod_resources_client()
        except (NodeAgentError, OSError):
            return None
        try:
            _, uses = client.list_with_claims()
            return {dev for u in uses for dev in u.devices}
        except (NodeAgentError, OSError):
            return None
        finally:
            close_quietly(client)

    async def _report(self, conflicts: list[Conflict]) -> None:
        from nodeagent.kube.conditions import ConflictInput

        self._ctx.shared.conditions.report_conflicts(tuple(
            ConflictInput(c.kind, c.subject, c.owner, c.reason, c.detail) for c in conflicts))
        keys = {c.key() for c in conflicts}
        for c in conflicts:
            if c.key() not in self._reported:
                log.warning("conflict: %s", c.detail)
                if self._events is not None:  # a blocking request: never holds up the pass (nor the start)
                    self._ctx.spawn(asyncio.to_thread(self._events.record, c.reason, c.detail, "Warning",
                                                      "DetectConflict"), "conflict event")
        for gone in self._reported - keys:
            log.info("conflict gone: %s %s (%s)", gone[0], gone[1], gone[2])
        self._reported = keys
        self._ctx.set_status(self.name, f"{len(conflicts)} conflict(s)" + (" (handing over)" if self.handing_over
                                                                             else ""))

    def _hold(self, wanted: dict[str, str], conflicts: list[Conflict]) -> None:
        if self.handing_over:
            why = "nodeagent waits until the GPU Operator's operands have left the node ([adopt] gpu_operator)"
            self._ctx.shared.adoption.hold({name: why for name in wanted})
            return
        operator = next((c for c in conflicts if c.kind == "gpu-operator"), None)
        if operator is not None:
            # the operator's device plugin is (or is about to be) deployed here, after a release for one: every
            # resource is left to it, whatever take_over says; nodeagent serves again once handed over
            self._ctx.shared.adoption.hold({name: operator.detail for name in wanted}, stop=True)
            return
        take_over = self._ctx.shared.adoption.take_over
        if take_over if take_over is not None else self._ctx.config.adopt.take_over:
            self._ctx.shared.adoption.hold({})
            return
        # another plugin at nodeagent's own socket name is left alone by the server itself; one under another
        # name would be replaced at the kubelet by our registration: held back here
        self._ctx.shared.adoption.hold({
            c.subject: c.detail for c in conflicts
            if c.kind == "device-plugin" and c.subject in wanted and c.owner != wanted[c.subject]})

    async def _follow_operator_switch(self) -> None:
        """A pass of detection as soon as the Node's GPU Operator switch or hand-over record changes (a release
        or a hand-over from an admin's shell), not only at the next resync."""
        from nodeagent import adopt as ad
        from nodeagent.adopt.detect import OPERATOR_DEVICE_PLUGIN
        from nodeagent.kube.node import NodeClient

        node = NodeClient(self._ctx.kube, self._ctx.node_name, watches=self._ctx.node_watches)
        last: tuple[str | None, str | None] | None = None
        async for view in node.updates():
            key = (view.labels.get(OPERATOR_DEVICE_PLUGIN), view.annotations.get(ad.HANDED_OVER))
            if last is not None and key != last:
                log.info("the Node's %s is %s now: looking for conflicts again", OPERATOR_DEVICE_PLUGIN,
                         key[0] if key[0] is not None else "unset")
                await self.detect()
            last = key

    # -- the hand-over from the GPU Operator -----------------------------------------------------------------
    async def _hand_over(self) -> None:
        from nodeagent import adopt as ad

        cfg, kube, node = self._ctx.config.adopt, self._ctx.kube, self._ctx.node_name
        refused = ""
        while True:
            try:
                switched = await asyncio.to_thread(ad.switch_off, kube, node, with_dcgm_exporter=cfg.dcgm_exporter)
                break
            except LabelValueError as e:  # the hand-over record on the Node is not one: said once, until it changes
                self._ctx.set_status(self.name, f"hand-over: {e}")
                if str(e) != refused:
                    log.warning("GPU Operator hand-over refused: %s", e)
                refused = str(e)
            except NodeAgentError as e:
                self._ctx.set_status(self.name, f"hand-over: {e}")
                log.warning("GPU Operator hand-over: the Node cannot be patched yet: %s", e)
            await asyncio.sleep(self.poll_s)
        if switched:
            log.info("GPU Operator hand-over: %s switched off on node %s", ", ".join(
                ad.DEPLOY_PREFIX + op + "=false" for op in switched), node)
        last: list[str] | None = None
        while True:
            try:
                left = await asyncio.to_thread(self._operand_pods, kube, node, cfg.dcgm_exporter)
            except NodeAgentError as e:
                left = [f"(pods cannot be listed: {e})"]
            if not left:
                break
            if left != last:
                log.info("GPU Operator hand-over: waiting for %s to leave node %s", ", ".join(left), node)
                self._ctx.set_status(self.name, f"handing over: waiting for {len(left)} operand pod(s)")
            last = left
            await asyncio.sleep(self.poll_s)
        self.handing_over = False
        self._ctx.shared.adoption.set_take_over(True)
        log.info("GPU Operator hand-over: the operands have left node %s; nodeagent serves", node)
        if self._events is not None:
            await asyncio.to_thread(self._events.record, EVENT_REASON_HANDED_OVER, "the GPU Operator's operands "
                                    f"({', '.join(ad.operands(cfg.dcgm_exporter))}) are switched off on this node; "
                                    "nodeagent serves its GPUs", "Normal", "Adopt")
        await self.detect()

    def _operand_pods(self, kube: Requests, node: str, dcgm_exporter: bool) -> list[str]:
        """The operands' pods still on the node: from the API, else (credentials that may not list pods) from
        the kubelet's PodResources API, which names every pod of this node."""
        from nodeagent import adopt as ad
        from nodeagent.daemon.supervisor import close_quietly
        from nodeagent.errors import KubeError

        try:
            return ad.operand_pods(kube, node, with_dcgm_exporter=dcgm_exporter)
        except KubeError as e:
            if e.status != 403:
                raise
        client = self._ctx.pod_resources_client()
        try:
            return ad.operand_pods_by_name(client.pods(), with_dcgm_exporter=dcgm_exporter)
        finally:
            close_quietly(client)

    async def stop(self) -> None:
        if self._events is not None:
            await asyncio.to_thread(self._events.close, 1.0)
