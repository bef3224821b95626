"""How a node's agent says where it stands with the fleet's budget: the Node condition ``GpuChangeSlot``
(its message is the reason) and Events (one when the node starts waiting, one when the brake stops it)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from datetime import datetime, timezone

from nodeagent.errors import NodeAgentError
from nodeagent.fleet.leases import FleetApi
from nodeagent.kube.node import NodeClient

log = logging.getLogger(__name__)

CONDITION = "GpuChangeSlot"


class NodeReporter:
    """``gate.Reporter`` on the own Node. A write that fails is logged, never raised: the wait goes on."""

    def __init__(self, node: NodeClient) -> None:
        self.node = node
        self.waited = False

    async def _condition(self, status: str, reason: str, message: str) -> None:
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        cond = {"type": CONDITION, "status": status, "reason": reason, "message": message[:1000],
                "lastHeartbeatTime": now, "lastTransitionTime": now}
        try:
            await asyncio.to_thread(self.node.patch_status_conditions, [cond])
        except NodeAgentError as e:
            log.warning("fleet: could not set condition %s: %s", CONDITION, e)

    async def _event(self, reason: str, message: str, type_: str) -> None:
        try:
            await asyncio.to_thread(self.node.create_event, reason, message, type_)
        except NodeAgentError as e:
            log.warning("fleet: could not record event %s: %s", reason, e)

    async def waiting(self, reason: str, first: bool) -> None:
        log.info("fleet: waiting for a slot: %s", reason)
        self.waited = True
        brake = "brake" in reason.split(";")[0]
        await self._condition("False", "BrakeOn" if brake else "WaitingForSlot", f"waiting: {reason}")
        if first or brake:
            await self._event("GpuChangeWaiting", f"a GPU change waits for a slot: {reason}",
                              "Warning" if brake else "Normal")

    async def holding(self, slot: str) -> None:
        log.info("fleet: holding slot %s", slot)
        if self.waited:  # a node that never waited has nothing to take back
            await self._condition("True", "SlotHeld", f"changing, holding slot {slot}")

    async def released(self, failed: str | None) -> None:
        if failed is not None:
            await self._condition("False", "ChangeFailed", f"failed: {failed}")
        elif self.waited:
            await self._condition("False", "Done", "the change is done; the slot was given back")
        self.waited = False


async def node_labels(node: NodeClient) -> Mapping[str, str]:
    return (await node.aget()).labels


__all__ = ["CONDITION", "FleetApi", "NodeReporter", "node_labels"]
