"""A simulated NVML that answers like pynvml does, for one simulated machine.

``SimulatedNvml`` is a module-like object: the NVML functions the adapter calls are methods with
pynvml's names and signatures, and every other attribute (constants, ctypes structs, ``NVMLError`` and
its subclasses) is pynvml's own. Handles are the same ctypes pointer types pynvml returns, with the
simulated object encoded in the pointer value, so arrays of handles work exactly like on hardware.

Behaviour follows nodeagent/gpu/FACTS.md: MIG profiles, placements and remaining capacity from
``nodeagent.gpu.profiles`` (for the machine's driver); overlapping instances fail with
NVML_ERROR_INSUFFICIENT_RESOURCES; MIG mode changes are current at once on an idle bare-metal GPU, pending
(status IN_USE) while processes or other clients hold it, and pending with RESET_REQUIRED in a passthrough
VM; a pending mode applies at a GPU reset (``simResetGpu``, Ampere; Hopper forgets the mode) or reboot
(``simReboot``); instances never survive either. MIG disabled, GPU-instance calls answer NOT_SUPPORTED; a
non-root caller (``privileged=False`` or NODEAGENT_SIM_UNPRIVILEGED=1) gets NO_PERMISSION where the driver
gives it; GPU-instance ids are numbered as the driver does in the MIG user guide's examples. Faults (XID
events with a recovery action, lost GPUs, processes, held devices, one-shot call failures) are written
into the shared state by ``nodeagent.gpu.sim.inject``; a machine may lack versioned NVML functions
(``missing_functions``: NVMLLibraryMismatchError).

Extensions beyond NVML are named ``sim*``.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
import uuid
from typing import Any

import pynvml

from nodeagent.gpu.profiles import CI_PROFILE_FOR_SLICES, MigProduct, ProfileSpec, gpu_instance_id
from nodeagent.gpu.sim.machine import SimGpuSpec, SimMachine
from nodeagent.gpu.sim.state import MAX_EVENTS, SimStore, State

MIB = 1024 * 1024
NO_ID = 0xFFFFFFFF
FI_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
ENV_UNPRIVILEGED = "NODEAGENT_SIM_UNPRIVILEGED"  # "1": answer like NVML does for a non-root caller

# NVML functions that answer NO_PERMISSION to a non-root caller (on a MIG-enabled parent for processes)
_PRIVILEGED = frozenset({
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
    "simResetGpu",
})

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


class SimulatedNvml:
    """pynvml for a simulated machine; pass it to ``NvmlAdapter`` in place of the pynvml module."""

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
                product.key, product.memory_slices, product.compute_slices, specs, product.pci_device_ids,
                product.total_memory_mib, product.memory_tolerance_mib, product.driver_memory,
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

    # --- init / system ------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._init_count += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self._init_count += 1

    def nvmlShutdown(self) -> None:
        if self._init_count <= 0:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        self._init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.machine.driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._enter("nvmlSystemGetNVMLVersion")
        return "12." + self.machine.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.machine.cuda_driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return self.machine.cuda_driver_version

    # --- device identity ----------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.machine.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._enter("nvmlDeviceGetHandleByIndex")
        self._spec(index)  # a lost GPU still has a handle; calls on it fail with GPU_IS_LOST
        return _ptr(_key(_DEV, index), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetHandleByUUID(self, uuid_str: str | bytes) -> Any:
        self._enter("nvmlDeviceGetHandleByUUID")
        want = uuid_str.decode() if isinstance(uuid_str, bytes) else uuid_str
        for g in self.machine.gpus:
            if g.uuid == want:
                return self.nvmlDeviceGetHandleByIndex(g.index)
        if want.startswith("MIG-"):  # NVML hands out MIG device handles by MIG UUID too
            state = self.store.read()
            for g in self.machine.gpus:
                gs = state["gpus"][g.index]
                if gs["lost"] or not gs["mig_current"]:
                    continue
                for gi, ci in self._mig_pairs(gs):
                    if self._mig_uuid(g.index, gi, ci) == want:
                        return _ptr(_key(_MIG, g.index, gi["id"], ci["id"]), pynvml.c_nvmlDevice_t)
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str | bytes) -> Any:
        self._enter("nvmlDeviceGetHandleByPciBusId")
        want = (bus_id.decode() if isinstance(bus_id, bytes) else bus_id).upper()
        for g in self.machine.gpus:
            if g.bus_id == want or g.bus_id[4:] == want:
                return self.nvmlDeviceGetHandleByIndex(g.index)
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        state = self._enter("nvmlDeviceGetIndex")
        return self._gpu(state, handle)[1]

    def nvmlDeviceGetName(self, handle: Any) -> str:
        state = self._enter("nvmlDeviceGetName")
        kind, index, gi_id, _ = self._gpu(state, handle, (_DEV, _MIG))
        spec = self._spec(index)
        if kind == _MIG:
            gi = self._find_gi(state["gpus"][index], gi_id)
            product = self._product(index, state)
            prof = product.profile_by_id(gi["profile_id"])
            return f"{spec.name} MIG {prof.name if prof else '?'}"
        return spec.name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        state = self._enter("nvmlDeviceGetUUID")
        kind, index, gi_id, ci_id = self._gpu(state, handle, (_DEV, _MIG))
        if kind == _MIG:
            gi = self._find_gi(state["gpus"][index], gi_id)
            for ci in gi["cis"]:
                if ci["id"] == ci_id:
                    return self._mig_uuid(index, gi, ci)
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return self._spec(index).uuid

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        state = self._enter("nvmlDeviceGetMinorNumber")
        return self._gpu(state, handle)[1]

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        state = self._enter("nvmlDeviceGetPciInfo")
        spec = self._spec(self._gpu(state, handle)[1])
        return self._pci_info(spec)

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    @staticmethod
    def _pci_info(spec: SimGpuSpec) -> Any:
        info = pynvml.nvmlPciInfo_t()
        domain, bus, device = spec.bus_tuple
        info.busId = spec.bus_id.encode()
        info.busIdLegacy = spec.bus_id[4:].encode()
        info.domain, info.bus, info.device = domain, bus, device
        info.pciDeviceId = spec.pci_device_id
        info.pciSubSystemId = spec.pci_subsystem_id
        return info

    def nvmlDeviceGetArchitecture(self, handle: Any) -> int:
        state = self._enter("nvmlDeviceGetArchitecture")
        return self._spec(self._gpu(state, handle)[1]).arch_nvml

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        state = self._enter("nvmlDeviceGetCudaComputeCapability")
        return self._spec(self._gpu(state, handle, (_DEV, _MIG))[1]).compute_capability

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        state = self._enter("nvmlDeviceGetNumaNodeId")
        numa = self._spec(self._gpu(state, handle)[1]).numa
        if numa is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return numa

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        state = self._enter("nvmlDeviceGetMemoryInfo")
        kind, index, gi_id, _ = self._gpu(state, handle, (_DEV, _MIG))
        gs = state["gpus"][index]
        if kind == _MIG:
            gi = self._find_gi(gs, gi_id)
            prof = self._product(index, state).profile_by_id(gi["profile_id"])
            total = (_mig_device_mib(prof.memory_mib, gi["start"], gi["size"]) if prof else 0) * MIB
            used_mib = sum(p["used_mib"] for p in gs["processes"] if p.get("gi_id") == gi_id)
        else:
            total = self._spec(index).memory_mib * MIB
            used_mib = sum(p["used_mib"] for p in gs["processes"])
        mem = pynvml.c_nvmlMemory_t()
        used = min(total, (used_mib + (0 if kind == _MIG else 5)) * MIB)
        mem.total, mem.used, mem.free = total, used, total - used
        return mem

    # --- simulated metrics --------------------------------------------------------------------
    def _load(self, index: int, state: State) -> float:
        """Utilisation 0..1: zero when idle, a slow wave between 40% and 95% while processes run."""
        if not state["gpus"][index]["processes"]:
            return 0.0
        t = time.monotonic() - self._t0
        return 0.675 + 0.275 * math.sin(t / 7.0 + index * 1.3)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        state = self._enter("nvmlDeviceGetUtilizationRates")
        index = self._gpu(state, handle)[1]
        if state["gpus"][index]["mig_current"]:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # "N/A" in nvidia-smi: no whole-GPU figure in MIG mode
        load = self._load(index, state)
        util = pynvml.c_nvmlUtilization_t()
        util.gpu = round(load * 100)
        util.memory = round(load * 60)
        return util

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        state = self._enter("nvmlDeviceGetTemperature")
        index = self._gpu(state, handle)[1]
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return round(31 + index % 3 + 45 * self._load(index, state))

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        state = self._enter("nvmlDeviceGetPowerUsage")
        index = self._gpu(state, handle)[1]
        spec = self._spec(index)
        watts = spec.power_idle_w + (spec.power_max_w - spec.power_idle_w) * self._load(index, state)
        return round(watts * 1000)  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        state = self._enter("nvmlDeviceGetEnforcedPowerLimit")
        return self._spec(self._gpu(state, handle)[1]).power_max_w * 1000

    # --- processes ----------------------------------------------------------------------------
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses", handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v2", handle)

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any) -> list[Any]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v3", handle)

    def _processes(self, fname: str, handle: Any) -> list[Any]:
        state = self._enter(fname)
        kind, index, gi_id, _ = self._gpu(state, handle, (_DEV, _MIG))
        if kind == _DEV and not self.privileged and state["gpus"][index]["mig_current"]:
            raise _err(pynvml.NVML_ERROR_NO_PERMISSION)
        out = []
        for p in state["gpus"][index]["processes"]:
            if kind == _MIG and p.get("gi_id") != gi_id:
                continue
            out.append(
                pynvml.nvmlFriendlyObject(
                    {
                        "pid": p["pid"],
                        "usedGpuMemory": p["used_mib"] * MIB,
                        "gpuInstanceId": NO_ID if p.get("gi_id") is None else p["gi_id"],
                        "computeInstanceId": NO_ID if p.get("gi_id") is None else 0,
                        "name": p["name"],  # a simulator extra; real NVML gives no process name
                    }
                )
            )
        return out


    # --- topology -----------------------------------------------------------------------------
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        state = self._enter("nvmlDeviceGetTopologyCommonAncestor")
        a = self._spec(self._gpu(state, device1)[1])
        b = self._spec(self._gpu(state, device2)[1])
        if a.index == b.index:
            return int(pynvml.NVML_TOPOLOGY_INTERNAL)
        if a.switch == b.switch:
            return self.machine.pcie_switch_level
        if a.numa == b.numa and a.numa is not None:
            return int(pynvml.NVML_TOPOLOGY_NODE)
        return int(pynvml.NVML_TOPOLOGY_SYSTEM)

    def _link_target(self, index: int, link: int) -> tuple[str, int]:
        """What NVLink ``link`` of GPU ``index`` connects to: ("switch", n) or ("gpu", peer)."""
        spec = self._spec(index)
        if spec.nvlinks == 0 or self.machine.nvlink_fabric == "none":
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < pynvml.NVML_NVLINK_MAX_LINKS:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.machine.nvlink_fabric == "nvswitch":
            if link >= spec.nvlinks:
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return "switch", link % 4
        peers = self.machine.nvlink_peers(index)
        if link >= spec.nvlinks * len(peers):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return "gpu", peers[link // spec.nvlinks]

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        state = self._enter("nvmlDeviceGetNvLinkState")
        index = self._gpu(state, device)[1]
        kind, target = self._link_target(index, link)
        if kind == "gpu" and state["gpus"][target]["lost"]:
            return int(pynvml.NVML_FEATURE_DISABLED)
        return int(pynvml.NVML_FEATURE_ENABLED)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, device: Any, link: int) -> int:
        state = self._enter("nvmlDeviceGetNvLinkRemoteDeviceType")
        kind, _ = self._link_target(self._gpu(state, device)[1], link)
        return int(pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH if kind == "switch" else pynvml.NVML_NVLINK_DEVICE_TYPE_GPU)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> Any:
        state = self._enter("nvmlDeviceGetNvLinkRemotePciInfo")
        kind, target = self._link_target(self._gpu(state, device)[1], link)
        if kind == "gpu":
            return self._pci_info(self._spec(target))
        info = pynvml.nvmlPciInfo_t()  # an NVSwitch chip
        bus = 0xC0 + target
        info.busId = f"00000000:{bus:02X}:00.0".encode()
        info.busIdLegacy = f"0000:{bus:02X}:00.0".encode()
        info.bus = bus
        info.pciDeviceId = 0x22A310DE
        return info

    # --- MIG mode -----------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        state = self._enter("nvmlDeviceGetMigMode")
        index = self._gpu(state, handle)[1]
        self._product(index, state, need_enabled=False)
        gs = state["gpus"][index]
        return [int(gs["mig_current"]), int(gs["mig_pending"])]

    def nvmlDeviceSetMigMode(self, handle: Any, mode: int) -> int:
        """Sets the pending mode and returns the activation status like NVML does on hardware.

        Bare metal, idle GPU: the driver resets it (Ampere) or switches at once (Hopper and later), the mode
        is current, status SUCCESS. Processes running, or another client holding the device (a monitoring
        agent, nvidia-persistenced; ``inject.hold_device``): the pending mode is set, status IN_USE — the
        GPU switches at its next reset or reboot. A passthrough VM cannot reset the GPU: pending set, status
        RESET_REQUIRED. Disabling MIG while GPU instances exist fails with IN_USE.
        """
        state = self._enter("nvmlDeviceSetMigMode")
        index = self._gpu(state, handle)[1]
        self._product(index, state, need_enabled=False)
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        want = bool(mode)
        with self.store.transaction() as st:
            gs = st["gpus"][index]
            if not want and gs["gis"]:
                raise _err(pynvml.NVML_ERROR_IN_USE)
            gs["mig_pending"] = want
            if gs["mig_current"] == want:
                return int(pynvml.NVML_SUCCESS)
            if gs["processes"] or gs.get("clients"):  # e.g. nvidia-persistenced or DCGM holding the device
                return int(pynvml.NVML_ERROR_IN_USE)
            if self.machine.passthrough and self._spec(index).mig_needs_reset:
                return int(pynvml.NVML_ERROR_RESET_REQUIRED)
            gs["mig_current"] = want
        return int(pynvml.NVML_SUCCESS)

    # --- GPU instance profiles ----------------------------------------------------------------
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        state = self._enter("nvmlDeviceGetGpuInstanceProfileInfo")
        index = self._gpu(state, device)[1]
        product = self._product(index, state)  # MIG disabled: NOT_SUPPORTED, as on hardware
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        prof = product.profile_by_index(profile)
        if prof is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        spec = self._profile_spec(index, state, prof.name)
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else pynvml.c_nvmlGpuInstanceProfileInfo_t()
        info.id = prof.id
        info.isP2pSupported = 0
        info.sliceCount = prof.slice_count
        info.instanceCount = prof.instance_count
        info.multiprocessorCount = spec.multiprocessors
        info.copyEngineCount = spec.copy_engines
        info.decoderCount = spec.decoders
        info.jpegCount = spec.jpeg
        info.ofaCount = spec.ofa
        info.encoderCount = spec.encoders
        info.memorySizeMB = prof.memory_mib
        if version == 2:
            info.name = f"MIG {prof.name}".encode()
        return info

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def _profile_by_id(self, index: int, state: State, profile_id: int, *, need_enabled: bool) -> Any:
        prof = self._product(index, state, need_enabled=need_enabled).profile_by_id(profile_id)
        if prof is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return prof

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        """The _v2 semantics: every placement of the profile, occupied or not, MIG on or off."""
        state = self._enter("nvmlDeviceGetGpuInstancePossiblePlacements")
        index = self._gpu(state, device)[1]
        prof = self._profile_by_id(index, state, profileId, need_enabled=False)
        count = _deref(countRef)
        if placementsRef is None:
            count.value = len(prof.placement_starts)
            return int(pynvml.NVML_SUCCESS)
        if count.value < len(prof.placement_starts):
            count.value = len(prof.placement_starts)
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        array = _deref(placementsRef)
        for i, start in enumerate(prof.placement_starts):
            array[i].start = start
            array[i].size = prof.placement_size
        count.value = len(prof.placement_starts)
        return int(pynvml.NVML_SUCCESS)

    @staticmethod
    def _occupied(gs: dict[str, Any]) -> set[int]:
        return {s for gi in gs["gis"] for s in range(gi["start"], gi["start"] + gi["size"])}

    def _fits(self, product: MigProduct, gs: dict[str, Any], prof: Any, start: int) -> bool:
        if start not in prof.placement_starts:
            return False
        if self._occupied(gs) & set(range(start, start + prof.placement_size)):
            return False
        if sum(1 for gi in gs["gis"] if gi["profile_id"] == prof.id) >= prof.instance_count:
            return False
        used_compute = 0
        for gi in gs["gis"]:
            other = product.profile_by_id(gi["profile_id"])
            used_compute += other.slice_count if other else 0
        return bool(used_compute + prof.slice_count <= product.compute_slices)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int:
        state = self._enter("nvmlDeviceGetGpuInstanceRemainingCapacity")
        index = self._gpu(state, device)[1]
        product = self._product(index, state)
        prof = self._profile_by_id(index, state, profileId, need_enabled=True)
        gs = copy_gs(state["gpus"][index])
        n = 0
        for start in prof.placement_starts:  # placements of one profile never overlap each other
            if self._fits(product, gs, prof, start):
                gs["gis"].append({"profile_id": prof.id, "start": start, "size": prof.placement_size})
                n += 1
        return n

    # --- GPU instances ------------------------------------------------------------------------
    def _create_gi(self, fname: str, device: Any, profile_id: int, start: int | None) -> Any:
        state = self._enter(fname)
        index = self._gpu(state, device)[1]
        product = self._product(index, state)
        prof = self._profile_by_id(index, state, profile_id, need_enabled=True)
        with self.store.transaction() as st:
            gs = st["gpus"][index]
            if start is None:
                # NVML picks the placement: like the driver in the MIG user guide's examples, the upper
                # half of the memory slices first, then the lower half, each from its lowest start
                half = product.memory_slices // 2
                order = sorted(prof.placement_starts, key=lambda s: (s < half, s))
                candidates = [s for s in order if self._fits(product, gs, prof, s)]
                if not candidates:
                    raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
                start = candidates[0]
            elif start not in prof.placement_starts:
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            elif not self._fits(product, gs, prof, start):
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            gi_id = driver_gi_id(product, gs, start, prof.placement_size)
            st["serial"] += 1
            gs["gis"].append(
                {
                    "id": gi_id,
                    "profile_id": prof.id,
                    "start": start,
                    "size": prof.placement_size,
                    "serial": st["serial"],
                    "cis": [],
                }
            )
            gs["gis"].sort(key=lambda g: g["id"])
        return _ptr(_key(_GI, index, gi_id), pynvml.c_nvmlGpuInstance_t)

    def nvmlDeviceCreateGpuInstance(self, device: Any, profileId: int) -> Any:
        return self._create_gi("nvmlDeviceCreateGpuInstance", device, profileId, None)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int, placement: Any) -> Any:
        p = _deref(placement)
        return self._create_gi("nvmlDeviceCreateGpuInstanceWithPlacement", device, profileId, int(p.start))

    def nvmlDeviceGetGpuInstances(self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any) -> int:
        state = self._enter("nvmlDeviceGetGpuInstances")
        index = self._gpu(state, device)[1]
        self._profile_by_id(index, state, profileId, need_enabled=True)
        found = [gi for gi in state["gpus"][index]["gis"] if gi["profile_id"] == profileId]
        count = _deref(countRef)
        array = _deref(gpuInstancesRef)
        if len(array) < len(found):
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, gi in enumerate(found):
            array[i] = _ptr(_key(_GI, index, gi["id"]), pynvml.c_nvmlGpuInstance_t)
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        state = self._enter("nvmlDeviceGetGpuInstanceById")
        index = self._gpu(state, device)[1]
        self._product(index, state)
        self._find_gi(state["gpus"][index], gpuInstanceId)
        return _ptr(_key(_GI, index, gpuInstanceId), pynvml.c_nvmlGpuInstance_t)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        state = self._enter("nvmlGpuInstanceGetInfo")
        _, index, gi_id, _ = self._gpu(state, gpuInstance, (_GI,))
        gi = self._find_gi(state["gpus"][index], gi_id)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = _ptr(_key(_DEV, index), pynvml.c_nvmlDevice_t)
        info.id = gi["id"]
        info.profileId = gi["profile_id"]
        info.placement.start = gi["start"]
        info.placement.size = gi["size"]
        return info

    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        state = self._enter("nvmlGpuInstanceDestroy")
        _, index, gi_id, _ = self._gpu(state, gpuInstance, (_GI,))
        with self.store.transaction() as st:
            gs = st["gpus"][index]
            gi = self._find_gi(gs, gi_id)
            if gi["cis"] or any(p.get("gi_id") == gi_id for p in gs["processes"]):
                raise _err(pynvml.NVML_ERROR_IN_USE)
            gs["gis"].remove(gi)
        return int(pynvml.NVML_SUCCESS)

    # --- compute instances --------------------------------------------------------------------
    def _gi_profile(self, state: State, index: int, gi_id: int) -> Any:
        gi = self._find_gi(state["gpus"][index], gi_id)
        return self._profile_by_id(index, state, gi["profile_id"], need_enabled=True)

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        state = self._enter("nvmlGpuInstanceGetComputeInstanceProfileInfo")
        _, index, gi_id, _ = self._gpu(state, device, (_GI,))
        gi_prof = self._gi_profile(state, index, gi_id)
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        slices = {v: k for k, v in CI_PROFILE_FOR_SLICES.items()}.get(profile)
        if slices is None or slices > gi_prof.slice_count:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = (
            pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            if version == 2
            else pynvml.c_nvmlComputeInstanceProfileInfo_t()
        )
        info.id = profile
        info.sliceCount = slices
        info.instanceCount = gi_prof.slice_count // slices
        gi_spec = self._profile_spec(index, state, gi_prof.name)
        info.multiprocessorCount = gi_spec.multiprocessors * slices // gi_prof.slice_count
        if version == 2:
            suffix = "" if slices == gi_prof.slice_count else f"c.{gi_prof.name}"
            info.name = (f"MIG {gi_prof.name}" if not suffix else f"MIG {slices}{suffix}").encode()
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, gpuInstance: Any, profileId: int) -> int:
        state = self._enter("nvmlGpuInstanceGetComputeInstanceRemainingCapacity")
        _, index, gi_id, _ = self._gpu(state, gpuInstance, (_GI,))
        gi_prof = self._gi_profile(state, index, gi_id)
        gi = self._find_gi(state["gpus"][index], gi_id)
        slices = {v: k for k, v in CI_PROFILE_FOR_SLICES.items()}.get(profileId)
        if slices is None or slices > gi_prof.slice_count:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        used = sum(ci["slices"] for ci in gi["cis"])
        return int((gi_prof.slice_count - used) // slices)

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        state = self._enter("nvmlGpuInstanceCreateComputeInstance")
        _, index, gi_id, _ = self._gpu(state, gpuInstance, (_GI,))
        gi_prof = self._gi_profile(state, index, gi_id)
        slices = {v: k for k, v in CI_PROFILE_FOR_SLICES.items()}.get(profileId)
        if slices is None or slices > gi_prof.slice_count:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self.store.transaction() as st:
            gi = self._find_gi(st["gpus"][index], gi_id)
            used = sum(ci["slices"] for ci in gi["cis"])
            if used + slices > gi_prof.slice_count:
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            taken = {ci["id"] for ci in gi["cis"]}
            ci_id = min(i for i in range(8) if i not in taken)
            st["serial"] += 1
            gi["cis"].append(
                {"id": ci_id, "profile_id": profileId, "slices": slices, "start": used, "serial": st["serial"]}
            )
        return _ptr(_key(_CI, index, gi_id, ci_id), pynvml.c_nvmlComputeInstance_t)

    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        state = self._enter("nvmlGpuInstanceGetComputeInstances")
        _, index, gi_id, _ = self._gpu(state, gpuInstance, (_GI,))
        gi = self._find_gi(state["gpus"][index], gi_id)
        found = [ci for ci in gi["cis"] if ci["profile_id"] == profileId]
        count = _deref(countRef)
        array = _deref(computeInstancesRef)
        if len(array) < len(found):
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, ci in enumerate(found):
            array[i] = _ptr(_key(_CI, index, gi_id, ci["id"]), pynvml.c_nvmlComputeInstance_t)
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: Any, computeInstanceId: int) -> Any:
        state = self._enter("nvmlGpuInstanceGetComputeInstanceById")
        _, index, gi_id, _ = self._gpu(state, gpuInstance, (_GI,))
        gi = self._find_gi(state["gpus"][index], gi_id)
        if not any(ci["id"] == computeInstanceId for ci in gi["cis"]):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return _ptr(_key(_CI, index, gi_id, computeInstanceId), pynvml.c_nvmlComputeInstance_t)

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        state = self._enter("nvmlComputeInstanceGetInfo")
        _, index, gi_id, ci_id = self._gpu(state, computeInstance, (_CI,))
        gi = self._find_gi(state["gpus"][index], gi_id)
        for ci in gi["cis"]:
            if ci["id"] == ci_id:
                info = pynvml.c_nvmlComputeInstanceInfo_t()
                info.device = _ptr(_key(_DEV, index), pynvml.c_nvmlDevice_t)
                info.gpuInstance = _ptr(_key(_GI, index, gi_id), pynvml.c_nvmlGpuInstance_t)
                info.id = ci_id
                info.profileId = ci["profile_id"]
                info.placement.start = ci["start"]
                info.placement.size = ci["slices"]
                return info
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo

    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        state = self._enter("nvmlComputeInstanceDestroy")
        _, index, gi_id, ci_id = self._gpu(state, computeInstance, (_CI,))
        with self.store.transaction() as st:
            gs = st["gpus"][index]
            gi = self._find_gi(gs, gi_id)
            if any(p.get("gi_id") == gi_id for p in gs["processes"]):
                raise _err(pynvml.NVML_ERROR_IN_USE)
            before = len(gi["cis"])
            gi["cis"] = [ci for ci in gi["cis"] if ci["id"] != ci_id]
            if len(gi["cis"]) == before:
                raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return int(pynvml.NVML_SUCCESS)

    # --- MIG device handles -------------------------------------------------------------------
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        state = self._enter("nvmlDeviceGetMaxMigDeviceCount")
        index = self._gpu(state, device)[1]
        product = self._spec(index).mig_product
        return product.max_mig_devices if product and state["gpus"][index]["mig_current"] else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        state = self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        gpu = self._gpu(state, device)[1]
        self._product(gpu, state, need_enabled=False)  # no MIG at all: NOT_SUPPORTED
        # MIG disabled: no MIG device at any index, NOT_FOUND as NVML says (go-nvlib skips that answer)
        pairs = self._mig_pairs(state["gpus"][gpu]) if state["gpus"][gpu]["mig_current"] else []
        if not 0 <= index < len(pairs):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        gi, ci = pairs[index]
        return _ptr(_key(_MIG, gpu, gi["id"], ci["id"]), pynvml.c_nvmlDevice_t)

    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> Any:
        """A ctypes ``c_uint``, as pynvml returns it (not a Python bool or int)."""
        state = self._enter("nvmlDeviceIsMigDeviceHandle")
        return ctypes.c_uint(int(self._gpu(state, device, (_DEV, _MIG))[0] == _MIG))

    # --- field values -------------------------------------------------------------------------
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        """Only NVML_FI_DEV_GET_GPU_RECOVERY_ACTION answers; other fields carry NOT_SUPPORTED."""
        state = self._enter("nvmlDeviceGetFieldValues")
        index = self._gpu(state, handle)[1]
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for i, field_id in enumerate(fieldIds):
            fid = int(field_id[0] if isinstance(field_id, tuple) else field_id)
            values[i].fieldId = fid
            if fid == FI_RECOVERY_ACTION:
                values[i].nvmlReturn = pynvml.NVML_SUCCESS
                values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = int(state["gpus"][index].get("recovery_action", 0))
            else:
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        state = self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        index = self._gpu(state, migDevice, (_MIG,))[1]
        return _ptr(_key(_DEV, index), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        state = self._enter("nvmlDeviceGetGpuInstanceId")
        return self._gpu(state, device, (_MIG,))[2]

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        state = self._enter("nvmlDeviceGetComputeInstanceId")
        return self._gpu(state, device, (_MIG,))[3]

    # --- events -------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> Any:
        state = self._enter("nvmlEventSetCreate")
        with self._lock:
            n = self._next_event_set
            self._next_event_set += 1
            self._event_sets[n] = {"devices": {}, "cursor": state["event_seq"]}
        return _ptr(_key(_EVSET, 0, 0, 0) | n, pynvml.c_nvmlEventSet_t)

    def _event_set(self, eventSet: Any) -> dict[str, Any]:
        kind, gpu, gi, ci = _decode(eventSet)
        n = (gpu << 16) | (gi << 8) | ci
        if kind != _EVSET or n not in self._event_sets:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._event_sets[n]

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        state = self._enter("nvmlDeviceGetSupportedEventTypes")
        self._gpu(state, handle)
        return int(
            pynvml.nvmlEventTypeXidCriticalError
            | pynvml.nvmlEventTypeSingleBitEccError
            | pynvml.nvmlEventTypeDoubleBitEccError
        )

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        state = self._enter("nvmlDeviceRegisterEvents")
        index = self._gpu(state, handle)[1]
        with self._lock:
            es = self._event_set(eventSet)
            es["devices"][index] = es["devices"].get(index, 0) | int(eventTypes)

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        """Wait for the next event on a registered GPU; Timeout error if none arrives in ``timeoutms``.

        Between looks at the state the thread sleeps until the state changes (inotify on the shared file),
        so an idle waiter costs nothing and an injected XID is seen within milliseconds.
        """
        self._enter("nvmlEventSetWait_v2")
        deadline = time.monotonic() + max(0, timeoutms) / 1000.0
        seen = self.store.change_marker() if timeoutms > 0 else 0
        while True:
            with self._lock:
                es = self._event_set(eventSet)
                state = self.store.read()
                for ev in state["events"]:
                    if ev["seq"] <= es["cursor"]:
                        continue
                    es["cursor"] = ev["seq"]
                    mask = es["devices"].get(ev["gpu"], 0)
                    if mask & ev["type"]:
                        data = pynvml.c_nvmlEventData_t()
                        data.device = _ptr(_key(_DEV, ev["gpu"]), pynvml.c_nvmlDevice_t)
                        data.eventType = ev["type"]
                        data.eventData = ev["data"]
                        data.gpuInstanceId = NO_ID if ev.get("gi_id") is None else ev["gi_id"]
                        data.computeInstanceId = NO_ID if ev.get("ci_id") is None else ev["ci_id"]
                        return data
                if state["event_seq"] > es["cursor"]:
                    es["cursor"] = state["event_seq"]  # events trimmed from the log are lost, like overflow
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _err(pynvml.NVML_ERROR_TIMEOUT)
            seen = self.store.wait_change(seen, remaining)

    nvmlEventSetWait = nvmlEventSetWait_v2

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._enter("nvmlEventSetFree")
        with self._lock:
            _kind, gpu, gi, ci = _decode(eventSet)
            self._event_set(eventSet)
            del self._event_sets[(gpu << 16) | (gi << 8) | ci]

    # --- simulator extensions -----------------------------------------------------------------
    def simResetGpu(self, handle: Any) -> None:
        """What ``nvidia-smi --gpu-reset -i N`` does: fails while processes run; drops all instances;
        applies a pending MIG mode (Ampere) or forgets the MIG mode (Hopper and later)."""
        state = self._enter("simResetGpu")
        index = self._gpu(state, handle)[1]
        if self.machine.passthrough:
            raise _err(pynvml.NVML_ERROR_RESET_REQUIRED)  # no GPU reset from inside the guest: reboot
        with self.store.transaction() as st:
            gs = st["gpus"][index]
            if gs["processes"]:
                raise _err(pynvml.NVML_ERROR_IN_USE)
            _reset_gpu_state(gs, self._spec(index))

    def simReboot(self) -> None:
        """Reboot the machine (see ``nodeagent.gpu.sim.inject.reboot``)."""
        with self.store.transaction() as st:
            reboot_state(st, self.machine)


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
    gs["gis"] = []
    gs["processes"] = []
    gs["recovery_action"] = 0
    if spec.mig_needs_reset:
        gs["mig_current"] = gs["mig_pending"]
    else:
        gs["mig_current"] = gs["mig_pending"] = False


def reboot_state(st: State, machine: SimMachine) -> None:
    """A host reboot: instances and processes vanish, lost GPUs come back, Ampere applies a pending MIG
    mode (it persists), Hopper and later start with MIG disabled."""
    st["boot"] += 1
    st["fail_next"] = []
    for spec, gs in zip(machine.gpus, st["gpus"], strict=True):
        gs["lost"] = False
        _reset_gpu_state(gs, spec)


def append_event(st: State, gpu: int, event_type: int, data: int, gi_id: int | None = None) -> None:
    st["event_seq"] += 1
    st["events"].append({"seq": st["event_seq"], "gpu": gpu, "type": event_type, "data": data, "gi_id": gi_id})
    del st["events"][:-MAX_EVENTS]

