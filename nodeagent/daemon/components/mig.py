"""Label-driven MIG reconfiguration as a daemon component (needs the API: the Node label is the input)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from nodeagent import fileio
from nodeagent.daemon.components.fleetlink import fleet_gate
from nodeagent.daemon.shared import DevicePluginLink, DraLink, PreparedClaims
from nodeagent.daemon.supervisor import Component, Context, close_quietly
from nodeagent.gpu.inventory import Inventory

if TYPE_CHECKING:
    from nodeagent.dra.service import ClaimRef
    from nodeagent.kube.podresources import PodResourcesClient
    from nodeagent.mig.reconciler import Holder
    from nodeagent.sharing.spec import PluginConfig

log = logging.getLogger(__name__)

DeviceIds = Callable[[frozenset[int]], Mapping[tuple[str, str], int]]


def plugin_device_ids(plugin: DevicePluginLink, inventory: Inventory, plugin_config: PluginConfig | None,
                      gpu_indices: frozenset[int], *, excluded: Iterable[int] = ()) -> dict[tuple[str, str], int]:
    """(resource, device ID) → GPU index of these GPUs' device-plugin devices: what the running plugin
    gives, and what the plugin gives ``inventory`` by its resource naming — so a wait that starts before
    the plugin is attached (restoring an interrupted apply at start) still knows the IDs pods hold."""
    from nodeagent.errors import NodeAgentError
    from nodeagent.sharing.devices import device_gpus
    from nodeagent.sharing.spec import DEFAULT_CONFIG

    ids = dict(plugin.device_gpus(gpu_indices))
    try:
        ids.update(device_gpus(inventory, plugin_config or DEFAULT_CONFIG, gpu_indices, excluded=excluded))
    except NodeAgentError as e:  # the plugin refuses the same config: it serves nothing else either
        log.warning("mig: device IDs of GPU(s) %s not derived from the plugin config: %s",
                    ", ".join(map(str, sorted(gpu_indices))), e)
    return ids


class PlaneClaims:
    """The DRA plane's prepared claims as the MIG wait reads them (``PreparedClaims``). ``served()`` names
    the GPUs the plane is configured to serve (None: all of them). While it should serve some of the GPUs
    asked about but is not attached (not started yet, or being rebuilt by a reload), their claims are
    unknown: that raises, so the wait keeps asking and, if the plane stays away, ends ``failed`` rather
    than change a GPU a claim may be using."""

    def __init__(self, link: DraLink, served: Callable[[], frozenset[int] | None]) -> None:
        self.link = link
        self.served = served

    def claims_on(self, gpu_indices: frozenset[int]) -> dict[int, tuple[ClaimRef, ...]]:
        from nodeagent.errors import OperationError

        if not self.link.attached:
            served = self.served()
            unknown = gpu_indices if served is None else gpu_indices & served
            if unknown:
                raise OperationError("the DRA plane is not running: claims prepared on GPU(s) "
                                     f"{', '.join(map(str, sorted(unknown)))} are unknown")
        return self.link.claims_on(gpu_indices)


class GpuHolderSources:
    """The MIG reconciler's ``GpuHolders`` on a node: the pods the kubelet's PodResources shows holding
    the GPUs' device-plugin devices (``device_ids``: (resource, device ID) → GPU index, blocking), and
    the ResourceClaims prepared on them — the DRA plane's own record (``claims``) and the claims
    PodResources reports as dynamic resources of this driver's pool, with the pods using them.

    No PodResources socket at all means no kubelet to ask (logged once): only the DRA plane's record
    counts; a socket that does not answer raises, and the reconciler keeps asking until its timeout."""

    def __init__(self, pod_resources: PodResourcesClient, device_ids: DeviceIds, claims: PreparedClaims, *,
                 pool: str, driver: str, who: str = "mig") -> None:
        self.pod_resources = pod_resources
        self.device_ids = device_ids
        self.claims = claims
        self.pool = pool
        self.driver = driver
        self._no_kubelet_logged = False
        self.who = who  # the log lines' prefix: what waits for the holders

    async def __call__(self, gpu_indices: frozenset[int]) -> dict[int, tuple[Holder, ...]]:
        from nodeagent.dra.devices import device_gpu_index
        from nodeagent.kube.podresources import holders_by_gpu
        from nodeagent.mig.reconciler import ClaimHolder

        claims: dict[int, set[str]] = {}
        for gpu, refs in self.claims.claims_on(gpu_indices).items():
            if gpu in gpu_indices:
                claims.setdefault(gpu, set()).update(f"{r.namespace}/{r.name}" for r in refs)
        pods: Mapping[int, tuple[str, ...]] = {}
        claim_pods: dict[str, set[str]] = {}
        if self.pod_resources.socket_path.exists():
            device_gpus = await asyncio.to_thread(self.device_ids, gpu_indices)
            assignments, uses = await asyncio.to_thread(self.pod_resources.list_with_claims)
            pods = holders_by_gpu(assignments, device_gpus)
            for use in uses:
                claim_pods.setdefault(use.claim, set()).add(f"{use.namespace}/{use.pod}")
                for driver, pool, device in use.devices:
                    on = device_gpu_index(device) if driver == self.driver and pool == self.pool else None
                    if on is not None and on in gpu_indices:
                        claims.setdefault(on, set()).add(use.claim)
        elif not self._no_kubelet_logged:
            self._no_kubelet_logged = True
            log.warning("%s: no kubelet PodResources socket at %s: GPUs are changed without asking which "
                        "pods hold them (claims prepared by the DRA plane%s still apply)", self.who,
                        self.pod_resources.socket_path, " and the NVML busy check" if self.who == "mig" else "")
        out: dict[int, tuple[Holder, ...]] = {}
        for gpu in sorted(set(pods) | set(claims)):
            held = tuple(ClaimHolder(c, tuple(sorted(claim_pods.get(c, ())))) for c in sorted(claims.get(gpu, ())))
            out[gpu] = (*pods.get(gpu, ()), *held)
        return out


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
        from nodeagent.mig.reconciler import MigReconciler, MigReconcilerOptions, read_boot_id

        cfg = ctx.config.mig
        sources = ctx.files.mig  # the MIG config and hooks as validated with the config (start / SIGHUP)
        if sources is None or sources.configs is None:
            log.info("mig: %s does not exist; using the standard configs for these GPUs", cfg.config_file)
        proc = ctx.paths.proc
        # A busy-GPU refusal names namespace/pod: the kubelet's device checkpoint maps the process's pod UID
        # to devices, PodResources those devices to the pod (the channel opens only when a refusal asks).
        self.pod_resources = ctx.pod_resources_client()
        checkpoint = ctx.host_path(ctx.config.kubelet.device_plugins) / CHECKPOINT_NAME
        from nodeagent.dra import DRIVER_NAME

        claims = PlaneClaims(ctx.shared.dra, self._dra_gpus)
        holders = GpuHolderSources(self.pod_resources, self._device_ids, claims, pool=ctx.node_name,
                                   driver=DRIVER_NAME)
        node = NodeClient(ctx.kube, ctx.node_name, watches=ctx.node_watches)
        gate = fleet_gate(ctx, node)  # a change that empties GPUs waits for a slot of the fleet's budget
        self.reconciler = MigReconciler(
            node,
            ctx.gpu,
            ctx.paths.mig_state_dir,
            publisher=ctx.shared.advertiser,
            options=MigReconcilerOptions(sources=sources, with_reboot=cfg.with_reboot,
                                         release_timeout_s=cfg.release_timeout),
            reboot=reboot_host,
            boot_id=lambda: read_boot_id(proc, ctx.paths),
            proc_root=proc,
            on_inventory=self._after_apply,
            on_result=self._on_result,
            pod_name=PodNameLookup(checkpoint, self.pod_resources.list, root=ctx.paths),
            root=ctx.paths,
            holders=holders,
            on_state=self._on_state,
            gate=gate,
            changing=ctx.shared.gpu_changes.changing,
        )
        self._ctx = ctx
        self._task: asyncio.Task[Any] | None = None

    def _on_state(self, state: str) -> None:
        """pending/rebooting reach the Node conditions as the reconciler writes them (results: on_result)."""
        if state in ("pending", "rebooting"):
            self._report(state)

    def _dra_gpus(self) -> frozenset[int] | None:
        """The GPUs the DRA plane serves by the current config (None: all; empty: no DRA plane)."""
        cfg = self._ctx.config
        if cfg.device_plugin.plane == "device-plugin" or self._ctx.kube is None:
            return frozenset()
        if cfg.device_plugin.plane == "dra":
            return None
        split = self._ctx.shared.planes.split  # a GPU leaving DRA still has its claims there
        return split.dra_served if split is not None else frozenset(cfg.dra.gpus)

    def _device_ids(self, gpu_indices: frozenset[int]) -> dict[tuple[str, str], int]:
        dp = self._ctx.config.device_plugin
        plugin = self._ctx.shared.device_plugin
        if not dp.enabled or dp.plane == "dra":
            return plugin.device_gpus(gpu_indices)  # no device plugin: no pod holds a device-plugin ID
        split = self._ctx.shared.planes.split  # a GPU leaving the plugin still has the IDs it had there
        excluded = (split.dra if split is not None else self._ctx.config.dra.gpus) if dp.plane == "both" else ()
        return plugin_device_ids(plugin, self.reconciler.adapter.discover(), self._ctx.files.plugin_config,
                                 gpu_indices, excluded=excluded)

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
        fileio.makedirs(ctx.paths.mig_state_dir, root=ctx.paths)
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
