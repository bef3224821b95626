"""``nodeagent discover``: show the node's GPUs, MIG devices and GPU-to-GPU topology."""

from __future__ import annotations

import json

import click

from nodeagent.commands.common import gpu_options, open_adapter
from nodeagent.gpu.inventory import Gpu, Inventory, Link, LinkKind

_LINK_ABBREV = {
    LinkKind.SAME_BOARD: "BRD",
    LinkKind.SINGLE_SWITCH: "PIX",
    LinkKind.MULTI_SWITCH: "PXB",
    LinkKind.HOST_BRIDGE: "PHB",
    LinkKind.SAME_CPU: "NODE",
    LinkKind.CROSS_CPU: "SYS",
}


def _mig_state(current: bool, pending: bool, capable: bool) -> str:
    if not capable:
        return "n/a"
    now = "on" if current else "off"
    return now if current == pending else f"{now}->{'on' if pending else 'off'} (pending)"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _link_label(link: Link | None) -> str:
    if link is None:
        return "-"
    if link.kind is LinkKind.NVLINK:
        return f"NV{link.nvlinks}"
    return _LINK_ABBREV[link.kind]


MPS_SERVER = "nvidia-cuda-mps-server"


def _mps_state(gpu: Gpu) -> str:
    """``server <pid>`` while an MPS server holds a context on the GPU (the agent's MPS daemons start one)."""
    pids = sorted(p.pid for p in gpu.processes if p.name == MPS_SERVER)
    return "server " + ",".join(map(str, pids)) if pids else "-"


def render_text(inv: Inventory, topology: bool) -> str:
    """The human-readable report (pure)."""
    major, minor = inv.cuda_version
    lines = [f"Driver {inv.driver_version}, CUDA {major}.{minor}, {len(inv.gpus)} GPU(s)", ""]
    if not inv.gpus:
        lines.append("no GPUs found")
        return "\n".join(lines)
    rows = [["GPU", "NAME", "UUID", "BUS ID", "DEVICE ID", "MEMORY", "NUMA", "CC", "MIG", "PROCS", "MPS"]]
    for g in inv.gpus:
        rows.append(
            [
                str(g.index),
                g.name + (" [LOST]" if g.lost else ""),
                g.uuid,
                g.pci_bus_id,
                g.pci_device_id_str,
                f"{g.memory_mib} MiB",
                "-" if g.numa_node is None else str(g.numa_node),
                f"{g.compute_major}.{g.compute_minor}",
                _mig_state(g.mig_current, g.mig_pending, g.mig_capable),
                str(len(g.processes)),
                _mps_state(g),
            ]
        )
    lines += _table(rows)
    fabric = [g for g in inv.gpus if g.fabric is not None]
    if fabric:
        from nodeagent.gpu import fabric as fab

        rows = [["GPU", "FABRIC", "STATUS", "CLUSTER UUID.CLIQUE", "HEALTH", "PROBLEMS"]]
        for g in fabric:
            f = g.fabric
            assert f is not None
            rows.append([str(g.index), fab.state_name(f.state), str(f.status), fab.clique_id(f),
                         fab.summary_name(f.health_summary), "; ".join(fab.health_problems(f)) or "-"])
        decision = fab.decide(inv)
        verdict = (f"{fab.CLIQUE_LABEL}={decision.value}" if decision.value else
                   f"{fab.CLIQUE_LABEL} withheld: {decision.message}" if decision.applicable
                   else decision.message)
        lines += ["", "NVLink fabric:", *_table(rows), verdict]
    migs = [d for g in inv.gpus for d in (*g.mig_devices, *g.bare_gpu_instances)]
    if migs:
        rows = [["GPU", "GI", "CI", "PROFILE", "PLACEMENT", "MEMORY", "UUID"]]
        for d in sorted(migs, key=lambda d: (d.gpu_index, d.placement_start, d.gi_id)):
            rows.append(
                [
                    str(d.gpu_index),
                    str(d.gi_id),
                    "-" if d.ci_id < 0 else str(d.ci_id),
                    d.profile,
                    f"{d.placement_start}:{d.placement_size}",
                    f"{d.memory_mib} MiB",
                    d.uuid or "(no compute instance)",
                ]
            )
        lines += ["", "MIG devices:", *_table(rows)]
    if topology:
        idx = [g.index for g in inv.gpus]
        rows = [["", *(f"GPU{i}" for i in idx)]]
        for a in idx:
            rows.append([f"GPU{a}", *("X" if a == b else _link_label(inv.link(a, b)) for b in idx)])
        lines += [
            "",
            "Topology:",
            *_table(rows),
            "",
            "NVn = n NVLinks, PIX = one PCIe switch, PXB = several PCIe switches, PHB = host bridge,",
            "NODE = same NUMA node, SYS = across sockets",
        ]
    return "\n".join(lines)


@click.command()
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="Print the inventory as stable JSON.")
@click.option("--topology", is_flag=True, help="Add the GPU-to-GPU link matrix to the table.")
@click.pass_context
def discover(ctx: click.Context, as_json: bool, topology: bool) -> None:
    """Show the node's GPUs (real, or simulated with --simulate), MIG devices and topology."""
    with open_adapter(ctx) as nvml:
        inv = nvml.discover(partial=True)
        restricted = nvml.restricted_facts
    if as_json:
        doc = inv.to_dict()
        if restricted:
            doc["needs_root"] = list(restricted)
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        click.echo(render_text(inv, topology))
    if restricted:
        click.echo("note: not shown without root: " + "; ".join(restricted), err=True)
