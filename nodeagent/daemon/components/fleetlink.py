"""The fleet's disruption budget (``[mig] fleet_namespace``, docs/fleet.md) for every change of the daemon that
takes GPUs out of service: the MIG change, a GPU's remediation and the label-driven node switches (workload
config, CC mode). Each component gets a gate of its own (a gate holds at most one slot at a time); the two
adapters below give the remediation pipeline and the switches the slot in the shape their protocols ask for."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nodeagent.daemon.supervisor import Context
    from nodeagent.fleet.gate import FleetGate
    from nodeagent.kube.node import NodeClient


def fleet_gate(ctx: Context, node: NodeClient) -> FleetGate | None:
    """A gate on the fleet's budget for this node, None when no budget is attached (every change goes)."""
    namespace = ctx.config.mig.fleet_namespace
    if not namespace or ctx.kube is None:
        return None
    from nodeagent.fleet.gate import FleetGate
    from nodeagent.fleet.leases import FleetApi
    from nodeagent.fleet.report import NodeReporter, node_labels

    return FleetGate(FleetApi(ctx.kube, namespace), ctx.node_name, lambda: node_labels(node),
                     reporter=NodeReporter(node), node_pods=lambda: runtime_pods(ctx))


async def runtime_pods(ctx: Context) -> list[tuple[str, Mapping[str, str]]]:
    """The node's running pods with their labels, from containerd's CRI (a pool's ``blockingPods``): the
    agent's token may not list pods, and needs not."""
    import asyncio

    from nodeagent.runtime.cri import running_pods
    from nodeagent.runtime.restart import DEFAULT_SOCKET

    pods = await asyncio.to_thread(running_pods, ctx.paths.within(ctx.paths(DEFAULT_SOCKET)))
    return [(str(p), p.labels) for p in pods]


class RemediationSlots:
    """``remediation.gate.DisruptionGate`` on a fleet gate: a GPU's reset holds one slot of the node's pool."""

    def __init__(self, gate: FleetGate) -> None:
        self.gate = gate

    @contextlib.asynccontextmanager
    async def slot(self, reason: str) -> AsyncIterator[None]:
        async with self.gate.slot(reason, rollout="remediation"):
            yield


class SwitchSlots:
    """``labelswitch.DisruptionBudget`` on a fleet gate: ``acquire`` takes the slot for ``action``,
    ``release`` gives it back (the switches call the two around their change)."""

    def __init__(self, gate: FleetGate) -> None:
        self.gate = gate
        self._held: dict[str, contextlib.AsyncExitStack] = {}

    async def acquire(self, action: str) -> None:
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self.gate.slot(action, rollout=action))
        self._held[action] = stack

    async def release(self, action: str) -> None:
        stack = self._held.pop(action, None)
        if stack is not None:
            await stack.aclose()
