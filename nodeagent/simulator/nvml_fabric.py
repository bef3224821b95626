"""Simulated NVLink fabric info: racks of compute trays, the fabric manager's bring-up, health and faults.

A machine with ``rack_nodes`` (GB200/GB300 NVL72: 18) is one compute tray of a rack. Its GPUs report the
rack's cluster UUID (derived from the rack's name, so every simulated node placed in the same rack reports
the same UUID) and the tray's clique ID; by default every tray is in rack ``rack-1``, clique 1. ``place``
puts the node in another rack, node slot or clique (two cliques in one rack, a node of another rack).
Other Hopper/Blackwell machines with NVSwitches report COMPLETED without a cluster (zero UUID, clique 0);
everything else answers NOT_SUPPORTED, as NVML does before Hopper.

The fabric manager's bring-up is the state machine NOT_STARTED → IN_PROGRESS → COMPLETED: ``bring_up``
restarts it (the first half of its duration NOT_STARTED, the second IN_PROGRESS, then COMPLETED, by wall
clock, so every process reading the state sees the same moment). Faults (``set_fabric``): a state held,
a status other than SUCCESS, health-mask bits (degraded bandwidth, route unhealthy, ...) with the health
summary that goes with them, one GPU in another clique. All of it lives in the state's ``fabric`` object.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pynvml

from nodeagent.errors import InputError
from nodeagent.simulator.machine import SimMachine
from nodeagent.simulator.nvml_base import SimBase, _deref, _err
from nodeagent.simulator.state import SimStore, State

_RACK_NAMESPACE = uuid.UUID("2c0f3c55-5f0e-4d8e-9b43-4a5b1f0d7e21")
DEFAULT_RACK = "rack-1"
DEFAULT_CLIQUE = 1
MAX_CLIQUE = 0xFFFFFFFF
# healthMask of a healthy GPU in an assigned partition: every two-state field FALSE, configuration NONE
HEALTHY_MASK = 2 | (2 << 2) | (2 << 4) | (2 << 6) | (1 << 8) | (1 << 12)
HEALTH_FAULTS: dict[str, tuple[int, int, int]] = {  # name -> (shift, width, summary when TRUE)
    "degraded-bandwidth": (0, 0x3, pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY),
    "route-recovery": (2, 0x3, pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY),
    "route-unhealthy": (4, 0x3, pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY),
    "access-timeout-recovery": (6, 0x3, pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY),
}
STATES = {"not-started": 1, "in-progress": 2, "completed": 3}


def has_fabric(machine: SimMachine) -> bool:
    """Whether NVML reports fabric info at all (Hopper or later behind NVSwitches)."""
    return machine.nvlink_fabric == "nvswitch" and all(g.architecture in ("hopper", "blackwell")
                                                       for g in machine.gpus)


def cluster_uuid(rack: str) -> uuid.UUID:
    return uuid.uuid5(_RACK_NAMESPACE, f"rack/{rack}")


def fabric_state(st: State) -> dict[str, Any]:
    f: dict[str, Any] = st.get("fabric") or {}
    return f


def current(machine: SimMachine, st: State, index: int, now: float | None = None) -> dict[str, Any]:
    """GPU ``index``'s fabric info now: state, status, cluster (UUID), clique, mask, summary."""
    f = fabric_state(st)
    if machine.rack_nodes == 0:
        return {"state": 3, "status": 0, "cluster": uuid.UUID(int=0), "clique": 0,
                "mask": HEALTHY_MASK, "summary": pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY}
    state = int(f.get("state", 3))
    start, duration = f.get("bringup_start"), f.get("bringup_s")
    if isinstance(start, int | float) and isinstance(duration, int | float):
        elapsed = (time.time() if now is None else now) - start
        state = 1 if elapsed < duration / 2 else 2 if elapsed < duration else state
    mask = int(f.get("health_mask", HEALTHY_MASK))
    faulty = {bad for shift, width, bad in HEALTH_FAULTS.values() if (mask >> shift) & width == 1}
    summary = (pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY
               if pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY in faulty
               else pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY if faulty
               else pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY)
    clique = int(f.get("gpu_clique", {}).get(str(index), f.get("clique", DEFAULT_CLIQUE)))
    done = state == 3
    return {
        "state": state,
        # status and cluster mean something only once registration completed (nvml.h); before it the
        # simulator reports NOT_READY and a zero cluster, which every reader ignores as it must
        "status": int(f.get("status", 0)) if done else pynvml.NVML_ERROR_NOT_READY,
        "cluster": cluster_uuid(str(f.get("rack", DEFAULT_RACK))) if done else uuid.UUID(int=0),
        "clique": clique if done else 0,
        "mask": mask,
        "summary": summary,
    }


class FabricCalls(SimBase):
    """``nvmlDeviceGetGpuFabricInfo`` (v1) and ``nvmlDeviceGetGpuFabricInfoV`` (v2, v3)."""

    def _fabric(self, fname: str, handle: Any) -> dict[str, Any]:
        state = self._enter(fname)
        index = self._gpu(state, handle)[1]
        if not has_fabric(self.machine):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return current(self.machine, state, index)

    @staticmethod
    def _fill_v1(dst: Any, info: dict[str, Any]) -> None:
        for i, b in enumerate(info["cluster"].bytes):
            dst.clusterUuid[i] = b
        dst.status = info["status"]
        dst.cliqueId = info["clique"]
        dst.state = info["state"]

    def nvmlDeviceGetGpuFabricInfo(self, device: Any, gpuFabricInfo: Any) -> int:
        info = self._fabric("nvmlDeviceGetGpuFabricInfo", device)
        self._fill_v1(_deref(gpuFabricInfo), info)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuFabricInfoV(self, device: Any, gpuFabricInfo: Any) -> int:
        dst = _deref(gpuFabricInfo)
        version = int(getattr(dst, "version", 0))
        if version not in (pynvml.nvmlGpuFabricInfo_v2, pynvml.nvmlGpuFabricInfo_v3):
            self._enter("nvmlDeviceGetGpuFabricInfoV")
            raise _err(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        info = self._fabric("nvmlDeviceGetGpuFabricInfoV", device)
        self._fill_v1(dst, info)
        dst.healthMask = info["mask"]
        if version == pynvml.nvmlGpuFabricInfo_v3:
            dst.healthSummary = info["summary"]
        return int(pynvml.NVML_SUCCESS)


# --- placement, bring-up and faults (``nodeagent sim fabric`` / ``sim inject fabric``) ---------------
def _need_rack(store: SimStore) -> None:
    if store.machine.rack_nodes == 0:
        raise InputError(f"simulated machine {store.machine.name} is not a compute tray of an NVLink rack "
                         "(no rack_nodes); use gb200-nvl or gb300-nvl", subject=store.machine.name)


def place(store: SimStore, rack: str | None = None, node: int | None = None, clique: int | None = None) -> None:
    """Put this simulated node in ``rack`` (a name; equal names share a cluster UUID), node slot ``node``
    (1..rack_nodes) and ``clique``."""
    _need_rack(store)
    if rack is not None and not (0 < len(rack) <= 63 and rack.isprintable()):
        raise InputError(f"rack name must be 1..63 printable characters, got {rack!r}", subject=str(rack))
    if node is not None and not 1 <= node <= store.machine.rack_nodes:
        raise InputError(f"node slot must be 1..{store.machine.rack_nodes} (the rack's compute trays), got {node}",
                         subject=str(node))
    if clique is not None and not 0 <= clique <= MAX_CLIQUE:
        raise InputError(f"clique ID must be 0..{MAX_CLIQUE}, got {clique}", subject=str(clique))
    with store.transaction() as st:
        f = st.setdefault("fabric", {})
        for key, value in (("rack", rack), ("node", node), ("clique", clique)):
            if value is not None:
                f[key] = value


def bring_up(store: SimStore, seconds: float) -> None:
    """Restart the fabric manager's registration: NOT_STARTED for half of ``seconds``, IN_PROGRESS for the
    other half, then the held state (COMPLETED unless a fault holds another)."""
    _need_rack(store)
    if not 0 <= seconds <= 3600:
        raise InputError(f"bring-up time must be 0..3600 s, got {seconds}", subject=str(seconds))
    with store.transaction() as st:
        f = st.setdefault("fabric", {})
        f["bringup_start"] = time.time()
        f["bringup_s"] = float(seconds)


def set_fabric(store: SimStore, *, state: str | None = None, status: int | None = None,
               health: dict[str, bool] | None = None, gpu_clique: tuple[int, int | None] | None = None) -> None:
    """Faults: hold ``state`` (not-started / in-progress / completed), report ``status`` (nvmlReturn_t)
    once COMPLETED, set health-mask fields (name → TRUE/FALSE), move one GPU to another clique (None: back)."""
    _need_rack(store)
    if state is not None and state not in STATES:
        raise InputError(f"unknown fabric state {state!r}; known: {', '.join(STATES)}", subject=state)
    for name in health or {}:
        if name not in HEALTH_FAULTS:
            raise InputError(f"unknown fabric health field {name!r}; known: {', '.join(HEALTH_FAULTS)}",
                             subject=name)
    if gpu_clique is not None:
        gpu, clique = gpu_clique
        if not 0 <= gpu < len(store.machine.gpus):
            raise InputError(f"GPU {gpu} does not exist on {store.machine.name}", subject=str(gpu))
        if clique is not None and not 0 <= clique <= MAX_CLIQUE:
            raise InputError(f"clique ID must be 0..{MAX_CLIQUE}, got {clique}", subject=str(clique))
    with store.transaction() as st:
        f = st.setdefault("fabric", {})
        if state is not None:
            f["state"] = STATES[state]
            f.pop("bringup_start", None)
            f.pop("bringup_s", None)
        if status is not None:
            f["status"] = int(status)
        mask = int(f.get("health_mask", HEALTHY_MASK))
        for name, on in (health or {}).items():
            shift, width, _ = HEALTH_FAULTS[name]
            mask = (mask & ~(width << shift)) | ((1 if on else 2) << shift)
        f["health_mask"] = mask
        if gpu_clique is not None:
            overrides = f.setdefault("gpu_clique", {})
            if gpu_clique[1] is None:
                overrides.pop(str(gpu_clique[0]), None)
            else:
                overrides[str(gpu_clique[0])] = gpu_clique[1]


def heal(store: SimStore) -> None:
    """Every fabric fault undone (placement kept): COMPLETED, SUCCESS, healthy, one clique."""
    _need_rack(store)
    with store.transaction() as st:
        f = st.setdefault("fabric", {})
        for key in ("state", "status", "health_mask", "gpu_clique", "bringup_start", "bringup_s"):
            f.pop(key, None)
