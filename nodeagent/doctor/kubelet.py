"""doctor's kubelet area: the device-plugin directory, what the kubelet registers, other device plugins and DRA
drivers on this node's GPUs."""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING

from nodeagent.agentrecord import AgentRecord
from nodeagent.doctor.agent import AgentView
from nodeagent.doctor.findings import Report, Sources
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.inventory import Inventory

if TYPE_CHECKING:
    from nodeagent.adopt.detect import KubeFacts

KUBELET_SOCKET = "kubelet.sock"


DRA_FIX = ("remove that DRA driver from this node (its Helm release or node selector), or leave the GPUs to it and "
           "set [device_plugin] enabled = false")


def check_kubelet(src: Sources, inventory: Inventory | None, facts: KubeFacts | None, agent: AgentView,
                  report: Report) -> dict[str, int]:
    """Findings about the kubelet's device-plugin directory and the other agents serving this node's GPUs
    (another device plugin, another DRA driver); the devices registered per resource name. What the running
    agent records (the other agents it found, its resources and their registration) comes first; the sockets
    and the kubelet's checkpoint add what it does not say."""
    from nodeagent.adopt import detect as d
    from nodeagent.deviceplugin.server import socket_name
    from nodeagent.dra import DRIVER_NAME

    plugin_dir = src.config.kubelet.device_plugins
    directory = src.paths(plugin_dir)
    uuids = d.inventory_uuids(inventory) if inventory is not None else set()
    told = agent_conflicts(src, agent, "kubelet", ("device-plugin", "dra-driver"), report)
    if facts is not None and facts.slices is not None:
        for c in d.dra_conflicts(facts.slices, DRIVER_NAME, uuids):
            if c.key() not in told:
                report.add("kubelet", "warning", c.detail, DRA_FIX)
    if not directory.is_dir():
        report.add("kubelet", "warning", f"{plugin_dir} does not exist: no kubelet on this node yet")
        return {}
    names = sorted(p.name for p in directory.iterdir() if p.is_socket())
    kubelet_up = KUBELET_SOCKET in names
    if not kubelet_up:
        report.add("kubelet", "warning", f"no {posixpath.join(plugin_dir, KUBELET_SOCKET)}: the kubelet is not "
                   "running (nodeagent registers as soon as it is)")
    live = agent.live
    if live is not None:
        _registrations(src, live, agent.record_pid, plugin_dir, kubelet_up, report)
    ids = expected_resources(src, inventory)
    wanted = {n: socket_name(n) for n in ids}
    local = d.read_plugin_dir(directory, agent.is_agent, root=src.paths)
    # with neither /proc nor the agent's lock under the root the listener of a socket at nodeagent's own name
    # cannot be named: taken as nodeagent's
    foreign = [s for s in local.foreign if agent.running is not None or s.name not in wanted.values()]
    conflicts = d.plugin_conflicts(foreign, local.checkpoint, wanted, uuids, ids)
    for c in conflicts:
        if c.key() not in told:
            report.add("kubelet", "warning", c.detail, adopt_fix(src))
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
    elif kubelet_up and not (live is not None and live.resources):  # (else the agent's own lines say why)
        report.add("kubelet", "warning", "the kubelet has no GPU resource registered",
                   src.agent_command("run") if src.simulated else
                   "start the nodeagent service (systemctl start nodeagent), or " + src.agent_command("run"))
    return registered


def _registrations(src: Sources, live: AgentRecord, pid: int, plugin_dir: str, kubelet_up: bool,
                   report: Report) -> None:
    """The running agent's resources: served on which socket, registered with the kubelet or why not."""
    for r in live.resources:
        sock = posixpath.join(plugin_dir, r.socket)
        if r.registered:
            report.add("kubelet", "ok", f"{r.resource}: served on {sock} by the running agent (pid {pid}), "
                       "registered with the kubelet")
            continue
        # waiting for a kubelet that is not there is said above; anything else keeps the resource from pods
        held = [c for c in live.conflicts if c.subject == r.resource]
        report.add("kubelet", "ok" if not kubelet_up and not held else "warning",
                   f"{r.resource} ({sock}) is not registered with the kubelet by the running agent (pid {pid}): "
                   f"{r.why or 'registering'}", adopt_fix(src) if held else "")


def agent_conflicts(src: Sources, agent: AgentView, area: str, kinds: tuple[str, ...],
                    report: Report) -> set[tuple[str, str, str]]:
    """The other agents the running agent's conflict detection found, of these kinds, as findings; their keys
    (kind, subject, owner), so that doctor's own look does not tell them twice."""
    live = agent.live
    told: set[tuple[str, str, str]] = set()
    for c in live.conflicts if live is not None else ():
        if c.kind in kinds and (c.kind, c.subject, c.owner) not in told:
            fix = DRA_FIX if c.kind == "dra-driver" else adopt_fix(src) if c.kind != "gpu-operator" else (
                src.adopt_command() if src.kube is not None else
                "hand the node over again from a shell with the cluster's credentials (nodeagent adopt)")
            report.add(area, "warning", f"{c.detail} (found by the running agent, pid {agent.record_pid})", fix)
            told.add((c.kind, c.subject, c.owner))
    return told


def adopt_fix(src: Sources) -> str:
    """The fix for another agent on the node: the GPU Operator's hand-over, else the config switch."""
    hand_over = src.adopt_command() if src.kube is not None else ""
    return (f"{hand_over} (the GPU Operator's operands), or stop the other agent on this node" if hand_over else
            "stop the other agent on this node (the GPU Operator: nodeagent adopt), or set [adopt] take_over = true")


def expected_resources(src: Sources, inventory: Inventory | None) -> dict[str, list[str]]:
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

