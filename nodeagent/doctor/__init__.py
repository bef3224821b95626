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

from nodeagent.doctor.agent import check_agent, look_at_agent
from nodeagent.doctor.findings import AREAS, Finding, HostChecks, Level, Report, Sources
from nodeagent.doctor.gpus import check_driver, check_gpus, check_health
from nodeagent.doctor.kubelet import check_kubelet
from nodeagent.doctor.node import check_node, read_kube
from nodeagent.doctor.runtime import check_cdi, check_containerd

__all__ = ["AREAS", "Finding", "HostChecks", "Level", "Report", "Sources", "diagnose"]


def diagnose(src: Sources) -> Report:
    report = Report()
    agent = look_at_agent(src)
    inventory = check_driver(src, report)
    if inventory is not None:
        check_gpus(src, inventory, report)
        check_health(src, inventory, agent.live, report)
    check_containerd(src, report)
    if inventory is not None:
        check_cdi(src, inventory, report)
    facts = read_kube(src, report)
    check_kubelet(src, inventory, facts, agent, report)
    check_node(src, inventory, facts, agent, report)
    check_agent(src, agent, report)
    return report

