"""Label-driven MIG reconfiguration as a daemon component (needs the API: the Node label is the input)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from nodeagent.daemon.components import close_quietly
from nodeagent.daemon.supervisor import Component, Context
from nodeagent.gpu.inventory import Inventory

log = logging.getLogger(__name__)


def reboot_host() -> None:
    import subprocess

    subprocess.run(["systemctl", "reboot"], check=False, timeout=60)


class MigComponent(Component):
    """Runs ``MigReconciler`` with the MIG files loaded by the pipeline at start / SIGHUP; withdraws and
    re-advertises through ``ctx.shared.device_plugin`` and counts into ``ctx.shared.metrics``."""

    name = "mig"

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        from nodeagent.kube.node import NodeClient
        from nodeagent.kube.podnames import CHECKPOINT_NAME, PodNameLookup
        from nodeagent.kube.podresources import PodResourcesClient
        from nodeagent.mig.reconciler import MigReconciler, MigReconcilerOptions, read_boot_id

        cfg = ctx.config.mig
        sources = ctx.files.mig  # the MIG config and hooks as validated with the config (start / SIGHUP)
        if sources is None or sources.configs is None:
            log.info("mig: %s does not exist; using the standard configs for these GPUs", cfg.config_file)
        proc = ctx.paths.proc
        # A busy-GPU refusal names namespace/pod: the kubelet's device checkpoint maps the process's pod UID
        # to devices, PodResources those devices to the pod (the channel opens only when a refusal asks).
        self.pod_resources = PodResourcesClient(ctx.host_path(ctx.config.kubelet.pod_resources()))
        checkpoint = ctx.host_path(ctx.config.kubelet.device_plugins) / CHECKPOINT_NAME
        link = ctx.shared.device_plugin

        async def holders(gpu_indices: frozenset[int]) -> Mapping[int, tuple[str, ...]]:
            return await self._holders(link.device_gpus(gpu_indices))

        self.reconciler = MigReconciler(
            NodeClient(ctx.kube, ctx.node_name, watches=ctx.node_watches),
            ctx.gpu,
            ctx.paths.mig_state_dir,
            publisher=ctx.shared.advertiser,
            options=MigReconcilerOptions(sources=sources, with_reboot=cfg.with_reboot,
                                         release_timeout_s=cfg.release_timeout),
            reboot=reboot_host,
            boot_id=lambda: read_boot_id(proc),
            proc_root=proc,
            on_inventory=self._after_apply,
            on_result=self._on_result,
            pod_name=PodNameLookup(checkpoint, self.pod_resources.list),
            holders=holders,
            on_state=self._on_state,
        )
        self._ctx = ctx
        self._no_kubelet_logged = False
        self._task: asyncio.Task[Any] | None = None

    def _on_state(self, state: str) -> None:
        """pending/rebooting reach the Node conditions as the reconciler writes them (results: on_result)."""
        if state in ("pending", "rebooting"):
            self._report(state)

    async def _holders(self, device_gpus: Mapping[tuple[str, str], int]) -> Mapping[int, tuple[str, ...]]:
        """The pods the kubelet's PodResources shows holding these devices, by GPU. No PodResources socket
        at all means no kubelet to ask (logged once): nothing to wait for; a socket that does not answer
        raises, and the reconciler keeps asking until its timeout."""
        from nodeagent.kube.podresources import holders_by_gpu

        if not device_gpus:
            return {}
        if not self.pod_resources.socket_path.exists():
            if not self._no_kubelet_logged:
                self._no_kubelet_logged = True
                log.warning("mig: no kubelet PodResources socket at %s: GPUs are changed without asking which "
                            "pods hold them (the NVML busy check still applies)", self.pod_resources.socket_path)
            return {}
        assignments = await asyncio.to_thread(self.pod_resources.list)
        return holders_by_gpu(assignments, device_gpus)

    def _on_result(self, state: str, seconds: float) -> None:
        """After each reconcile: counted into ``ctx.shared.metrics``, reported (state, config name, error)
        to ``ctx.shared.conditions``."""
        self._ctx.shared.metrics.observe_reconcile("mig", state, seconds)
        self._report(state)

    def _report(self, state: str) -> None:
        key = self.reconciler.last_key
        record = self.reconciler.state.load() or {}
        error = str(record.get("error") or "") if state == "failed" else ""
        self._ctx.shared.conditions.report_mig(state=state, config=key[0] if key else "", error=error)

    async def _after_apply(self, inventory: Inventory) -> None:
        self._ctx.request_resync()

    async def start(self, ctx: Context) -> None:
        (ctx.paths.mig_state_dir).mkdir(parents=True, exist_ok=True)
        self._task = ctx.spawn(self.reconciler.run(), "mig reconciler")

    async def resync(self) -> None:
        if self._task is not None and self._task.done():
            self._task = self._ctx.spawn(self.reconciler.run(), "mig reconciler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        close_quietly(self.pod_resources)
