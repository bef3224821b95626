"""One-shot node preparation for provisioning pipelines and image builds, with a JSON report.

    discover → MIG config (optional) → containerd runtime (+ leak guard) → restart containerd if changed
             → RuntimeClass and node labels (only when the API answers)
             → a Node Event when the runtime step changed or failed (API answers, Node registered)

Each step returns a ``StepResult`` (changed / unchanged / skipped / failed, with a reason). Steps are
idempotent, so a second run reports no changes. A failed step stops the steps that depend on it
(nothing is restarted after a failed write) but the report always lists every step. Exit code: 0 all
good, 1 a step failed, 2 bad input (config, unknown MIG config name), 3 a reboot is needed.
The real parts are reached through ``BootstrapParts``; tests and image builds inject their own.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent.config import AgentConfig
from nodeagent.errors import NodeAgentError, RebootRequired
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths

log = logging.getLogger(__name__)


class Outcome(str, enum.Enum):  # enum.StrEnum from Python 3.11 on
    CHANGED = "changed"
    UNCHANGED = "unchanged"
    SKIPPED = "skipped"
    FAILED = "failed"
    REBOOT_REQUIRED = "reboot-required"

    def __str__(self) -> str:  # as StrEnum: the value (also what format() and f-strings give)
        return self.value


@dataclass(frozen=True)
class StepResult:
    outcome: Outcome
    reason: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepReport:
    name: str
    outcome: Outcome
    reason: str
    seconds: float
    details: Mapping[str, Any]
    exit_code: int = 0  # the error's exit code when failed

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.name, "result": self.outcome.value,
                             "seconds": round(self.seconds, 3)}
        if self.reason:
            d["reason"] = self.reason
        if self.details:
            d["details"] = dict(self.details)
        return d


@dataclass(frozen=True)
class Report:
    steps: tuple[StepReport, ...]
    events: tuple[str, ...] = ()  # reasons of the Node Events recorded (e.g. RuntimeConfigured)

    @property
    def changed(self) -> bool:
        return any(s.outcome is Outcome.CHANGED for s in self.steps)

    @property
    def exit_code(self) -> int:
        codes = [s.exit_code for s in self.steps if s.outcome is Outcome.FAILED]
        if 2 in codes:
            return 2
        if codes:
            return 1
        if any(s.outcome is Outcome.REBOOT_REQUIRED for s in self.steps):
            return 3
        return 0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"changed": self.changed, "exit_code": self.exit_code,
                             "steps": [s.to_dict() for s in self.steps]}
        if self.events:
            d["events"] = list(self.events)
        return d


@dataclass(frozen=True)
class Options:
    mig_config: str | None = None  # a name from the MIG config file; None = leave MIG alone
    restart_containerd: bool = True  # False for image builds (nothing runs under --root)
    restart_off: str = "--no-restart"  # why, when restart_containerd is False
    kube: bool = True  # try RuntimeClass and labels when the API answers


@dataclass
class BootstrapParts:
    """The real operations behind each step; every one is replaceable."""

    discover: Callable[[AgentConfig, HostPaths], Inventory]
    apply_mig: Callable[[AgentConfig, HostPaths, Inventory, str], StepResult]
    configure_runtime: Callable[[AgentConfig, HostPaths], StepResult]
    restart_containerd: Callable[[AgentConfig, HostPaths], StepResult]
    ensure_runtimeclass: Callable[[Any, AgentConfig], StepResult]
    publish_labels: Callable[[Any, AgentConfig, HostPaths, Inventory], StepResult]
    connect: Callable[[AgentConfig, HostPaths], Any]  # a KubeClient that answered, or raises
    # (kube, config, component, message, ok) -> reason of the Event recorded on the Node, or None
    record_event: Callable[[Any, AgentConfig, str, str, bool], str | None] | None = None
    # the node's CDI spec for the inventory (None: no CDI step)
    write_cdi: Callable[[AgentConfig, HostPaths, Inventory], StepResult] | None = None
    # (config, paths, containerd files of the runtime step) -> why the running containerd has not loaded
    # them (one was written after it started), or None: an earlier run whose restart failed is finished here
    containerd_behind: Callable[[AgentConfig, HostPaths, list[str]], str | None] | None = None


def bootstrap(config: AgentConfig, paths: HostPaths, options: Options, parts: BootstrapParts) -> Report:
    reports: list[StepReport] = []
    events: list[str] = []

    def step(name: str, fn: Callable[[], StepResult]) -> StepReport:
        t0 = time.monotonic()
        code = 0
        try:
            res = fn()
        except RebootRequired as e:
            res = StepResult(Outcome.REBOOT_REQUIRED, str(e))
        except NodeAgentError as e:
            res, code = StepResult(Outcome.FAILED, str(e)), e.exit_code
        except Exception as e:  # a bug in a step must still produce a report
            log.debug("step %s crashed", name, exc_info=True)
            res, code = StepResult(Outcome.FAILED, f"internal error: {type(e).__name__}: {e}"), 1
        rep = StepReport(name, res.outcome, res.reason, time.monotonic() - t0, res.details, code)
        level = {Outcome.FAILED: logging.ERROR, Outcome.REBOOT_REQUIRED: logging.WARNING}.get(rep.outcome,
                                                                                           logging.INFO)
        log.log(level, "%s: %s%s", name, rep.outcome.value, f" ({rep.reason})" if rep.reason else "")
        reports.append(rep)
        return rep

    def skip(name: str, why: str) -> None:
        reports.append(StepReport(name, Outcome.SKIPPED, why, 0.0, {}))

    inventory: Inventory | None = None

    def discover() -> StepResult:
        nonlocal inventory
        inventory = parts.discover(config, paths)
        return StepResult(
            Outcome.UNCHANGED,
            details={
                "gpus": len(inventory.gpus),
                "mig_devices": sum(len(g.mig_devices) for g in inventory.gpus),
                "driver": inventory.driver_version,
            },
        )

    disc = step("discover", discover)

    if options.mig_config is None:
        skip("mig", "no MIG config requested")
    elif disc.outcome is Outcome.FAILED or inventory is None:
        skip("mig", "discovery failed")
    else:
        inv, name = inventory, options.mig_config
        mig = step("mig", lambda: parts.apply_mig(config, paths, inv, name))
        if mig.outcome is Outcome.CHANGED:  # the CDI spec must name the new MIG devices
            try:
                inventory = parts.discover(config, paths)
            except NodeAgentError as e:
                log.warning("rediscovery after the MIG change failed: %s", e)
                inventory = None

    if not config.runtime.enabled:
        skip("runtime", "runtime.enabled = false")
        skip("containerd-restart", "runtime.enabled = false")
    else:
        rt = step("runtime", lambda: parts.configure_runtime(config, paths))
        behind: str | None = None
        if rt.outcome is Outcome.UNCHANGED and parts.containerd_behind is not None and options.restart_containerd:
            try:
                behind = parts.containerd_behind(config, paths, list(rt.details.get("containerd_files", [])))
            except (OSError, NodeAgentError) as e:
                log.warning("cannot tell whether containerd runs the current config: %s", e)
        if rt.outcome is Outcome.CHANGED and rt.details.get("restart_needed") is False:
            skip("containerd-restart", "only the NVIDIA toolkit config changed")
        elif rt.outcome is not Outcome.CHANGED and behind is None:
            skip("containerd-restart", "containerd config unchanged" if rt.outcome is Outcome.UNCHANGED
                 else "runtime step did not succeed")
        elif not options.restart_containerd:
            skip("containerd-restart", f"restart disabled ({options.restart_off})")
        elif config.runtime.restart == "none":
            skip("containerd-restart", "runtime.restart = none")
        else:
            if behind is not None:
                log.info("containerd-restart: %s", behind)
            step("containerd-restart", lambda: parts.restart_containerd(config, paths))

    # containerd reads CDI specs when it creates a container: the spec may follow its restart
    if not config.cdi.enabled:
        skip("cdi", "cdi.enabled = false")
    elif parts.write_cdi is None:
        skip("cdi", "no CDI writer")
    elif inventory is None:
        skip("cdi", "discovery failed")
    else:
        write_cdi, inv_cdi = parts.write_cdi, inventory
        step("cdi", lambda: write_cdi(config, paths, inv_cdi))

    kube: Any = None
    if not (options.kube and config.kube):
        why = "Kubernetes disabled"
    else:
        try:
            kube = parts.connect(config, paths)
            why = ""
        except NodeAgentError as e:
            why = f"API not reachable: {e}"
    if kube is None:
        skip("runtimeclass", why)
        skip("labels", why)
    else:
        try:
            step("runtimeclass", lambda: parts.ensure_runtimeclass(kube, config))
            if inventory is None:
                skip("labels", "discovery failed")
            elif not config.publish.labels:
                skip("labels", "publish.labels = false")
            else:
                inv2 = inventory
                step("labels", lambda: parts.publish_labels(kube, config, paths, inv2))
            runtime_news = _runtime_event(reports)
            if runtime_news is not None and parts.record_event is not None and config.publish.events:
                reason = parts.record_event(kube, config, "runtime", *runtime_news)
                if reason:
                    events.append(reason)
        finally:
            kube.close()
    return Report(tuple(reports), tuple(events))


def _runtime_event(reports: list[StepReport]) -> tuple[str, bool] | None:
    """(message, ok) for a Node Event about the runtime steps; None when nothing changed or failed."""
    by_name = {r.name: r for r in reports}
    rt, restart = by_name.get("runtime"), by_name.get("containerd-restart")
    if rt is None or rt.outcome is Outcome.SKIPPED:
        return None
    if rt.outcome is Outcome.FAILED:
        return f"containerd NVIDIA runtime wiring failed: {rt.reason}", False
    if rt.outcome is not Outcome.CHANGED:
        return None
    msg = f"containerd wired for the NVIDIA runtime: {rt.reason}" if rt.reason else \
        "containerd wired for the NVIDIA runtime"
    if restart is not None and restart.outcome is Outcome.FAILED:
        return f"{msg}; restarting containerd failed: {restart.reason}", False
    if restart is not None and restart.reason:
        msg += f"; {restart.reason}" if restart.outcome is Outcome.CHANGED else \
            f"; containerd not restarted ({restart.reason})"
    return msg, True


# -- the real parts ---------------------------------------------------------------------------------------


def _discover(config: AgentConfig, paths: HostPaths) -> Inventory:
    from nodeagent.nvmlsource import open_nvml

    state = Path(config.simulate.state) if config.simulate.state else None
    adapter = open_nvml(config.simulate.machine or None, state, paths)
    try:
        inv: Inventory = adapter.discover()
        return inv
    finally:
        adapter.close()


def _connect(config: AgentConfig, paths: HostPaths) -> Any:
    from nodeagent.kube.client import KubeClient, connect

    kubeconfig = Path(config.kubeconfig) if config.kubeconfig else None
    kube = KubeClient(connect(kubeconfig))
    try:
        kube.request("GET", "/version", timeout=5)
    except NodeAgentError:
        kube.close()
        raise
    return kube


def _apply_mig(config: AgentConfig, paths: HostPaths, inventory: Inventory, name: str) -> StepResult:
    from nodeagent.mig.apply import MigStateFile
    from nodeagent.mig.pipeline import MigPipeline, load_configured_sources
    from nodeagent.nvmlsource import open_nvml

    # The files first: a missing or broken one is bad input (exit 2) and changes nothing.
    sources = load_configured_sources(config.mig, paths)
    sim_state = Path(config.simulate.state) if config.simulate.state else None
    adapter = open_nvml(config.simulate.machine or None, sim_state, paths)
    try:
        pipeline = MigPipeline(adapter, sources, state=MigStateFile(paths.mig_state_dir, paths),
                               proc_root=paths.proc)
        # an apply interrupted earlier (a killed agent) is resolved before the real plan: every GPU it left
        # half-changed goes back to its previous layout; a failure there fails the step (exit 1)
        prepared = pipeline.prepare(name)
        recovery = prepared.recovery
        if recovery is not None:
            log.warning("%s", recovery.describe())
        if prepared.plan.applied:
            if recovery is not None and recovery.restored:
                return StepResult(Outcome.CHANGED,
                                  f"MIG config {name} already applied; {recovery.describe()}",
                                  {"gpus": list(recovery.restored), "recovered": recovery.describe()})
            return StepResult(Outcome.UNCHANGED, f"MIG config {name} already applied")
        result = pipeline.apply(prepared.plan, prepared.inventory)
        details: dict[str, Any] = {"gpus": list(result.touched), "resets": list(result.resets)}
        if recovery is not None:
            details["recovered"] = recovery.describe()
        return StepResult(Outcome.CHANGED, f"MIG config {name} applied", details)
    finally:
        adapter.close()


def _configure_runtime(config: AgentConfig, paths: HostPaths) -> StepResult:
    from nodeagent.runtime.configure import configure, options_from_settings
    from nodeagent.sharing.spec import load_plugin_config

    dp = config.device_plugin
    strategies = load_plugin_config(paths(dp.config)).flags.plugin.device_list_strategy \
        if dp.enabled and dp.config else ()
    result = configure(paths, options_from_settings(config.runtime, kubelet_dir=config.kubelet.dir,
                                                    device_list_strategies=strategies))
    # the files as the user's shell names them (under the root), as the CDI step names its spec
    changed = [f"{paths.root / f.path.lstrip('/')} ({f.action})" for f in result.files if f.action != "unchanged"]
    details: dict[str, Any] = {"mode": result.mode, "restart_needed": result.restart_needed,
                               "containerd_files": list(result.containerd_files)}
    if result.warnings:
        details["warnings"] = list(result.warnings)
    if result.notes:
        details["notes"] = list(result.notes)
    if changed:
        details["files"] = changed
    if result.containerd_version:
        details["containerd_version"] = result.containerd_version
    if not result.changed:
        return StepResult(Outcome.UNCHANGED, "containerd already carries the nvidia runtime", details)
    return StepResult(Outcome.CHANGED, "wrote " + ", ".join(changed), details)


def _containerd_behind(config: AgentConfig, paths: HostPaths, files: list[str]) -> str | None:
    from nodeagent.runtime.restart import DEFAULT_SOCKET, newer_than_server

    if config.runtime.restart == "none":
        return None
    newer = newer_than_server(paths(DEFAULT_SOCKET), [paths(f) for f in files])
    if newer is None:
        return None
    return f"containerd started before {paths.to_host(newer)} was last written: it runs an older config"


def _restart_containerd(config: AgentConfig, paths: HostPaths) -> StepResult:
    from nodeagent.runtime.restart import DEFAULT_SOCKET, restart_containerd

    took = restart_containerd(config.runtime.restart, paths(DEFAULT_SOCKET))
    if took is None:
        return StepResult(Outcome.SKIPPED, "runtime.restart = none")
    return StepResult(Outcome.CHANGED, f"containerd answered {took:.1f}s after the restart")


def _ensure_runtimeclass(kube: Any, config: AgentConfig) -> StepResult:
    from nodeagent.kube.runtimeclass import desired_classes, ensure_runtime_classes

    done = ensure_runtime_classes(kube, desired_classes(cdi=config.runtime.cdi))
    changed = {k: v for k, v in done.items() if v != "unchanged"}
    if not changed:
        return StepResult(Outcome.UNCHANGED, details=dict(done))
    return StepResult(Outcome.CHANGED, ", ".join(f"RuntimeClass {k} {v}" for k, v in changed.items()),
                      dict(done))


def _publish_labels(kube: Any, config: AgentConfig, paths: HostPaths, inventory: Inventory) -> StepResult:
    from nodeagent.config import PublishSettings
    from nodeagent.errors import KubeError
    from nodeagent.kube.publisher import NodePublisher
    from nodeagent.sharing.spec import load_plugin_config

    node_name = config.resolved_node_name()
    dp_config = config.device_plugin.config
    plugin_config = load_plugin_config(paths(dp_config)) if dp_config else None
    publisher = NodePublisher(
        kube, node_name,
        PublishSettings(labels=config.publish.labels or True, extended_resources=False, gpu_objects=False,
                        events=False, nodefeature_namespace=config.publish.nodefeature_namespace),
    )
    try:
        res = publisher.publish(inventory, (), plugin_config)
    except KubeError as e:
        if e.status == 404:
            return StepResult(Outcome.SKIPPED,
                              f"node {node_name} is not registered yet; the agent labels it later")
        raise
    finally:
        publisher.close()
    if not res.label_changes:
        return StepResult(Outcome.UNCHANGED, f"labels of node {node_name} already right")
    return StepResult(Outcome.CHANGED, f"{len(res.label_changes)} label(s) set on node {node_name}",
                      {"labels": dict(res.label_changes)})


def _record_event(kube: Any, config: AgentConfig, component: str, message: str, ok: bool) -> str | None:
    """A reconfiguration Event on the own Node (best effort: never fails the bootstrap). A Node the kubelet
    has not registered yet gets none; the message is in the JSON report anyway."""
    from nodeagent.errors import KubeError
    from nodeagent.kube.events import (
        MIG_RECONFIGURE_FAILED,
        MIG_RECONFIGURED,
        RUNTIME_CONFIGURE_FAILED,
        RUNTIME_CONFIGURED,
        EventRecorder,
    )
    from nodeagent.kube.node import NodeClient

    node = NodeClient(kube, config.resolved_node_name())
    try:
        node.uid()
    except KubeError as e:
        if e.status != 404:
            log.warning("no %s event on node %s: %s", component, node.name, e)
        return None
    if not EventRecorder(node).reconfigured(component, message, ok=ok):
        return None
    reasons = {"runtime": (RUNTIME_CONFIGURED, RUNTIME_CONFIGURE_FAILED),
               "mig": (MIG_RECONFIGURED, MIG_RECONFIGURE_FAILED)}
    good, bad = reasons.get(component, (component, component))
    return good if ok else bad


def _write_cdi(config: AgentConfig, paths: HostPaths, inventory: Inventory) -> StepResult:
    from nodeagent.cdi.writer import cdi_step

    simulated = bool(config.simulate.machine or config.simulate.state)  # the machine may come from the state file
    r = cdi_step(paths, inventory, config.cdi.driver_root, sim_host_files=simulated)
    return StepResult(Outcome(r.outcome), r.message, dict(r.details))


def default_parts() -> BootstrapParts:
    return BootstrapParts(
        discover=_discover,
        apply_mig=_apply_mig,
        configure_runtime=_configure_runtime,
        restart_containerd=_restart_containerd,
        ensure_runtimeclass=_ensure_runtimeclass,
        publish_labels=_publish_labels,
        connect=_connect,
        record_event=_record_event,
        write_cdi=_write_cdi,
        containerd_behind=_containerd_behind,
    )
