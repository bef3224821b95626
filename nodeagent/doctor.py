"""``nodeagent doctor``: what is true of this GPU node, in the order an operator checks it, and what to do.

Read-only: nothing is written, restarted or registered. Each area reads its facts through the same
adapters the agent uses (NVML or the simulator, the containerd planner in dry-run, the CDI renderer, the
kubelet's device-plugin directory and checkpoint, the Kubernetes API), and turns them into findings:
``ok``, ``warning`` or ``error``, one line each, with the exact command that fixes it when there is one.

Areas: driver (NVML, versions, persistence mode), gpus (MIG mode current/pending, layout, processes),
health (GPUs off the bus, the driver's recovery action, the GPUs the running agent serves Unhealthy with
their XID), containerd (wired? CRI on? default runtime, CDI, does the installed containerd load the config's
format?), cdi (the spec is there and current), kubelet (running? which resources are registered; other
device plugins and DRA drivers for the same GPUs), node (labels, conditions, allocatable against what was
discovered, taints, a MIG manager or NFD acting on nodeagent's labels; skipped without the API), agent (the
node's config, running? in which unit or pod, the unit installed and enabled; from the agent's record its
last config reload and its outcome, runs ended without a clean stop; its last bootstrap).
Exit code: 0 all ok, 1 a warning, 2 an error.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import shlex
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from nodeagent import fileio
from nodeagent.agentrecord import RECORD, AgentRecord, read_record
from nodeagent.config import AgentConfig
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths

if TYPE_CHECKING:
    from nodeagent.adopt.detect import KubeFacts
    from nodeagent.hostcommands import ConfigVerdict, UnitState

log = logging.getLogger(__name__)

Level = Literal["ok", "warning", "error"]
AREAS = ("driver", "gpus", "health", "containerd", "cdi", "kubelet", "node", "agent")
BOOTSTRAP_REPORT = "/run/nodeagent/bootstrap.json"
KUBELET_SOCKET = "kubelet.sock"
MAX_SMALL_FILE = 4 << 20
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


@dataclass(frozen=True)
class Finding:
    area: str
    level: Level
    text: str
    fix: str = ""  # the command that fixes it (global options included), "" when there is none


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)

    def add(self, area: str, level: Level, text: str, fix: str = "") -> None:
        self.findings.append(Finding(area, level, " ".join(text.split()), fix))

    @property
    def exit_code(self) -> int:
        levels = {f.level for f in self.findings}
        return 2 if "error" in levels else 1 if "warning" in levels else 0

    def to_json(self) -> str:
        return json.dumps({"exit_code": self.exit_code, "findings": [asdict(f) for f in self.findings]}, indent=2)

    def render(self) -> str:
        lines = []
        for f in self.findings:
            lines.append(f"{f.level:<8}{f.area:<11}{f.text}")
            if f.fix:
                lines.append(f"{'':19}fix: {f.fix}")
        return "\n".join(lines)


@dataclass(frozen=True)
class HostChecks:
    """What doctor may run on the real host (root ``/``), through ``nodeagent.hostcommands``; ``Sources.host``
    is None under ``--root``, where nothing is executed."""

    unit_state: Callable[[str], UnitState]  # a unit name -> systemd's ActiveState, SubState, Result, NRestarts
    containerd_loads: Callable[[str], ConfigVerdict] | None = None  # a config file -> containerd's verdict
    containerd: str = ""  # the containerd program asked ("" when none was found)


@dataclass(frozen=True)
class Sources:
    """How doctor reaches the node: each a callable, so tests and the CLI hand in the same adapters."""

    paths: HostPaths
    config: AgentConfig
    discover: Callable[[], Inventory]  # raises NodeAgentError when NVML cannot be used
    command: Callable[[str], str]  # a subcommand -> the whole command line with the options in use
    kube: Callable[[], Any] | None = None  # a KubeClient, or None with --no-kube
    node_name: str = ""
    recovery: Callable[[list[int]], dict[int, int]] | None = None  # GPU indices -> the driver's recovery actions
    simulated: bool = False
    sim_fix: str = ""  # the options that reach the same simulated machine ("--simulate X --sim-state F")
    now: Callable[[], float] = time.time
    config_problem: str = ""  # why the node's config file cannot be used (checked with the defaults then)
    host: HostChecks | None = None  # None under --root: nothing is executed there

    def gpu_command(self, subcommand: str) -> str:
        """``command`` for a subcommand that opens the GPUs: on the same simulated machine, if any."""
        return self.command(f"{subcommand} {self.sim_fix}".strip())


def diagnose(src: Sources) -> Report:
    report = Report()
    record, record_error = _read_record(src)
    live = _live_record(src, record)
    inventory = _driver(src, report)
    if inventory is not None:
        _gpus(src, inventory, report)
        _health(src, inventory, live, report)
    _containerd(src, report)
    if inventory is not None:
        _cdi(src, inventory, report)
    facts = _read_kube(src, report)
    _kubelet(src, inventory, facts, report)
    _node(src, inventory, facts, report)
    _agent(src, record, record_error, report)
    return report


def _read_record(src: Sources) -> tuple[AgentRecord | None, str]:
    """The running agent's record under the root (None when there is none), or why it cannot be used."""
    try:
        return read_record(src.paths), ""
    except NodeAgentError as e:
        return None, str(e)


def _live_record(src: Sources, record: AgentRecord | None) -> AgentRecord | None:
    """The record when it is of a run that is not over: no clean stop in it, and its pid among the agents
    /proc shows (without /proc under the root, taken as running)."""
    if record is None or record.stopped is not None:
        return None
    if src.paths.proc.is_dir() and record.pid not in set(_agent_pids(src.paths)):
        return None
    return record


# -- driver and GPUs ---------------------------------------------------------------------------------------
def _driver(src: Sources, report: Report) -> Inventory | None:
    try:
        inventory = src.discover()
    except NodeAgentError as e:
        report.add("driver", "error", f"NVML cannot be used: {e}",
                   "" if src.simulated else "install or load the NVIDIA driver, or try "
                   + src.command("doctor --simulate dgx-h100"))
        return None
    cuda = inventory.cuda_driver_version
    report.add("driver", "ok", f"driver {inventory.driver_version}, CUDA {cuda // 1000}.{cuda % 1000 // 10}"
               + (" (simulated)" if src.simulated else ""))
    _persistence(src, inventory, report)
    return inventory


def _persistence(src: Sources, inventory: Inventory, report: Report) -> None:
    """The driver's persistence mode per GPU: disabled, the driver tears a GPU's state down whenever its last
    client exits (every start pays the initialisation again, settings made meanwhile are lost); NVIDIA's
    advice is to run nvidia-persistenced, which enables it at boot."""
    answering = [g for g in inventory.gpus if not g.lost and g.persistence_mode is not None]
    off = [g.index for g in answering if not g.persistence_mode]
    if off:
        fix = (src.gpu_command("sim inject persistence enabled") if src.simulated
               else "systemctl enable --now nvidia-persistenced")
        report.add("driver", "warning", f"persistence mode disabled on GPU {', '.join(map(str, off))}: the driver "
                   "tears the GPU's state down whenever its last client exits (slow starts, settings lost); "
                   "NVIDIA's advice: run nvidia-persistenced", fix)
    elif answering:
        report.add("driver", "ok", f"persistence mode enabled on {'every GPU' if len(answering) > 1 else 'the GPU'}")
    elif any(not g.lost for g in inventory.gpus):
        report.add("driver", "ok", "persistence mode not reported by NVML")


def _gpus(src: Sources, inventory: Inventory, report: Report) -> None:
    if not inventory.gpus:
        report.add("gpus", "warning", "no GPU found")
        return
    models = sorted({g.name for g in inventory.gpus})
    report.add("gpus", "ok", f"{len(inventory.gpus)} GPU(s): {', '.join(models)}")
    for g in inventory.gpus:
        if g.mig_capable and g.mig_current != g.mig_pending:
            fix = (src.gpu_command("sim reboot") if src.simulated
                   else "reboot the host (or reset the GPU when nothing runs on it)")
            report.add("gpus", "warning", f"GPU {g.index}: MIG mode {'on' if g.mig_pending else 'off'} is "
                       f"pending (now {'on' if g.mig_current else 'off'}) until a reset or reboot", fix)
        elif g.mig_current:
            layout = ", ".join(f"{d.profile}@{d.placement_start}" for d in g.mig_devices) or "no instances"
            report.add("gpus", "ok", f"GPU {g.index}: MIG on, {layout}")
        if g.bare_gpu_instances:
            report.add("gpus", "warning", f"GPU {g.index}: {len(g.bare_gpu_instances)} GPU instance(s) without a "
                       "compute instance (a MIG change left half done?)",
                       src.gpu_command("mig apply -c <your config>"))
        if g.processes:
            procs = ", ".join(f"{p.pid} ({p.name})" for p in g.processes[:5])
            report.add("gpus", "ok", f"GPU {g.index}: {len(g.processes)} process(es): {procs}")


def _health(src: Sources, inventory: Inventory, live: AgentRecord | None, report: Report) -> None:
    from nodeagent.gpu.ports import RECOVERY_NONE, recovery_action_name

    lost = [g.index for g in inventory.gpus if g.lost]
    for i in lost:
        report.add("health", "error", f"GPU {i} has fallen off the bus (NVML: GPU is lost); the kubelet gets it "
                   "as Unhealthy", "drain the node and reset the GPU or reboot (nvidia-smi -r -i "
                   f"{i}; a reboot when that fails)")
    asks = {}
    if src.recovery is not None:
        try:
            asks = {i: a for i, a in src.recovery([g.index for g in inventory.gpus if not g.lost]).items()
                    if a != RECOVERY_NONE}
        except NodeAgentError as e:
            report.add("health", "warning", f"the driver's recovery actions cannot be read: {e}")
    for i, action in sorted(asks.items()):
        name = recovery_action_name(action)
        fix = (f"drain the node, then nvidia-smi -r -i {i}" if "reset" in name and "bus" not in name
               else "drain the node, then reboot it" if "reboot" in name
               else f"drain the node, then do what the driver asks ({name})")
        report.add("health", "error", f"GPU {i}: the driver asks for a recovery: {name} (after an XID; the agent's "
                   "GPUHealthy condition names the XID)", fix)
    if not lost and not asks:
        report.add("health", "ok", "every GPU answers NVML, no recovery asked for")
    if live is None:
        return
    # what the running agent's health monitor holds (XIDs are events: only the agent saw them)
    for f in live.unhealthy:
        if f.lost or f.gpu in asks:
            continue  # told above from NVML itself
        what = f"GPU {f.gpu}" + (f" (GPU instance {f.gi})" if f.gi is not None else "")
        why = f"after XID {f.xid}" if f.xid is not None else "by its health check"
        report.add("health", "error", f"{what} is served Unhealthy to the kubelet {why} (the agent's health "
                   f"monitor, since {_when(live.health_changed, src)}); it is Healthy again once NVML shows no "
                   "new critical XID for the [health] window")
    if not live.unhealthy:
        report.add("health", "ok", "the agent serves every GPU as Healthy (no XID held)")


# -- containerd and CDI --------------------------------------------------------------------------------------
def _containerd(src: Sources, report: Report) -> None:
    from nodeagent.runtime import configure as rc
    from nodeagent.runtime import containerd_versions as ctv

    if not src.config.runtime.enabled:
        report.add("containerd", "ok", "not managed ([runtime] enabled = false)")
        return
    try:
        info = rc.show(src.paths, src.config.runtime.containerd_config)
        planned = rc.configure(src.paths, rc.options_from_settings(src.config.runtime, dry_run=True,
                                                                  kubelet_dir=src.config.kubelet.dir))
    except NodeAgentError as e:
        report.add("containerd", "error", f"containerd's config cannot be used: {e}",
                   "fix the file by hand (nodeagent never rewrites a file it cannot read)")
        return
    for warning in info["warnings"]:
        report.add("containerd", "error" if "CRI" in warning or "cri" in warning else "warning", warning)
    installed = ctv.parse_containerd_version(info["containerd_version"] or "")
    problem, fix = ctv.load_problem(installed, int(info["config_version"]))
    if problem and info["sources"]:
        report.add("containerd", "error", f"{info['sources'][0]}: {problem}", fix)
    if info["sources"]:
        _containerd_loads(src, str(info["sources"][0]), report)
    if planned.changed:
        files = ", ".join(f.path for f in planned.files if f.action != "unchanged")
        report.add("containerd", "warning", f"not wired for the NVIDIA runtime ({files} differ)",
                   src.command("runtime configure"))
    else:
        report.add("containerd", "ok", f"wired: runtimes {', '.join(info['runtimes']) or 'none'}; default "
                   f"{info['default_runtime']}; CDI {'on' if info['enable_cdi'] else 'off'}; containerd "
                   f"{info['containerd_version'] or 'version unknown'}")


def _containerd_loads(src: Sources, config: str, report: Report) -> None:
    """containerd's own verdict on its config file (``containerd --config FILE config dump``), on the real host
    only: under --root nothing is executed, and the verdict is nodeagent's reading alone."""
    if src.host is None:
        report.add("containerd", "ok", f"{config} read by nodeagent only: containerd itself is not asked under "
                   f"--root {src.paths.root} (nothing is executed there)")
        return
    if src.host.containerd_loads is None:
        report.add("containerd", "ok", f"{config} read by nodeagent only: no containerd program on PATH to ask")
        return
    verdict = src.host.containerd_loads(str(src.paths(config)))
    asked = f"{verdict.binary} --config {config} config dump"
    if verdict.loads:
        report.add("containerd", "ok", f"containerd loads {config} ({asked})")
    elif verdict.loads is False:
        report.add("containerd", "error", f"containerd refuses {config}: {verdict.message} ({asked}); containerd "
                   "would not start with it", f"correct {config} (then: {asked})")
    else:
        report.add("containerd", "warning", f"containerd could not be asked about {config}: {verdict.message}")


def _cdi(src: Sources, inventory: Inventory, report: Report) -> None:
    from nodeagent.cdi.writer import CdiWriter

    if not src.config.cdi.enabled:
        report.add("cdi", "ok", "not managed ([cdi] enabled = false)")
        return
    writer = CdiWriter(src.paths, driver_root=src.config.cdi.driver_root)
    fix = src.gpu_command("cdi generate")
    try:
        text = fileio.read_text(src.paths(writer.spec_path))
        wanted = writer.render(inventory)
    except (NodeAgentError, OSError) as e:
        report.add("cdi", "error", f"the CDI spec cannot be read or made: {e}", fix)
        return
    if text is None:
        report.add("cdi", "warning" if wanted is not None else "ok",
                   f"no CDI spec at {writer.spec_path}" + ("" if wanted is not None else " (no GPU)"),
                   fix if wanted is not None else "")
    elif text != wanted:
        report.add("cdi", "warning", f"{writer.spec_path} differs from the GPUs now (stale)", fix)
    else:
        report.add("cdi", "ok", f"{writer.spec_path} is current")


# -- kubelet ---------------------------------------------------------------------------------------------------
def _kubelet(src: Sources, inventory: Inventory | None, facts: KubeFacts | None, report: Report) -> dict[str, int]:
    """Findings about the kubelet's device-plugin directory and the other agents serving this node's GPUs
    (another device plugin, another DRA driver); the devices registered per resource name."""
    from nodeagent.adopt import detect as d
    from nodeagent.deviceplugin.server import socket_name
    from nodeagent.dra import DRIVER_NAME

    plugin_dir = src.config.kubelet.device_plugins
    directory = src.paths(plugin_dir)
    uuids = d.inventory_uuids(inventory) if inventory is not None else set()
    if facts is not None and facts.slices is not None:
        for c in d.dra_conflicts(facts.slices, DRIVER_NAME, uuids):
            report.add("kubelet", "warning", c.detail, "remove that DRA driver from this node (its Helm release "
                       "or node selector), or leave the GPUs to it and set [device_plugin] enabled = false")
    if not directory.is_dir():
        report.add("kubelet", "warning", f"{plugin_dir} does not exist: no kubelet on this node yet")
        return {}
    names = sorted(p.name for p in directory.iterdir() if p.is_socket())
    if KUBELET_SOCKET not in names:
        report.add("kubelet", "warning", f"no {posixpath.join(plugin_dir, KUBELET_SOCKET)}: the kubelet is not "
                   "running (nodeagent registers as soon as it is)")
    ids = _expected_resources(src, inventory)
    wanted = {n: socket_name(n) for n in ids}
    agents = set(_agent_pids(src.paths)) if src.paths.proc.is_dir() else None

    def is_ours(pid: int) -> bool:
        return pid in agents if agents is not None else False

    local = d.read_plugin_dir(directory, is_ours, root=src.paths)
    # without /proc under the root the listener of a socket at nodeagent's own name cannot be named: taken as
    # nodeagent's
    foreign = [s for s in local.foreign if agents is not None or s.name not in wanted.values()]
    conflicts = d.plugin_conflicts(foreign, local.checkpoint, wanted, uuids, ids)
    for c in conflicts:
        report.add("kubelet", "warning", c.detail, _adopt_fix(src))
    named = {c.owner for c in conflicts}
    for s in foreign:
        if s.name not in named:
            report.add("kubelet", "ok", f"{posixpath.join(plugin_dir, s.name)}: another device plugin, for other "
                       f"devices ({len(s.device_ids)} listed)")
    for name in local.silent:
        if name in wanted.values():
            continue
        report.add("kubelet", "warning", f"{posixpath.join(plugin_dir, name)}: a device-plugin socket nodeagent "
                   "does not serve (another device plugin on this node?)")
    registered = {k: len(v) for k, v in local.checkpoint.items()}
    if registered:
        listed = ", ".join(f"{k} ({v} devices)" for k, v in sorted(registered.items()))
        report.add("kubelet", "ok", f"registered with the kubelet: {listed}")
    elif KUBELET_SOCKET in names:
        report.add("kubelet", "warning", "the kubelet has no GPU resource registered",
                   src.gpu_command("run") + ("" if src.simulated else " (or start the nodeagent service)"))
    return registered


def _adopt_fix(src: Sources) -> str:
    """The fix for another agent on the node: the GPU Operator's hand-over, else the config switch."""
    hand_over = src.command(f"adopt --node-name {shlex.quote(src.node_name)}") if src.kube is not None else ""
    return (f"{hand_over} (the GPU Operator's operands), or stop the other agent on this node" if hand_over else
            "stop the other agent on this node (the GPU Operator: nodeagent adopt), or set [adopt] take_over = true")


def _expected_resources(src: Sources, inventory: Inventory | None) -> dict[str, list[str]]:
    """The resource names nodeagent would serve on this node, with the device IDs of each (empty when that
    cannot be worked out)."""
    if inventory is None or not src.config.device_plugin.enabled or src.config.device_plugin.plane == "dra":
        return {}
    from nodeagent.sharing.devices import build_resources, resource_ids
    from nodeagent.sharing.spec import PluginConfig, load_plugin_config

    try:
        path = src.config.device_plugin.config
        plugin = load_plugin_config(src.paths(path)) if path else PluginConfig()
        return resource_ids(build_resources(inventory, plugin))
    except NodeAgentError:
        return {}


# -- the Node ----------------------------------------------------------------------------------------------------
def _read_kube(src: Sources, report: Report) -> KubeFacts | None:
    """The Node, this node's ResourceSlices and NodeFeature objects (None without the API)."""
    from nodeagent.adopt.detect import read_kube_facts

    if src.kube is None:
        return None
    try:
        kube = src.kube()
    except NodeAgentError as e:
        report.add("node", "warning", f"the Kubernetes API cannot be reached: {e}")
        return None
    try:
        return read_kube_facts(kube, src.node_name)
    finally:
        close = getattr(kube, "close", None)
        if callable(close):
            close()


def _node(src: Sources, inventory: Inventory | None, facts: KubeFacts | None, report: Report) -> None:
    from nodeagent.adopt import detect as d

    if src.kube is None:
        report.add("node", "ok", "not checked (--no-kube)")
        return
    if facts is None:
        return
    if facts.node is None:
        why = next((u for u in facts.unread if u.startswith("Node")), "")
        report.add("node", "error", f"Node {src.node_name} cannot be read: {why.partition(': ')[2]}")
        return
    _node_findings(src, facts.node, inventory, report)
    _handed_over(src, facts.node, report)
    for c in d.mig_manager_conflicts(facts.node):
        report.add("node", "warning", c.detail, _adopt_fix(src))
    if not src.config.adopt.gpu_operator:  # (with it the agent hands the node over at its start)
        for c in d.operator_conflicts(facts.node, _expected_resources(src, inventory)):
            report.add("node", "warning", c.detail, src.command(f"adopt --node-name {shlex.quote(src.node_name)}"))
    keys = _label_keys(src, inventory)
    for c in d.feature_label_conflicts(facts.node, facts.node_features or (), keys):
        report.add("node", "warning", c.detail, _adopt_fix(src))
    for what in facts.unread:
        if not what.startswith("Node"):
            report.add("node", "ok", f"not checked: {what}")


def _handed_over(src: Sources, node: Any, report: Report) -> None:
    """The GPU Operator's operands a hand-over switched off on this Node (its annotation), if any."""
    from nodeagent.adopt import DEPLOY_PREFIX, HANDED_OVER, handed_over

    operands = handed_over(node)
    if not operands:
        return
    labels = (node.get("metadata") or {}).get("labels") or {}
    back_on = [op for op in operands if labels.get(DEPLOY_PREFIX + op) != "false"]
    if back_on:
        report.add("node", "warning", f"handed over from the GPU Operator ({HANDED_OVER}), but "
                   f"{', '.join(DEPLOY_PREFIX + op for op in back_on)} is no longer false: the operator may deploy "
                   "those operands again", src.command(f"adopt --node-name {shlex.quote(src.node_name)}"))
    else:
        report.add("node", "ok", f"handed over from the GPU Operator: {', '.join(operands)} switched off "
                   f"({src.command(f'adopt --node-name {shlex.quote(src.node_name)} --release')} gives them back)")


def _label_keys(src: Sources, inventory: Inventory | None) -> set[str]:
    """The label keys nodeagent writes on this node (its ownership annotation's, else what it would write)."""
    from nodeagent.kube.labels import desired_labels, sharing_facts
    from nodeagent.sharing.spec import load_plugin_config

    if inventory is None:
        return set()
    try:
        path = src.config.device_plugin.config
        plugin = load_plugin_config(src.paths(path)) if path else None
    except NodeAgentError:
        plugin = None
    return set(desired_labels(inventory, sharing_facts(plugin)))


def _node_findings(src: Sources, node: Any, inventory: Inventory | None, report: Report) -> None:
    meta = node.get("metadata") or {}
    status = node.get("status") or {}
    labels = meta.get("labels") or {}
    gpu_labels = {k: v for k, v in labels.items() if k.startswith("nvidia.com/gpu.")}
    if gpu_labels:
        report.add("node", "ok", f"{len(gpu_labels)} nvidia.com/gpu.* labels (product "
                   f"{labels.get('nvidia.com/gpu.product', '?')}, count {labels.get('nvidia.com/gpu.count', '?')})")
    else:
        report.add("node", "warning", f"Node {src.node_name} has no nvidia.com/gpu.* labels: is the agent running?",
                   src.gpu_command("run"))
    state = labels.get("nvidia.com/mig.config.state")
    if state == "failed":
        report.add("node", "error", f"nvidia.com/mig.config={labels.get('nvidia.com/mig.config', '')} failed "
                   "(see the MigConfigFailed Event on the Node)")
    for cond in status.get("conditions") or []:
        kind = str(cond.get("type", ""))
        if not kind.startswith("nodeagent.io/"):
            continue
        ok = cond.get("status") == "True"
        report.add("node", "ok" if ok else "warning",
                   f"{kind} {cond.get('status')}: {cond.get('reason', '')} {cond.get('message', '')}".strip())
    allocatable = status.get("allocatable") or {}
    if inventory is not None:
        have = int(allocatable.get("nvidia.com/gpu", "0") or 0)
        whole = sum(1 for g in inventory.gpus if not g.mig_current)
        if "nvidia.com/gpu" in allocatable or whole:
            if have < whole:
                report.add("node", "warning", f"allocatable nvidia.com/gpu is {have}, {whole} GPU(s) discovered "
                           "without MIG (unhealthy, withdrawn, shared, or not registered)")
            else:
                report.add("node", "ok", f"allocatable nvidia.com/gpu {have} ({whole} GPU(s) discovered)")
    capacity = status.get("capacity") or {}
    for name in sorted(k for k in capacity if str(k).startswith("nvidia.com/")):
        total, healthy = _count(capacity.get(name)), _count(allocatable.get(name))
        if healthy < total:
            report.add("node", "warning", f"{name}: {healthy} of {total} device(s) healthy at the kubelet "
                       "(allocatable against capacity)")
        else:
            report.add("node", "ok", f"{name}: {total} device(s), all healthy at the kubelet")
    for taint in (node.get("spec") or {}).get("taints") or []:
        if "gpu" in str(taint.get("key", "")).lower():
            report.add("node", "warning", f"taint {taint.get('key')}={taint.get('value', '')}:"
                       f"{taint.get('effect', '')}")


def _count(value: Any) -> int:
    try:
        return int(str(value or "0"))
    except ValueError:
        return 0


# -- the agent itself ---------------------------------------------------------------------------------------------
UNIT = "nodeagent.service"
UNIT_DIRS = ("/etc/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")
UNIT_WANTS = "/etc/systemd/system/multi-user.target.wants"
RECENT_S = 3600.0  # an unclean end of the agent older than this is told as history, not as a warning


def _agent(src: Sources, record: AgentRecord | None, record_error: str, report: Report) -> None:
    if src.config_problem:
        report.add("agent", "error", f"the agent's config cannot be used: {src.config_problem} (doctor checked "
                   "with the defaults; a running agent keeps the config it had, a starting one exits)",
                   "correct the file, then reload the agent")
    if record_error:
        report.add("agent", "warning", f"{record_error} (left by another version?)")
    installed, enabled = _unit_state(src.paths)
    _unit_activity(src, installed, report)
    running: list[int] | None = list(_agent_pids(src.paths)) if src.paths.proc.is_dir() else None
    if running is None:  # a root without /proc (an image, the DaemonSet's /host)
        if record is None:
            report.add("agent", "ok", f"not checked: no /proc under {src.paths.root} and no {RECORD}")
        elif record.stopped is not None:
            report.add("agent", "warning", f"the agent (pid {record.pid}) stopped at {_when(record.stopped, src)}; "
                       f"whether one runs now is not checked (no /proc under {src.paths.root})")
        else:
            report.add("agent", "ok", f"the agent's record: pid {record.pid}, started {_when(record.started, src)} "
                       f"with {record.config}; whether it still runs is not checked (no /proc under "
                       f"{src.paths.root})")
    elif running:
        where = {_where(src.paths, pid) for pid in running} - {""}
        since = (f", started {_when(record.started, src)} with {record.config}"
                 if record is not None and record.pid in running else "")
        report.add("agent", "ok", f"nodeagent run is running (pid {', '.join(map(str, running))})"
                   + (f" in {', '.join(sorted(where))}" if where else "") + since)
        if installed and not enabled and not any(w.startswith("pod ") for w in where):
            report.add("agent", "warning", f"{UNIT} is not enabled: the agent will not start at the next boot",
                       _systemctl(src, "enable"))
    else:
        ended = ""
        if record is not None:
            ended = (f"; the last one (pid {record.pid}) stopped at {_when(record.stopped, src)}"
                     if record.stopped is not None else
                     f"; the last one (pid {record.pid}, started {_when(record.started, src)}) ended without a "
                     "clean stop (killed or crashed)")
        if src.simulated:
            fix = src.gpu_command("run")
        elif installed:
            fix = _systemctl(src, "enable --now" if not enabled else "start")
        else:
            fix = ("systemctl start nodeagent (bare metal), the DaemonSet's pod (Kubernetes), or "
                   + src.command("run"))
        unit = (f" ({UNIT} installed, {'enabled' if enabled else 'not enabled'})" if installed else "")
        report.add("agent", "warning", f"nodeagent run is not running on this host{unit}{ended}", fix)
    if record is not None:
        # the record's run is over when it says so, or when /proc shows no agent
        live = record.stopped is None and (running is None or record.pid in running)
        _reload_finding(src, record, installed, live, report)
        _unclean_finding(src, record, report)
    _bootstrap_finding(src, report)


def _unit_activity(src: Sources, installed: bool, report: Report) -> None:
    """systemd's own state of the agent's unit (active, failed, restarting), on the real host only."""
    if src.host is None:
        if installed:
            report.add("agent", "ok", f"{UNIT}: whether systemd has it active or failed is not checked under --root "
                       f"{src.paths.root} (nothing is executed there)")
        return
    state = src.host.unit_state(UNIT)
    if state.problem:
        if installed:  # (no unit file and no systemd to ask: nothing to tell)
            report.add("agent", "warning", f"{UNIT}: systemd's state not read: {state.problem}")
        return
    load, active, sub = state.get("LoadState"), state.get("ActiveState"), state.get("SubState")
    result, restarts = state.get("Result"), state.get("NRestarts") or "0"
    if load == "not-found":
        if installed:
            report.add("agent", "warning", f"{UNIT} is installed but systemd has not loaded it",
                       "systemctl daemon-reload")
        return
    what = f"{UNIT} {active} ({sub}), result {result}, {restarts} restart(s) since it was started"
    journal = "journalctl -u nodeagent -b"
    if active == "failed":
        report.add("agent", "error", f"{what}: systemd gave up on the agent",
                   f"read why: {journal}; correct it, then systemctl reset-failed nodeagent && systemctl start "
                   "nodeagent")
    elif sub == "auto-restart" or (active in ("activating", "deactivating") and result not in ("", "success")):
        report.add("agent", "error", f"{what}: the agent keeps failing and systemd restarts it",
                   f"read why: {journal}")
    elif active == "active":
        report.add("agent", "ok" if result in ("", "success") else "warning", what,
                   "" if result in ("", "success") else f"read why it failed before: {journal}")
    else:
        report.add("agent", "ok", what)


def _reload_finding(src: Sources, record: AgentRecord, installed: bool, running: bool,
                    report: Report) -> None:
    """The time and outcome of the agent's last SIGHUP reload (its record), with the fix of a refused one."""
    last = record.last_reload
    if last is None:
        report.add("agent", "ok", f"no config reload since the agent's start at {_when(record.started, src)}")
        return
    what = f"last config reload {_when(last.time, src)}: {last.outcome}" + (f" ({last.detail})" if last.detail else "")
    if last.outcome in ("applied", "unchanged") or not running:
        report.add("agent", "ok", what + ("" if running else " (a run that is over)"))
        return
    config = record.config if record.config != "defaults" else "/etc/nodeagent/config.toml"
    under_systemd = installed and not src.simulated and str(src.paths.root) == "/"
    fix = f"correct {config} (or a file it names), then reload: " + (
        "systemctl reload nodeagent" if under_systemd else f"kill -HUP {record.pid}")
    report.add("agent", "warning", what + "; the agent keeps running on its previous config", fix)


def _unclean_finding(src: Sources, record: AgentRecord, report: Report) -> None:
    """Earlier runs since boot that ended without a clean stop: recent ones are a warning (a restart loop,
    the watchdog, a crash), older ones history."""
    if record.unclean_ends <= 0:
        return
    last = record.last_unclean
    seen = last.get("seen")
    recent = isinstance(seen, int | float) and src.now() - seen < RECENT_S
    text = (f"{record.unclean_ends} of the agent's {record.starts} starts since boot followed a run that ended "
            "without a clean stop" + (f" (the latest: pid {last['pid']}, started {_when(last['started'], src)}, "
                                      f"its end seen {_when(seen, src)})" if "pid" in last and "started" in last
                                      and seen is not None else ""))
    where = "journalctl -u nodeagent -b" if not src.simulated else ""
    report.add("agent", "warning" if recent else "ok", text, (f"read why: {where}" if where and recent else ""))


def _bootstrap_finding(src: Sources, report: Report) -> None:
    try:
        data = fileio.read_regular(src.paths(BOOTSTRAP_REPORT), max_bytes=MAX_SMALL_FILE)
        last = json.loads(data) if data else None
    except (NodeAgentError, ValueError):
        last = None
    if isinstance(last, dict):
        code = last.get("exit_code")
        failed = [s.get("step") for s in last.get("steps") or [] if isinstance(s, dict) and s.get("result") == "failed"]
        report.add("agent", "ok" if code in (0, 3) else "warning", f"last bootstrap: exit {code}"
                   + (f", failed: {', '.join(map(str, failed))}" if failed else ""),
                   "" if code in (0, 3) else src.gpu_command("bootstrap"))


def _unit_state(paths: HostPaths) -> tuple[bool, bool]:
    """Whether the root has the agent's systemd unit installed, and enabled (wanted by multi-user.target);
    read from the unit files, as ``systemctl --root`` would (no D-Bus, nothing run)."""

    def exists(directory: str) -> bool:
        try:
            return os.path.lexists(paths(directory) / UNIT)
        except NodeAgentError:
            return False

    return any(exists(d) for d in UNIT_DIRS), exists(UNIT_WANTS)


def _systemctl(src: Sources, verb: str) -> str:
    """A systemctl command for the agent's unit on this root: ``--root`` for a root other than ``/`` (only
    enable/disable work there: nothing runs under a root)."""
    root = str(src.paths.root)
    if root == "/":
        return f"systemctl {verb} nodeagent"
    if verb.startswith("enable"):
        return f"systemctl --root {shlex.quote(root)} enable nodeagent"
    return f"systemctl {verb} nodeagent (on the host whose root is {root})"


def _when(t: float | None, src: Sources) -> str:
    """A time as UTC with its age: ``2026-11-26T18:02:11Z (3 min ago)``."""
    if t is None:
        return "an unknown time"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    age = max(0.0, src.now() - t)
    ago = (f"{age:.0f} s" if age < 120 else f"{age / 60:.0f} min" if age < 7200 else f"{age / 3600:.1f} h"
           if age < 172800 else f"{age / 86400:.0f} days")
    return f"{stamp} ({ago} ago)"


def _where(paths: HostPaths, pid: int) -> str:
    """The systemd unit or the Kubernetes pod a process runs in (from its cgroup), "" when neither shows."""
    try:
        data = fileio.read_regular(paths.proc / str(pid) / "cgroup", max_bytes=1 << 16)
    except NodeAgentError:
        return ""
    for line in (data or b"").decode("utf-8", "replace").splitlines():
        parts = [p for p in line.rpartition(":")[2].split("/") if p]
        if any(p.startswith("kubepods") for p in parts):
            uids = [m.group(1).replace("_", "-") for p in parts if (m := _POD_UID.search(p))]
            if uids:
                return f"pod {uids[-1]}"
        units = [p for p in parts if p.endswith(".service")]
        if units:
            return "unit " + units[-1]
    return ""


def _agent_pids(paths: HostPaths) -> Iterable[int]:
    """Processes under the root's /proc whose command line is ``... nodeagent ... run``."""
    proc = paths.proc
    try:
        entries = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return
    for entry in entries:
        try:
            data = fileio.read_regular(entry / "cmdline", max_bytes=1 << 16)
        except NodeAgentError:
            continue
        if not data:
            continue
        args = [a.decode("utf-8", "replace") for a in data.split(b"\0") if a]
        names = [posixpath.basename(a) for a in args[:3]]
        if ("nodeagent" in names or (len(args) > 2 and args[1:3] == ["-m", "nodeagent"])) and "run" in args:
            yield int(entry.name)
