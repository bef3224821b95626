"""Prometheus exposition as a daemon component."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime, timezone
from typing import Any

from nodeagent.daemon.components.conditions import condition_snapshot
from nodeagent.daemon.supervisor import Component, Context, close_quietly
from nodeagent.errors import NodeAgentError

log = logging.getLogger(__name__)


class MetricsComponent(Component):
    """Prometheus exposition on the configured address (``metrics.address``: 127.0.0.1:9400 by default,
    "" = no listener; the component is then not built).

    GPU readings get pod/namespace/container from the kubelet PodResources API; the shared ``KubeClient``
    reports every API request to the agent's own counters while this component runs. An address that cannot
    be bound (port in use, address not on this host) is logged once as an error and the agent runs on
    without the listener; every resync tries again quietly and logs once when it listens.
    """

    name = "metrics"

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        from nodeagent.metrics import Metrics

        self.metrics = Metrics(ctx.node_name)
        self.pod_resources = ctx.pod_resources_client()
        self._assignments: list[Any] = []
        self._pod_resources_error = ""
        self._ctx = ctx
        self._server: Any = None
        self._bind_error = ""
        self._kube: Any = None
        self._seen_inputs: Any = None

    async def start(self, ctx: Context) -> None:
        self._bind()
        ctx.shared.metrics.attach(self.metrics)
        if ctx.kube is not None:
            self.metrics.attach_kube(ctx.kube)
            self._kube = ctx.kube
        ctx.scheduler.add_job(self.sample, "interval", seconds=ctx.config.metrics.interval, id="metrics",
                              replace_existing=True, coalesce=True, max_instances=1)
        # Health and state metrics follow a change of the condition inputs (an XID, a GPU lost or back, a MIG
        # apply, a containerd check) at once, not at the next tick.
        self._seen_inputs = ctx.shared.conditions.snapshot()
        ctx.shared.conditions.subscribe(self._on_conditions)
        await self.sample()

    def _on_conditions(self) -> None:
        inputs = self._ctx.shared.conditions.snapshot()
        if inputs == self._seen_inputs:
            return
        self._seen_inputs = inputs
        with contextlib.suppress(Exception):  # the job is gone while the component stops
            self._ctx.scheduler.modify_job("metrics", next_run_time=datetime.now(timezone.utc))

    def _bind(self) -> None:
        address = self._ctx.config.metrics.address
        try:
            self._server = self.metrics.serve(address)
        except OSError as e:
            why = e.strerror or str(e)
            if why != self._bind_error:
                log.error("metrics: cannot listen on %s: %s; running without the metrics endpoint "
                          "(retried at every resync; set [metrics] address to another HOST:PORT, "
                          "or \"\" for none)", address, why)
            self._bind_error = why
            self._ctx.set_status(self.name, f"cannot listen on {address}: {why}")
            return
        if self._bind_error:
            log.info("metrics: %s is free again", address)
        self._bind_error = ""
        log.info("metrics on http://%s/metrics", address)
        self._ctx.set_status(self.name, f"on {address}")

    async def resync(self) -> None:
        if self._server is None:
            self._bind()

    def _read_assignments(self) -> list[Any]:
        from nodeagent.errors import KubeletError

        try:
            self._assignments = list(self.pod_resources.list())
        except KubeletError as e:
            if str(e) != self._pod_resources_error:
                log.info("metrics without pod labels for now: %s", e)
            self._pod_resources_error = str(e)
            return self._assignments
        if self._pod_resources_error:
            log.info("PodResources answers again: metrics carry pod labels")
        self._pod_resources_error = ""
        return self._assignments

    def _health(self) -> dict[int, bool] | None:
        return self._ctx.shared.device_plugin.health() or None

    async def sample(self) -> None:
        inv = self._ctx.inventory
        read = self._ctx.gpu.metrics
        if inv is None:
            return

        def collect() -> tuple[dict[int, Any], list[Any]]:
            out: dict[int, Any] = {}
            for g in inv.gpus:
                with contextlib.suppress(NodeAgentError):
                    out[g.index] = read(g.index)
            return out, self._read_assignments()

        samples, assignments = await asyncio.to_thread(collect)
        self.metrics.update_gpus(inv, samples, assignments, self._health(),
                                 xids=self._ctx.shared.device_plugin.last_xids())
        plugin = self._ctx.shared.device_plugin
        self.metrics.update_state(condition_snapshot(self._ctx), plugin.registered(), plugin.allocations(),
                                  plugin.mps())

    async def stop(self) -> None:
        self._ctx.shared.conditions.unsubscribe(self._on_conditions)
        self._ctx.shared.metrics.detach(self.metrics)
        with contextlib.suppress(Exception):
            self._ctx.scheduler.remove_job("metrics")
        if self._kube is not None:
            self.metrics.detach_kube(self._kube)
            self._kube = None
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
            self._server = None
        close_quietly(self.pod_resources)
