"""The simulated NVML's plumbing: handles encoded in ctypes pointers, the call gate (init count, missing
functions, privileges, injected one-shot failures), lookups shared by every NVML call, and the changes of
the shared state that a reset, a reboot or an event make (``nodeagent.simulator.nvml`` has the calls)."""

from __future__ import annotations

import ctypes
import os
import threading
import time
import uuid
from typing import Any

import pynvml

from nodeagent.gpu.profiles import MigProduct, ProfileSpec, gpu_instance_id
from nodeagent.simulator.machine import SimGpuSpec, SimMachine
from nodeagent.simulator.state import MAX_EVENTS, SimStore, State

MIB = 1024 * 1024
NO_ID = 0xFFFFFFFF
FI_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
ENV_UNPRIVILEGED = "NODEAGENT_SIM_UNPRIVILEGED"  # "1": answer like NVML does for a non-root caller

# NVML functions that answer NO_PERMISSION to a non-root caller (on a MIG-enabled parent for processes)
_PRIVILEGED = frozenset(
    {
        "nvmlDeviceGetGpuInstancePossiblePlacements",
        "nvmlDeviceGetGpuInstances",
        "nvmlDeviceGetGpuInstanceById",
        "nvmlDeviceCreateGpuInstance",
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceDestroy",
        "nvmlGpuInstanceCreateComputeInstance",
        "nvmlGpuInstanceGetComputeInstances",
        "nvmlComputeInstanceDestroy",
        "nvmlDeviceSetMigMode",
        "nvmlDeviceSetComputeMode",
        "nvmlDeviceModifyDrainState",
        "nvmlDeviceSetPersistenceMode",
        "simResetGpu",
    }
)

# handle kinds, encoded in bits 40.. of the pointer value
_DEV, _MIG, _GI, _CI, _EVSET = 1, 2, 3, 4, 5


def _key(kind: int, gpu: int = 0, gi: int = 0, ci: int = 0) -> int:
    return (kind << 40) | (gpu << 16) | (gi << 8) | ci


def _ptr(value: int, ptype: Any) -> Any:
    return ctypes.cast(ctypes.c_void_p(value), ptype)


def _decode(handle: Any) -> tuple[int, int, int, int]:
    try:
        value = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        value = None
    if not value:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return value >> 40, (value >> 16) & 0xFFFFFF, (value >> 8) & 0xFF, value & 0xFF


def _deref(ref: Any) -> Any:
    """The ctypes object behind ``byref(x)``, ``pointer(x)`` or ``x`` itself."""
    if hasattr(ref, "_obj"):
        return ref._obj
    if hasattr(ref, "contents"):
        return ref.contents
    return ref


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class SimBase:
    """What every group of simulated NVML calls stands on: the store, the machine and the call gate."""

    def __init__(self, store: SimStore, *, privileged: bool | None = None) -> None:
        self.store = store
        self.machine: SimMachine = store.machine
        # like the driver: a non-root caller may read most things but not MIG administration
        self.privileged = os.environ.get(ENV_UNPRIVILEGED, "") != "1" if privileged is None else privileged
        self._products: dict[str, MigProduct] = {}
        self._init_count = 0
        self._lock = threading.Lock()
        self._event_sets: dict[int, dict[str, Any]] = {}
        self._next_event_set = 1
        self._t0 = time.monotonic()

    # Constants, structs and error classes come from pynvml itself.
    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if callable(value) and name.startswith("nvml") and not isinstance(value, type):
            raise AttributeError(f"the NVML simulator does not implement {name}")
        return value

    # --- plumbing -----------------------------------------------------------------------------
    def _enter(self, fname: str) -> State:
        if self._init_count <= 0 and fname not in ("nvmlInit", "nvmlInitWithFlags"):
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        if fname in self.machine.missing_functions:  # an older driver without the versioned symbol
            raise pynvml.NVMLLibraryMismatchError(
                "Unversioned function called and the pyNVML version does not match the NVML lib version. "
                "Either use matching pyNVML and NVML lib versions or use a versioned function such as "
                f"{fname}"
            )
        if not self.privileged and fname in _PRIVILEGED:
            raise _err(pynvml.NVML_ERROR_NO_PERMISSION)
        state = self.store.read()
        if any(f.get("function") == fname for f in state.get("fail_next", ())):
            code = 0
            with self.store.transaction() as st:
                keep = []
                for f in st["fail_next"]:
                    if f["function"] == fname and code == 0:
                        if f.get("after", 0) > 0:
                            f["after"] -= 1
                        else:
                            code = int(f["code"])
                            f["count"] -= 1
                    if f["count"] > 0:
                        keep.append(f)
                st["fail_next"] = keep
            if code:
                raise _err(code)
            state = self.store.read()
        return state

    def _spec(self, index: int) -> SimGpuSpec:
        if not 0 <= index < len(self.machine.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.machine.gpus[index]

    def _gpu(self, state: State, handle: Any, kinds: tuple[int, ...] = (_DEV,)) -> tuple[int, int, int, int]:
        kind, index, gi, ci = _decode(handle)
        if kind not in kinds:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._spec(index)
        if state["gpus"][index]["lost"]:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return kind, index, gi, ci

    def _product(self, index: int, state: State, *, need_enabled: bool = True) -> MigProduct:
        """The GPU's MIG table as this machine's driver offers it; MIG disabled: NOT_SUPPORTED."""
        product = self._spec(index).mig_product
        if product is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if need_enabled and not state["gpus"][index]["mig_current"]:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        table = self._products.get(product.key)
        if table is None:
            specs = product.specs_for_driver(self.machine.driver_version)
            table = self._products[product.key] = MigProduct(
                product.key,
                product.memory_slices,
                product.compute_slices,
                specs,
                product.pci_device_ids,
                product.total_memory_mib,
                product.memory_tolerance_mib,
                product.driver_memory,
            )
        return table

    def _profile_spec(self, index: int, state: State, name: str) -> ProfileSpec:
        spec = self._product(index, state, need_enabled=False).spec(name)
        if spec is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return spec

    @staticmethod
    def _find_gi(gs: dict[str, Any], gi_id: int) -> dict[str, Any]:
        for gi in gs["gis"]:
            if gi["id"] == gi_id:
                found: dict[str, Any] = gi
                return found
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    def _mig_pairs(self, gs: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        pairs = [(gi, ci) for gi in gs["gis"] for ci in gi["cis"]]
        return sorted(pairs, key=lambda p: (p[0]["id"], p[1]["id"]))

    def _mig_uuid(self, index: int, gi: dict[str, Any], ci: dict[str, Any]) -> str:
        name = f"{self._spec(index).uuid}/{gi['id']}/{ci['id']}/{gi['serial']}/{ci['serial']}"
        return "MIG-" + str(uuid.uuid5(uuid.NAMESPACE_OID, name))


def copy_gs(gs: dict[str, Any]) -> dict[str, Any]:
    return {**gs, "gis": list(gs["gis"])}


def _mig_device_mib(profile_mib: int, start: int, size: int) -> int:
    """A MIG device's memory as nvmlDeviceGetMemoryInfo reports it: the larger instances show a little more
    than their profile, by placement (two 3g.20gb devices: 20224 and 20096 MiB for a 19968 MiB profile)."""
    if size < 4:
        return profile_mib
    return profile_mib + (256 if start == 0 else 128)


def driver_gi_id(product: MigProduct, gs: dict[str, Any], start: int, size: int) -> int:
    """The GPU-instance id the driver gives a new instance (ids are the driver's choice; nodeagent never
    keys on them). As in the MIG user guide: on a GPU holding only one-slice instances, they are numbered
    from the upper half (an all-1g.5gb A100 shows ids 7,8,9,11,12,13,14 at starts 4,5,6,0,1,2,3); next to
    larger instances, the memory-slice tree's ids (3g at 4 → 2, 1g at 0 → 7, 2g at 2 → 4, 1g at 1 → 8)."""
    taken = {int(gi["id"]) for gi in gs["gis"]}
    plain = gpu_instance_id(product, start, size)
    candidates = [plain]
    if size == 1 and all(int(gi["size"]) == 1 for gi in gs["gis"]):
        half = product.memory_slices // 2
        candidates.insert(0, product.memory_slices - 1 + (start + half) % product.memory_slices)
    for gi_id in candidates:
        if gi_id not in taken:
            return gi_id
    first = product.memory_slices // size - 1
    return min(i for i in range(first, first + 2 * product.memory_slices) if i not in taken)


def _reset_gpu_state(gs: dict[str, Any], spec: SimGpuSpec) -> None:
    # a CC or PPCIe mode the admin tool wrote takes effect at the reset, and the GPUs stop accepting work
    if "cc_pending" in gs:
        gs["cc_mode"] = gs.pop("cc_pending")
    if "ppcie_pending" in gs:
        gs["ppcie"] = gs.pop("ppcie_pending")
    gs.pop("cc_ready", None)
    gs["gis"] = []
    gs["processes"] = []
    gs["recovery_action"] = 0
    if spec.mig_needs_reset:
        gs["mig_current"] = gs["mig_pending"]
    else:
        gs["mig_current"] = gs["mig_pending"] = False


def nvidia_owns(state: State, gpu: int) -> bool:
    """Whether the nvidia driver owns the machine's GPU ``gpu``: the simulated kernel records another driver
    (``vfio-pci`` after a bind for passthrough) in the GPU's ``driver``; NVML does not see such a GPU."""
    return str(state["gpus"][gpu].get("driver", "nvidia")) == "nvidia"


def visible_gpus(state: State, count: int) -> list[int]:
    """The machine's GPUs NVML enumerates, in order: NVML index ``i`` is the ``i``-th of them."""
    return [i for i in range(count) if nvidia_owns(state, i)]


def persistence_mode(gs: dict[str, Any], machine: SimMachine) -> int:
    """A GPU's driver persistence mode (NVML_FEATURE_ENABLED/DISABLED): as last set since the boot, else the
    boot state (enabled by the host's nvidia-persistenced, disabled, the driver's default, without it)."""
    if "persistence_mode" in gs:
        return int(gs["persistence_mode"])
    return int(pynvml.NVML_FEATURE_ENABLED if machine.persistenced else pynvml.NVML_FEATURE_DISABLED)


def reboot_state(st: State, machine: SimMachine) -> None:
    """A host reboot: instances and processes vanish, lost GPUs come back, Ampere applies a pending MIG
    mode (it persists), Hopper and later start with MIG disabled; a persistence mode set since the last boot
    is gone (the driver starts with it disabled, the host's nvidia-persistenced, if any, enables it)."""
    st["boot"] += 1
    st["fail_next"] = []
    for spec, gs in zip(machine.gpus, st["gpus"], strict=True):
        gs["lost"] = False
        gs.pop("persistence_mode", None)
        _reset_gpu_state(gs, spec)


def append_event(st: State, gpu: int, event_type: int, data: int, gi_id: int | None = None) -> None:
    st["event_seq"] += 1
    st["events"].append(
        {"seq": st["event_seq"], "gpu": gpu, "type": event_type, "data": data, "gi_id": gi_id}
    )
    del st["events"][:-MAX_EVENTS]
