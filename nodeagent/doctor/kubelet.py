"""doctor's kubelet area: the device-plugin directory, what the kubelet registers, other device plugins and DRA
drivers on this node's GPUs."""

from __future__ import annotations

import posixpath
import shlex
from typing import TYPE_CHECKING

from nodeagent.doctor.agent import agent_pids
from nodeagent.doctor.findings import Report, Sources
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.inventory import Inventory

if TYPE_CHECKING:
    from nodeagent.adopt.detect import KubeFacts

KUBELET_SOCKET = "kubelet.sock"


def check_kubelet(src: Sources, inventory: Inventory | None, facts: KubeFacts | None, report: Report) -> dict[str, int]:
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
    ids = expected_resources(src, inventory)
    wanted = {n: socket_name(n) for n in ids}
    agents = set(agent_pids(src.paths)) if src.paths.proc.is_dir() else None

    def is_ours(pid: int) -> bool:
        return pid in agents if agents is not None else False

    local = d.read_plugin_dir(directory, is_ours)
    # without /proc under the root the listener of a socket at nodeagent's own name cannot be named: taken as
    # nodeagent's
    foreign = [s for s in local.foreign if agents is not None or s.name not in wanted.values()]
    conflicts = d.plugin_conflicts(foreign, local.checkpoint, wanted, uuids, ids)
    for c in conflicts:
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
    elif KUBELET_SOCKET in names:
        report.add("kubelet", "warning", "the kubelet has no GPU resource registered",
                   src.gpu_command("run") + ("" if src.simulated else " (or start the nodeagent service)"))
    return registered


def adopt_fix(src: Sources) -> str:
    """The fix for another agent on the node: the GPU Operator's hand-over, else the config switch."""
    hand_over = src.command(f"adopt --node-name {shlex.quote(src.node_name)}") if src.kube is not None else ""
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

