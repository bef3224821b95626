"""NVLink racks as a daemon component: the clique's Event, the IMEX channel devices and the host-managed
``nvidia-imex`` (``[imex]``), fed by the one Inventory.

At every inventory the clique decision (``gpu.fabric``) is made again; when the label becomes withheld, or
withheld for another reason, one Warning Event says why (the publisher withholds the label, the conditions
component writes ``NVLinkCliqueReady``). With ``[imex] enabled`` the channels of ``[imex] channels`` are made
under ``/dev`` with their CDI spec, and the daemon's peers are the InternalIPs of the Nodes that carry the same
clique label (looked up at every inventory and resync); no clique, no daemon. Its readiness goes to the
``IMEXReady`` condition and the ``nodeagent.io/imex.ready`` label. With ``[imex]`` off the label is retired as the
condition is: the own Node is read once and a label found there is removed (one write, none when it is absent).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import yaml

from nodeagent import fileio
from nodeagent.daemon.supervisor import Component, Context
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.fabric import CLIQUE_LABEL, CliqueDecision, decide
from nodeagent.gpu.inventory import Inventory

log = logging.getLogger(__name__)

IMEX_READY_LABEL = "nodeagent.io/imex.ready"


def imex_label_change(enabled: bool, ready: bool, on_node: str | None) -> dict[str, str | None]:
    """The label patch that brings ``nodeagent.io/imex.ready`` from ``on_node`` (its value on the Node, None when
    absent) to what it should be: ``true``/``false`` while ``[imex]`` is on, absent when it is off; ``{}`` when
    it already is."""
    want = ("true" if ready else "false") if enabled else None
    return {} if want == on_node else {IMEX_READY_LABEL: want}


class RacksComponent(Component):
    name = "racks"

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self._ctx = ctx
        self._last: CliqueDecision | None = None
        self._supervisor: Any = None
        self._label: str | None = None  # the label's value on the Node, as last written or read
        self._label_known = False  # whether ``_label`` is known (None then means absent)
        self._clique: str | None = None  # the clique the daemon runs for
        self._lock = asyncio.Lock()

    async def start(self, ctx: Context) -> None:
        cfg = ctx.config.imex
        if not cfg.enabled:
            return
        from nodeagent.imex import channels

        try:
            made = await asyncio.to_thread(channels.ensure_channels, ctx.paths, cfg.channels)
            spec = channels.cdi_spec(made)
            if spec is not None:
                target = ctx.paths(channels.SPEC_PATH)
                fileio.makedirs(target.parent, root=ctx.paths)
                fileio.atomic_write(ctx.paths.within(target), yaml.safe_dump(spec, sort_keys=False), mode=0o644,
                                    backup=False)
            ctx.set_status(self.name, f"IMEX channels {', '.join(str(c.number) for c in made)} made")
        except NodeAgentError as e:
            log.error("IMEX channels: %s", e)
            ctx.set_status(self.name, f"IMEX channels not made: {e}")

    async def on_inventory(self, inventory: Inventory) -> None:
        d = decide(inventory)
        last, self._last = self._last, d
        if d.withheld and (last is None or last.reason != d.reason or not last.withheld):
            await self._event(d)
        if self._ctx.config.imex.enabled:
            await self._membership(d)
        else:
            await self._retire_label()

    async def resync(self) -> None:
        if not self._ctx.config.imex.enabled:
            await self._retire_label()
        elif self._last is not None:
            await self._membership(self._last)

    async def _retire_label(self) -> None:
        """``[imex]`` off: remove ``nodeagent.io/imex.ready`` if a former configuration left it on the Node. The
        Node is read once per component (a reload that turns ``[imex]`` off makes a new one); after that nothing
        is sent."""
        ctx = self._ctx
        if ctx.kube is None or not ctx.config.publish.labels or (self._label_known and self._label is None):
            return
        from nodeagent.kube.node import NodeClient

        node = NodeClient(ctx.kube, ctx.node_name)
        try:
            if not self._label_known:
                self._label = (await node.aget()).labels.get(IMEX_READY_LABEL)
                self._label_known = True
            change = imex_label_change(False, False, self._label)
            if change:
                await node.apatch_labels(change)
                log.info("node %s: label %s removed ([imex] is off)", ctx.node_name, IMEX_READY_LABEL)
            self._label = None
        except NodeAgentError as e:
            log.warning("label %s not removed: %s", IMEX_READY_LABEL, e)

    async def _event(self, d: CliqueDecision) -> None:
        ctx = self._ctx
        if ctx.kube is None or not ctx.config.publish.events or d.reason is None:
            return
        from nodeagent.kube.node import NodeClient

        try:
            await NodeClient(ctx.kube, ctx.node_name).acreate_event(
                d.reason.value, f"{CLIQUE_LABEL} withheld: {d.message}"[:1000], type="Warning")
        except NodeAgentError as e:
            log.warning("clique event not recorded: %s", e)

    async def _peers(self, clique: str) -> tuple[str | None, dict[str, str | None]]:
        """This node's address and the clique's Nodes (name → InternalIP)."""
        ctx = self._ctx
        own = ctx.config.imex.address or None
        if ctx.kube is None:
            return own, {}
        from nodeagent.kube.node import internal_ips

        try:
            nodes = internal_ips(await asyncio.to_thread(ctx.kube.list_nodes,
                                                         label_selector=f"{CLIQUE_LABEL}={clique}"))
            if own is None:
                own_node = await asyncio.to_thread(ctx.kube.request, "GET", f"/api/v1/nodes/{ctx.node_name}",
                                                   action="get own Node")
                own = internal_ips([own_node]).get(ctx.node_name)
        except NodeAgentError as e:
            log.warning("IMEX peers not known: %s", e)
            raise
        return own, nodes

    async def _membership(self, d: CliqueDecision) -> None:
        from nodeagent.imex.daemonconfig import DaemonSettings, clique_members

        async with self._lock:
            ctx = self._ctx
            self._clique = d.value
            if d.value is None:
                if self._supervisor is not None:
                    await self._supervisor.set_peers([])
                await self._report(None)
                return
            try:
                own, nodes = await self._peers(d.value)
            except NodeAgentError:
                return
            if own is None:
                ctx.set_status(self.name, "IMEX: the Node has no InternalIP and [imex] address is not set")
                return
            if self._supervisor is None:
                from nodeagent.imex.supervisor import ImexSupervisor

                cfg = ctx.config.imex
                settings = DaemonSettings(bind_ip=own, server_port=cfg.server_port, cmd_port=cfg.cmd_port)
                self._supervisor = ImexSupervisor.for_node(
                    ctx.paths, settings, simulate=bool(ctx.config.simulate.machine),
                    driver_root=ctx.config.cdi.driver_root, on_change=lambda: self._report(self._clique))
            await self._supervisor.set_peers(clique_members(nodes, ctx.node_name, own))

    async def _report(self, clique: str | None) -> None:
        from nodeagent.kube.conditions import ImexInput

        ctx = self._ctx
        sup = self._supervisor
        state = sup.state if sup is not None else None
        imex = ImexInput(running=state is not None and state.pid is not None,
                         ready=bool(state and state.ready), peers=len(state.peers) if state else 0,
                         answer=state.answer if state else "", clique=clique)
        ctx.shared.conditions.report_imex(imex)
        # not known yet (a new component): written once, as before
        change = imex_label_change(True, imex.ready, self._label if self._label_known else None)
        if ctx.kube is not None and ctx.config.publish.labels and (change or not self._label_known):
            from nodeagent.kube.node import NodeClient

            label = "true" if imex.ready else "false"
            try:
                await NodeClient(ctx.kube, ctx.node_name).apatch_labels({IMEX_READY_LABEL: label})
                self._label, self._label_known = label, True
            except NodeAgentError as e:
                log.warning("label %s not written: %s", IMEX_READY_LABEL, e)

    async def stop(self) -> None:
        if self._supervisor is not None:
            await self._supervisor.stop()
            self._supervisor = None
