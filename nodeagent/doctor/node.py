"""doctor's node area (the Kubernetes API): the Node's labels, conditions, allocatable and taints, the GPU
Operator hand-over, a MIG manager or NFD on nodeagent's labels."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nodeagent.doctor.agent import AgentView
from nodeagent.doctor.findings import Report, Sources
from nodeagent.doctor.kubelet import adopt_fix, agent_conflicts, expected_resources
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.inventory import Inventory

if TYPE_CHECKING:
    from nodeagent.adopt.detect import KubeFacts


def read_kube(src: Sources, report: Report) -> KubeFacts | None:
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


def check_node(src: Sources, inventory: Inventory | None, facts: KubeFacts | None, agent: AgentView,
               report: Report) -> None:
    from nodeagent.adopt import detect as d

    told = agent_conflicts(src, agent, "node", ("mig-manager", "feature-labels", "gpu-operator"), report)
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
        if c.key() not in told:
            report.add("node", "warning", c.detail, adopt_fix(src))
    if not src.config.adopt.gpu_operator:  # (with it the agent hands the node over at its start)
        for c in d.operator_conflicts(facts.node, expected_resources(src, inventory)):
            if c.key() not in told:
                report.add("node", "warning", c.detail,
                           src.adopt_command())
    keys = _label_keys(src, inventory)
    for c in d.feature_label_conflicts(facts.node, facts.node_features or (), keys):
        if c.key() not in told:
            report.add("node", "warning", c.detail, adopt_fix(src))
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
                   "those operands again", src.adopt_command())
    else:
        report.add("node", "ok", f"handed over from the GPU Operator: {', '.join(operands)} switched off "
                   f"({src.adopt_command('--release')} gives them back)")


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
                   src.agent_command("run"))
    state = labels.get("nvidia.com/mig.config.state")
    if state == "failed":
        report.add("node", "error", f"nvidia.com/mig.config={labels.get('nvidia.com/mig.config', '')} failed "
                   "(see the MigConfigFailed Event on the Node)")
    switch_findings(labels, report)
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


# (desired label, state label, the Event reason a failure leaves): the label-driven node switches
_SWITCHES = (("nvidia.com/gpu.workload.config", "nvidia.com/gpu.workload.config.state", "WorkloadConfigFailed"),
             ("nvidia.com/cc.mode", "nvidia.com/cc.mode.state", "CcModeFailed"))


def switch_findings(labels: dict[str, str], report: Report) -> None:
    """The workload config and the CC mode: applied (ok), failed (error, with the Event to read), or not
    reported yet (warning: the agent is switching, or not following the label)."""
    for desired, state_label, reason in _SWITCHES:
        want, state = labels.get(desired), labels.get(state_label)
        if want is None and state is None:
            continue
        if state == "failed":
            report.add("node", "error", f"{desired}={want or ''} failed (see the {reason} Event on the Node)")
        elif want is not None and state != want:
            report.add("node", "warning", f"{desired}={want} is not applied ({state_label} is {state or 'unset'}): "
                       "the agent is switching, or [vfio]/[cc] enabled is false in its config")
        else:
            extra = ""
            if desired == "nvidia.com/cc.mode":
                extra = f", nvidia.com/cc.ready.state={labels.get('nvidia.com/cc.ready.state', '')}"
            report.add("node", "ok", f"{state_label}={state}{extra}")


def _count(value: Any) -> int:
    try:
        return int(str(value or "0"))
    except ValueError:
        return 0

