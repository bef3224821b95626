"""The GPU Node conditions as a daemon component: built from what the other components report into
``ctx.shared.conditions`` and written to the own Node only when one of them changes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from nodeagent.daemon.supervisor import Component, Context
from nodeagent.deadline import within
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.inventory import Inventory

log = logging.getLogger(__name__)

SETTLE_S = 0.5
FIRST_PASS_WAIT_S = 5.0  # at start, how long the first write waits for the publisher's status values
PENDING_S = 2.0  # a MIG apply shows as pending only when it takes longer than this (most take less)


async def report_gpu_health(ctx: Context, service: Any) -> None:
    """Report the device plugin service's health monitor state (faults, last XIDs, the driver's recovery
    actions) into ``ctx.shared.conditions``."""
    from nodeagent.gpu.ports import RECOVERY_NONE, recovery_action_name
    from nodeagent.kube.conditions import GpuFault, GpuHealthInput

    inv = ctx.inventory
    if inv is None:
        return
    monitor = service.monitor
    if monitor is None or not monitor.settings.enabled:
        ctx.shared.conditions.report_health(GpuHealthInput(len(inv.gpus), (), monitored=False))
        return
    faults: dict[tuple[int, int | None], str] = monitor.unhealthy()
    xids: dict[int, int] = service.last_xids()
    uuids = {g.index: g.uuid for g in inv.gpus}
    gpu = ctx.gpu

    def recovery(index: int) -> str | None:
        try:
            action = int(gpu.recovery_action(index))
        except Exception:  # a lost GPU answers nothing: its fault says "lost" already
            return None
        return None if action == RECOVERY_NONE else recovery_action_name(action)

    indices = sorted({k[0] for k in faults})
    actions = await asyncio.to_thread(lambda: {i: recovery(i) for i in indices})
    out = tuple(
        GpuFault(index=idx, uuid=uuids.get(idx, ""), xid=xids.get(idx), recovery=actions.get(idx),
                 lost=reason.startswith("GPU lost"), gi_id=gi)
        for (idx, gi), reason in sorted(faults.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1))
    )
    ctx.shared.conditions.report_health(GpuHealthInput(len(inv.gpus), out))


def condition_snapshot(ctx: Context) -> Any:
    """The inputs reported into ``ctx.shared.conditions``, with what the config switches off marked as off
    (a ``ConditionSnapshot``: what the Node conditions and the state metrics are built from)."""
    cfg = ctx.config
    s = ctx.shared.conditions.snapshot()
    mig = s.mig if cfg.mig.enabled else dataclasses.replace(s.mig, enabled=False)
    runtime = dataclasses.replace(s.runtime, check_enabled=cfg.runtime.enabled, cdi_enabled=cfg.cdi.enabled)
    health = s.health
    inv = ctx.inventory
    if health is None and inv is not None and not cfg.device_plugin.enabled:
        from nodeagent.kube.conditions import GpuHealthInput

        health = GpuHealthInput(len(inv.gpus), (), monitored=False)
    fabric = None
    if inv is not None:
        from nodeagent.gpu.fabric import decide

        fabric = decide(inv)
    # [imex] off (perhaps turned off by a reload): no IMEX condition, and one written before goes
    imex = s.imex if cfg.imex.enabled else None
    return dataclasses.replace(s, health=health, mig=mig, runtime=runtime, fabric=fabric, imex=imex,
                               imex_off=not cfg.imex.enabled)


class ConditionsComponent(Component):
    """Writes ``nodeagent.io/GPUReady``, ``GPUHealthy``, ``MIGConfigured`` and ``RuntimeReady`` in its own
    task whenever a report changes them (and checks at every resync, which writes nothing when nothing
    changed). The status values the publisher stages in ``ctx.shared.node_status`` go out in the same
    patch; at start the first write waits (bounded) for the publisher's first pass so both are one write."""

    name = "conditions"

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        from nodeagent.kube.conditions import ConditionWriter
        from nodeagent.kube.node import NodeClient

        self.writer = ConditionWriter(NodeClient(ctx.kube, ctx.node_name, watches=ctx.node_watches),
                                      stage=ctx.shared.node_status)
        self._ctx = ctx
        self._wanted = asyncio.Event()  # a write pass is due
        self._changed = asyncio.Event()  # an input changed (the waits inside a pass look again)
        self._task: asyncio.Task[Any] | None = None
        self._watch: Any = None
        self._staged: Callable[[], None] | None = None
        self._passed: Callable[[], None] | None = None
        self.last_error = ""

    def _wake(self) -> None:
        self._wanted.set()
        self._changed.set()

    async def start(self, ctx: Context) -> None:
        ctx.shared.conditions.subscribe(self._wake)
        loop = asyncio.get_running_loop()

        def staged() -> None:  # called from the publisher's worker thread
            with contextlib.suppress(RuntimeError):  # the loop is gone while the daemon stops
                loop.call_soon_threadsafe(self._wake)

        def passed() -> None:  # the publisher finished a pass (staged or not)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._changed.set)

        self._staged, self._passed = staged, passed
        ctx.shared.node_status.subscribe(staged)
        ctx.shared.node_status.subscribe_passes(passed)
        self._task = ctx.spawn(self._worker(), "conditions")
        self._wanted.set()
        # the one shared watch of the own Node: conditions somebody changed or removed are written again

        def on_node(view: Any) -> None:
            if self.writer.observe(view):
                loop.call_soon_threadsafe(self._wanted.set)

        self._watch = await asyncio.to_thread(self.writer.node.watch, on_node)

    async def on_inventory(self, inventory: Inventory) -> None:
        self._wanted.set()

    async def resync(self) -> None:
        self._wanted.set()

    def snapshot(self) -> Any:
        """The reported inputs, with what the config switches off marked as off."""
        return condition_snapshot(self._ctx)

    async def _worker(self) -> None:
        while True:
            await self._wanted.wait()
            await asyncio.sleep(SETTLE_S)  # reports arriving together (start, a MIG apply) make one write
            await self._until(self._mig_not_pending, PENDING_S)
            await self._until(self._publisher_passed, FIRST_PASS_WAIT_S)  # start: its values in this write
            self._wanted.clear()
            carried = self.writer.fields_written
            try:
                await asyncio.to_thread(self.writer.sync, self.snapshot())
            except NodeAgentError as e:
                if str(e) != self.last_error:
                    log.warning("node conditions not written (retried at the next resync): %s", e)
                self.last_error = str(e)
                self.writer.forget()
                self._ctx.set_status(self.name, "API unreachable")
                continue
            if self.writer.fields_written != carried:
                # the publisher's staged status values, written here: counted as its status write
                self._ctx.shared.metrics.count_publish({"status": 1})
            if self.last_error:
                log.info("node conditions are written again")
            self.last_error = ""
            self._ctx.set_status(self.name, f"{self.writer.writes} write(s)")

    def _mig_not_pending(self) -> bool:
        return self._ctx.shared.conditions.mig.state != "pending"

    def _publisher_passed(self) -> bool:
        stage = self._ctx.shared.node_status
        return not stage.expected or stage.passes > 0

    async def _until(self, ready: Callable[[], bool], timeout: float) -> None:
        """Return once ``ready()`` holds, or after ``timeout`` seconds; looked at again whenever an input
        changes (a report, a staged value, a publisher pass)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not ready():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await within(self._changed.wait(), remaining)

    async def stop(self) -> None:
        self._ctx.shared.conditions.unsubscribe(self._wake)
        for listener in (self._staged, self._passed):
            if listener is not None:
                self._ctx.shared.node_status.unsubscribe(listener)
        self._staged = self._passed = None
        if self._watch is not None:
            await asyncio.to_thread(self._watch.stop)
            self._watch = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
