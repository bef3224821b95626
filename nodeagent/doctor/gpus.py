"""doctor's driver, gpus and health areas: NVML and its versions, persistence mode, MIG, the GPUs' health
(NVML's own, and what the running agent's health monitor holds)."""

from __future__ import annotations

from nodeagent.agentrecord import AgentRecord
from nodeagent.doctor.findings import Report, Sources, when
from nodeagent.errors import NodeAgentError
from nodeagent.gpu.inventory import Gpu, Inventory


def check_driver(src: Sources, report: Report) -> Inventory | None:
    try:
        inventory = src.discover()
    except NodeAgentError as e:
        report.add("driver", "error", f"NVML cannot be used: {e}",
                   "" if src.simulated else "install or load the NVIDIA driver, or try "
                   + src.agent_command("doctor --simulate dgx-h100", sim=False))
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


def check_gpus(src: Sources, inventory: Inventory, report: Report) -> None:
    if not inventory.gpus:
        bound = _vfio_bound(src)
        if bound:
            report.add("gpus", "ok", f"no GPU on the nvidia driver: {len(bound)} GPU(s) bound to "
                       f"{', '.join(sorted(set(bound.values())))} for virtual machines ({', '.join(sorted(bound))})")
        else:
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
                       "compute instance (a MIG change left half done?)", _bare_instances_fix(src, g))
        if g.processes:
            procs = ", ".join(f"{p.pid} ({p.name})" for p in g.processes[:5])
            report.add("gpus", "ok", f"GPU {g.index}: {len(g.processes)} process(es): {procs}")
    _clique(src, inventory, report)


def _clique(src: Sources, inventory: Inventory, report: Report) -> None:
    """The NVLink clique: which label the node gets, or why none (fabric not ready, GPUs disagree)."""
    from nodeagent.gpu.fabric import CLIQUE_LABEL, decide

    d = decide(inventory)
    if not d.applicable:
        return
    if d.value is not None:
        report.add("gpus", "warning" if d.degraded else "ok", f"{CLIQUE_LABEL}={d.value}" + (f" (fabric health: {'; '.join(d.degraded)})"
                                                                  if d.degraded else ""))
        return
    fix = (src.gpu_command("sim inject fabric --heal") if src.simulated
           else "check the NVIDIA fabric manager (systemctl status nvidia-fabricmanager) and the NVLink switches")
    reason = d.reason.value if d.reason else "unknown"
    report.add("gpus", "warning", f"{CLIQUE_LABEL} withheld ({reason}): {d.message}", fix)


def _bare_instances_fix(src: Sources, g: Gpu) -> str:
    """A command that removes only the GPU instances without a compute instance and keeps the whole MIG
    devices (the next `mig apply` or the agent's label-driven change then plans from a clean layout)."""
    if src.simulated:  # the simulated GPU gets its whole devices back, without the bare instances
        profiles = " ".join(d.profile for d in sorted(g.mig_devices, key=lambda d: d.placement_start))
        return src.gpu_command(f"sim mig --gpu {g.index} {profiles}".rstrip())
    ids = ",".join(str(d.gi_id) for d in g.bare_gpu_instances)
    return f"nvidia-smi mig -i {g.index} -dgi -gi {ids}"


def check_health(src: Sources, inventory: Inventory, live: AgentRecord | None, report: Report) -> None:
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
                   f"monitor, since {when(live.health_changed, src)}); it is Healthy again once NVML shows no "
                   "new critical XID for the [health] window")
    if not live.unhealthy:
        report.add("health", "ok", "the agent serves every GPU as Healthy (no XID held)")



def _vfio_bound(src: Sources) -> dict[str, str]:
    """Bus id → VFIO driver of the NVIDIA GPUs the root's PCI tree shows bound for VMs (NVML sees none of
    them): the node is in vm-passthrough, which is no missing GPU."""
    from nodeagent.vfio.plan import VFIO_DRIVERS
    from nodeagent.vfio.sysfs import PciSysfs

    return {f.bdf: str(f.driver) for f in PciSysfs(src.paths).functions() if f.is_gpu and f.driver in VFIO_DRIVERS}
