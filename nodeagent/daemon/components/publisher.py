"""Labels, unserved extended resources and GPU objects on the own Node, as a daemon component."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from nodeagent.daemon.supervisor import Component, Context, close_quietly
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.inventory import Inventory

log = logging.getLogger(__name__)

EVENTS_CLOSE_TIMEOUT = 1.0  # of the daemon's STOP_TIMEOUT, what the Event retry thread gets to end


class PublisherComponent(Component):
    """Publishes in its own task (never blocks the loop) what the inventory and ``ctx.shared.device_plugin``
    (served resources, plugin config, health) say; counts its writes into ``ctx.shared.metrics``. Its Node
    status values go to ``ctx.shared.node_status``: the conditions component writes them with the
    conditions, in one status patch."""

    name = "publisher"

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        from nodeagent.kube.publisher import NodePublisher

        self.pod_resources = ctx.pod_resources_client()
        self.publisher = NodePublisher(
            ctx.kube,
            ctx.node_name,
            ctx.config.publish,
            paths=ctx.paths,
            pod_resources=self.pod_resources,
            watches=ctx.node_watches,
            # the conditions component (it runs wherever the API does) writes these with the conditions
            status_stage=ctx.shared.node_status,
        )
        ctx.shared.node_status.expect()
        self._ctx = ctx
        self._wanted = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None
        self.passes = 0
        self.last_error = ""

    async def start(self, ctx: Context) -> None:
        self._task = ctx.spawn(self._worker(), "publisher")
        self._wanted.set()

    async def on_inventory(self, inventory: Inventory) -> None:
        self._wanted.set()

    async def resync(self) -> None:
        self._wanted.set()

    async def _worker(self) -> None:
        watching = False
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            inv = self._ctx.inventory
            if inv is None:
                continue
            dp = self._ctx.shared.device_plugin.snapshot()
            try:
                try:
                    res = await self.publisher.apublish(inv, dp.served, dp.plugin_config,
                                                        health=dp.health or None)
                finally:
                    self._ctx.shared.node_status.pass_done()
                if not watching:
                    await asyncio.to_thread(self.publisher.start_watch)
                    watching = True
            except NodeAgentError as e:
                if str(e) != self.last_error:
                    log.warning("publishing to node %s failed (retried at the next resync): %s",
                                self._ctx.node_name, e)
                self.last_error = str(e)
                self._ctx.set_status(self.name, "API unreachable")
                continue
            self.passes += 1
            if self.last_error:
                log.info("publishing to node %s works again", self._ctx.node_name)
            self.last_error = ""
            self._ctx.set_status(self.name, "published")
            if res.writes:
                log.info("published to node %s: %d write(s)", self._ctx.node_name, res.writes)
                self._ctx.shared.metrics.count_publish(res.by_target())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await asyncio.to_thread(self.publisher.close)
        # the Event recorder goes with its publisher (a reload builds a new one): its retry thread ends and
        # what the API never took is logged as lost
        await asyncio.to_thread(self.publisher.events.close, EVENTS_CLOSE_TIMEOUT)
        close_quietly(self.pod_resources)
