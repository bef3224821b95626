"""Wiring of the real parts: the NVML adapter, the API client and the component specs of ``nodeagent run``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodeagent.agentrecord import AgentRecorder
from nodeagent.config import AgentConfig
from nodeagent.daemon.files import read_config_files
from nodeagent.daemon.supervisor import Component, ComponentSpec, Context, Daemon, GpuSource
from nodeagent.hostpaths import HostPaths
from nodeagent.sdnotify import Notifier

log = logging.getLogger(__name__)


def open_gpu(config: AgentConfig, paths: HostPaths) -> GpuSource:
    """The NVML adapter (real, or the simulator with ``simulate.machine``)."""
    from nodeagent.nvmlsource import open_nvml

    state = Path(config.simulate.state) if config.simulate.state else None
    adapter: GpuSource = open_nvml(config.simulate.machine or None, state, paths)
    return adapter


def open_kube(config: AgentConfig) -> Any:
    """The one ``KubeClient`` of the agent (kubeconfig, or the in-cluster service account)."""
    from nodeagent.kube.client import KubeClient, connect

    kubeconfig = Path(config.kubeconfig) if config.kubeconfig else None
    return KubeClient(connect(kubeconfig))


def default_specs() -> list[ComponentSpec]:
    """The real parts of the node, in start order: the CDI spec before anything names a device, then the
    device plugin (the others read it), the DRA plane right after it (with plane "both" it follows the
    plugin's health monitor)."""

    def cdi(ctx: Context) -> Component | None:
        from nodeagent.daemon.components.cdi import CdiComponent

        return CdiComponent(ctx) if ctx.config.cdi.enabled else None

    def device_plugin(ctx: Context) -> Component | None:
        from nodeagent.daemon.components.deviceplugin import DevicePluginComponent

        dp = ctx.config.device_plugin
        return DevicePluginComponent(ctx) if dp.enabled and dp.plane != "dra" else None

    def dra(ctx: Context) -> Component | None:
        from nodeagent.daemon.components.dra import DraLeftoversComponent, DraPlaneComponent

        if ctx.config.device_plugin.plane == "device-plugin":
            # no DRA driver: the slices an earlier run with DRA left for this node go
            return DraLeftoversComponent(ctx) if ctx.kube is not None else None
        if ctx.kube is None:
            log.warning("device_plugin.plane = %r needs the Kubernetes API (kube = false): the DRA driver "
                        "does not run", ctx.config.device_plugin.plane)
            return None
        return DraPlaneComponent(ctx)

    def mig(ctx: Context) -> Component | None:
        from nodeagent.daemon.components.mig import MigComponent

        if not ctx.config.mig.enabled or ctx.kube is None:
            return None
        return MigComponent(ctx)

    def switch(kind: str) -> Callable[[Context], Component | None]:
        def build(ctx: Context) -> Component | None:
            from nodeagent.daemon.components.switches import SwitchComponent

            enabled = ctx.config.vfio.enabled if kind == "vfio" else ctx.config.cc.enabled
            return SwitchComponent(ctx, kind) if enabled and ctx.kube is not None else None

        return build

    def publisher(ctx: Context) -> Component | None:
        from nodeagent.daemon.components.publisher import PublisherComponent

        p = ctx.config.publish
        if ctx.kube is None or not (p.labels or p.extended_resources or p.gpu_objects):
            return None
        return PublisherComponent(ctx)

    def metrics(ctx: Context) -> Component | None:
        from nodeagent.daemon.components.metrics import MetricsComponent

        return MetricsComponent(ctx) if ctx.config.metrics.address else None

    def runtime(ctx: Context) -> Component | None:
        from nodeagent.daemon.components.runtime import RuntimeCheckComponent

        return RuntimeCheckComponent(ctx) if ctx.config.runtime.enabled else None

    def adopt(ctx: Context) -> Component | None:
        from nodeagent.daemon.components.adopt import AdoptComponent

        a = ctx.config.adopt
        return AdoptComponent(ctx) if a.detect or (a.gpu_operator and ctx.kube is not None) else None

    def conditions(ctx: Context) -> Component | None:
        from nodeagent.daemon.components.conditions import ConditionsComponent

        return ConditionsComponent(ctx) if ctx.kube is not None else None

    def racks(ctx: Context) -> Component | None:
        from nodeagent.daemon.components.racks import RacksComponent

        return RacksComponent(ctx)

    def remediation(ctx: Context) -> Component | None:
        from nodeagent.daemon.components.remediation import RemediationComponent

        return RemediationComponent(ctx) if ctx.config.remediation.enabled and ctx.kube is not None else None

    return [
        ComponentSpec("cdi", frozenset({"cdi"}), cdi),
        # before the device plugin: its first look at the device-plugin directory decides what is held back
        # before anything registers
        ComponentSpec("adopt", frozenset({"adopt", "device_plugin", "dra", "kubelet", "publish"}), adopt),
        ComponentSpec("device-plugin", frozenset({"device_plugin", "dra", "kubelet", "health", "adopt"}),
                      device_plugin),
        ComponentSpec("dra", frozenset({"device_plugin", "dra", "kubelet", "health"}), dra),
        ComponentSpec("mig", frozenset({"mig"}), mig),
        ComponentSpec("vfio", frozenset({"vfio"}), switch("vfio")),
        ComponentSpec("cc", frozenset({"cc"}), switch("cc")),
        ComponentSpec("publisher", frozenset({"publish", "kubelet"}), publisher),
        ComponentSpec("metrics", frozenset({"metrics", "kubelet"}), metrics),
        ComponentSpec("runtime", frozenset({"runtime", "kubelet"}), runtime),
        ComponentSpec("conditions", frozenset({"publish"}), conditions),
        ComponentSpec("racks", frozenset({"imex", "publish"}), racks),
        # after the device plugin and the DRA plane: it listens to their health monitors
        ComponentSpec("remediation", frozenset({"remediation", "device_plugin", "dra", "health"}), remediation),
    ]


def build_daemon(
    config: AgentConfig,
    paths: HostPaths,
    *,
    reload_config: Callable[[], AgentConfig] | None = None,
    notifier: Notifier | None = None,
) -> Daemon:
    """The daemon ``nodeagent run`` runs: the real GPU source, API client and components."""
    return Daemon(
        config,
        paths,
        gpu_factory=open_gpu,
        kube_factory=open_kube,
        specs=default_specs(),
        reload_config=reload_config,
        notifier=notifier,
        read_files=read_config_files,
        recorder=AgentRecorder(paths),
    )
