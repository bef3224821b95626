"""Fault injection and layout helpers that change a simulator's state (file or memory).

These write the shared state the same way the simulated NVML does (under the lock, atomically), so a
running daemon that reads the same ``--sim-state`` file notices them on its next NVML call or event wait.
"""

from __future__ import annotations

import pynvml

from nodeagent.errors import InputError
from nodeagent.gpu.inventory import MigProfile
from nodeagent.gpu.profiles import CI_PROFILE_FOR_SLICES, MigProduct, gpu_instance_id
from nodeagent.simulator.nvml import SimulatedNvml
from nodeagent.simulator.nvml_base import append_event, reboot_state
from nodeagent.simulator.state import SimStore

XID_GPU_FALLEN_OFF_BUS = 79


def _check_gpu(store: SimStore, gpu: int) -> None:
    if not 0 <= gpu < len(store.machine.gpus):
        raise InputError(
            f"GPU {gpu} does not exist on {store.machine.name} (0..{len(store.machine.gpus) - 1})",
            subject=str(gpu),
        )


RECOVERY_ACTIONS = {  # nvmlDeviceGpuRecoveryAction_t
    "none": 0, "gpu-reset": 1, "node-reboot": 2, "drain-p2p": 3, "drain-and-reset": 4,
    "recover-imex-domain": 5, "bus-reset": 6, "system-reboot": 7,
}


def inject_xid(
    store: SimStore, gpu: int, code: int, gi_id: int | None = None, recovery_action: int | None = None
) -> None:
    """An XID critical error event on a GPU (e.g. 48 double-bit ECC, 79 fallen off the bus); with
    ``recovery_action`` the driver also asks for that recovery (field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)."""
    _check_gpu(store, gpu)
    if code <= 0:
        raise InputError(f"XID code must be positive, got {code}", subject=str(code))
    _check_action(recovery_action)
    with store.transaction() as st:
        append_event(st, gpu, int(pynvml.nvmlEventTypeXidCriticalError), code, gi_id)
        if recovery_action is not None:
            st["gpus"][gpu]["recovery_action"] = recovery_action


def set_recovery_action(store: SimStore, gpu: int, action: int) -> None:
    """Set the recovery action the driver reports for a GPU (0 = none: the GPU needs nothing)."""
    _check_gpu(store, gpu)
    _check_action(action)
    with store.transaction() as st:
        st["gpus"][gpu]["recovery_action"] = action


def _check_action(action: int | None) -> None:
    if action is not None and action not in RECOVERY_ACTIONS.values():
        known = ", ".join(f"{v} ({k})" for k, v in RECOVERY_ACTIONS.items())
        raise InputError(f"unknown GPU recovery action {action}; known: {known}", subject=str(action))


def inject_lost(store: SimStore, gpu: int) -> None:
    """The GPU falls off the bus: every NVML call on it fails with GPU_IS_LOST; an XID 79 event fires."""
    _check_gpu(store, gpu)
    with store.transaction() as st:
        st["gpus"][gpu]["lost"] = True
        append_event(st, gpu, int(pynvml.nvmlEventTypeXidCriticalError), XID_GPU_FALLEN_OFF_BUS)


def inject_process(
    store: SimStore, gpu: int, pid: int, name: str, used_mib: int = 1024, gi_id: int | None = None
) -> None:
    """A process holding a context on the GPU (or on one of its GPU instances)."""
    _check_gpu(store, gpu)
    if pid <= 0:
        raise InputError(f"pid must be positive, got {pid}", subject=str(pid))
    with store.transaction() as st:
        gs = st["gpus"][gpu]
        if gi_id is not None and not any(gi["id"] == gi_id for gi in gs["gis"]):
            raise InputError(f"GPU {gpu} has no GPU instance {gi_id}", subject=str(gi_id))
        gs["processes"] = [p for p in gs["processes"] if p["pid"] != pid]
        gs["processes"].append({"pid": pid, "name": name, "used_mib": used_mib, "gi_id": gi_id})


COMPUTE_MODES = {"DEFAULT": 0, "EXCLUSIVE_THREAD": 1, "PROHIBITED": 2, "EXCLUSIVE_PROCESS": 3}


def set_compute_mode(store: SimStore, gpu: int, mode: str) -> None:
    """``nvidia-smi -c MODE -i GPU``: the compute mode NVML reports (and the stand-in MPS daemon checks)."""
    _check_gpu(store, gpu)
    if mode not in COMPUTE_MODES:
        raise InputError(f"unknown compute mode {mode}; known: {', '.join(COMPUTE_MODES)}", subject=mode)
    with store.transaction() as st:
        st["gpus"][gpu]["compute_mode"] = COMPUTE_MODES[mode]


def set_persistence_mode(store: SimStore, gpu: int | None, enabled: bool) -> None:
    """``nvidia-smi -pm 1|0 [-i GPU]``: the driver persistence mode of one GPU (or all), until the next
    reboot gives back the boot state."""
    if gpu is not None:
        _check_gpu(store, gpu)
    with store.transaction() as st:
        for i, gs in enumerate(st["gpus"]):
            if gpu is None or i == gpu:
                gs["persistence_mode"] = 1 if enabled else 0


def hold_device(store: SimStore, gpu: int, client: str, held: bool = True) -> None:
    """A non-compute client (``nvidia-persistenced``, a DCGM agent) opens (or, ``held=False``, closes) the
    GPU's device: the driver cannot reset it by itself, so a MIG mode change stays pending (status
    IN_USE) until an explicit GPU reset (which such clients do not block) or a reboot."""
    _check_gpu(store, gpu)
    if not client:
        raise InputError("client name must not be empty")
    with store.transaction() as st:
        gs = st["gpus"][gpu]
        clients = [c for c in gs.get("clients", []) if c != client]
        gs["clients"] = [*clients, client] if held else clients


def kill_process(store: SimStore, gpu: int, pid: int | None = None) -> None:
    """End one process (or all of them) on a GPU."""
    _check_gpu(store, gpu)
    with store.transaction() as st:
        gs = st["gpus"][gpu]
        gs["processes"] = [p for p in gs["processes"] if pid is not None and p["pid"] != pid]


def recover(store: SimStore, gpu: int | None = None) -> None:
    """Undo faults: the GPU (or every GPU) is back, without processes; pending call failures are dropped."""
    if gpu is not None:
        _check_gpu(store, gpu)
    with store.transaction() as st:
        for i, gs in enumerate(st["gpus"]):
            if gpu is None or i == gpu:
                gs["lost"] = False
                gs["processes"] = []
                gs["recovery_action"] = 0
        if gpu is None:
            st["fail_next"] = []


def fail_next(store: SimStore, function: str, code: int, count: int = 1, after: int = 0) -> None:
    """Make the next ``count`` calls of NVML function ``function`` fail with NVML error ``code``,
    after letting ``after`` calls of it succeed first (to fail a multi-step change midway)."""
    if not function.startswith(("nvml", "sim")) or not callable(getattr(SimulatedNvml, function, None)):
        raise InputError(f"the NVML simulator has no function {function!r}", subject=function)
    if code not in pynvml.NVMLError._valClassMapping:
        raise InputError(f"unknown NVML error code {code}", subject=str(code))
    if count < 1 or after < 0:
        raise InputError("count must be >= 1 and after >= 0")
    with store.transaction() as st:
        st["fail_next"].append({"function": function, "code": int(code), "count": count, "after": after})


def reboot(store: SimStore) -> None:
    """Reboot the simulated host (instances gone; Ampere pending MIG mode applied)."""
    with store.transaction() as st:
        reboot_state(st, store.machine)


def write_mig_layout(store: SimStore, gpu: int, profiles: list[str]) -> None:
    """Enable MIG on a GPU (immediately, as after a reset) and lay out the given profiles with full-size
    compute instances, replacing any previous instances. For tests and demos; ``mig apply`` is the real way.

    Placements are chosen largest profile first, lowest free start; a layout that does not fit is an
    InputError and changes nothing.
    """
    _check_gpu(store, gpu)
    spec = store.machine.gpus[gpu]
    product = spec.mig_product
    if product is None:
        raise InputError(f"GPU {gpu} ({spec.name}) is not MIG-capable", subject=str(gpu))
    wanted = []
    for name in profiles:
        prof = product.profile(name)
        if prof is None:
            known = ", ".join(p.name for p in product.profiles)
            raise InputError(f"profile {name!r} does not exist on {spec.name}; known: {known}", subject=name)
        wanted.append(prof)
    wanted.sort(key=lambda p: (-p.placement_size, -p.slice_count))
    chosen = _place(product, wanted, [], set())
    if chosen is None:
        raise InputError(f"MIG layout {profiles} does not fit on GPU {gpu} ({spec.name})", subject=str(gpu))
    with store.transaction() as st:
        gs = st["gpus"][gpu]
        if gs["processes"]:
            raise InputError(f"GPU {gpu} has running processes; recover it first", subject=str(gpu))
        gs["mig_current"] = gs["mig_pending"] = bool(profiles) or gs["mig_current"]
        gs["gis"] = []
        for prof, start in chosen:
            st["serial"] += 1
            gi_id = gpu_instance_id(product, start, prof.placement_size)
            gs["gis"].append(
                {
                    "id": gi_id,
                    "profile_id": prof.id,
                    "start": start,
                    "size": prof.placement_size,
                    "serial": st["serial"],
                    "cis": [
                        {
                            "id": 0,
                            "profile_id": CI_PROFILE_FOR_SLICES[prof.slice_count],
                            "slices": prof.slice_count,
                            "start": 0,
                            "serial": st["serial"],
                        }
                    ],
                }
            )
        gs["gis"].sort(key=lambda g: g["id"])


def _place(
    product: MigProduct, todo: list[MigProfile], chosen: list[tuple[MigProfile, int]], occupied: set[int]
) -> list[tuple[MigProfile, int]] | None:
    """First placement of all ``todo`` profiles (backtracking, highest start first like the driver)."""
    if not todo:
        return chosen
    prof, rest = todo[0], todo[1:]
    if sum(1 for p, _ in chosen if p.id == prof.id) >= prof.instance_count:
        return None
    if sum(p.slice_count for p, _ in chosen) + prof.slice_count > product.compute_slices:
        return None
    for start in sorted(prof.placement_starts, reverse=True):
        span = set(range(start, start + prof.placement_size))
        if not span & occupied:
            found = _place(product, rest, [*chosen, (prof, start)], occupied | span)
            if found is not None:
                return found
    return None


def set_mig_mode(store: SimStore, gpu: int, enabled: bool) -> None:
    """Set a GPU's MIG mode as if it had been applied and the GPU reset (no instances remain)."""
    _check_gpu(store, gpu)
    if store.machine.gpus[gpu].mig_product is None:
        raise InputError(f"GPU {gpu} is not MIG-capable", subject=str(gpu))
    with store.transaction() as st:
        gs = st["gpus"][gpu]
        gs["mig_current"] = gs["mig_pending"] = enabled
        gs["gis"] = []
