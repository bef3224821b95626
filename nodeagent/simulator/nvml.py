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
into the shared state by ``nodeagent.simulator.inject``; a machine may lack versioned NVML functions
(``missing_functions``: NVMLLibraryMismatchError).

Extensions beyond NVML are named ``sim*``. The class is assembled from parts: the plumbing every call
uses (``nvml_base``), the MIG calls (``nvml_mig``), and here the device, topology, event and simulator
calls.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pynvml

from nodeagent.simulator.machine import SimGpuSpec
from nodeagent.simulator.nvml_base import (
    _DEV,
    _EVSET,
    _MIG,
    FI_RECOVERY_ACTION,
    MIB,
    NO_ID,
    _decode,
    _err,
    _key,
    _mig_device_mib,
    _ptr,
    _reset_gpu_state,
    nvidia_owns,
    persistence_mode,
    reboot_state,
    visible_gpus,
)
from nodeagent.simulator.nvml_cc import CcCalls
from nodeagent.simulator.nvml_fabric import FabricCalls
from nodeagent.simulator.nvml_mig import MigCalls
from nodeagent.simulator.nvml_telemetry import FI_MEMORY_TEMP, TelemetryCalls
from nodeagent.simulator.state import State


class SimulatedNvml(TelemetryCalls, MigCalls, CcCalls, FabricCalls):
    """pynvml for a simulated machine; pass it to ``NvmlAdapter`` in place of the pynvml module."""

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
        state = self._enter("nvmlDeviceGetCount")
        return len(visible_gpus(state, len(self.machine.gpus)))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        state = self._enter("nvmlDeviceGetHandleByIndex")
        visible = visible_gpus(state, len(self.machine.gpus))
        if not 0 <= index < len(visible):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # a lost GPU still has a handle (calls on it fail with GPU_IS_LOST); the handle names the machine's GPU
        return _ptr(_key(_DEV, visible[index]), pynvml.c_nvmlDevice_t)

    def _handle_of(self, state: State, gpu: int) -> Any:
        """The handle of the machine's GPU ``gpu``; NOT_FOUND while the nvidia driver does not own it."""
        if not nvidia_owns(state, gpu):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return _ptr(_key(_DEV, gpu), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetHandleByUUID(self, uuid_str: str | bytes) -> Any:
        self._enter("nvmlDeviceGetHandleByUUID")
        want = uuid_str.decode() if isinstance(uuid_str, bytes) else uuid_str
        state = self.store.read()
        for g in self.machine.gpus:
            if g.uuid == want:
                return self._handle_of(state, g.index)
        if want.startswith("MIG-"):  # NVML hands out MIG device handles by MIG UUID too
            for g in self.machine.gpus:
                gs = state["gpus"][g.index]
                if gs["lost"] or not gs["mig_current"] or not nvidia_owns(state, g.index):
                    continue
                for gi, ci in self._mig_pairs(gs):
                    if self._mig_uuid(g.index, gi, ci) == want:
                        return _ptr(_key(_MIG, g.index, gi["id"], ci["id"]), pynvml.c_nvmlDevice_t)
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str | bytes) -> Any:
        self._enter("nvmlDeviceGetHandleByPciBusId")
        want = (bus_id.decode() if isinstance(bus_id, bytes) else bus_id).upper()
        state = self.store.read()
        for g in self.machine.gpus:
            if g.bus_id == want or g.bus_id[4:] == want:
                return self._handle_of(state, g.index)
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        state = self._enter("nvmlDeviceGetIndex")
        gpu = self._gpu(state, handle)[1]
        visible = visible_gpus(state, len(self.machine.gpus))
        if gpu not in visible:  # a handle kept from before the nvidia driver lost the GPU
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return visible.index(gpu)

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


    # --- compute mode (MPS runs under DEFAULT or EXCLUSIVE_PROCESS; the stand-in MPS daemon refuses the others) -
    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        state = self._enter("nvmlDeviceGetComputeMode")
        return int(state["gpus"][self._gpu(state, handle)[1]].get("compute_mode", pynvml.NVML_COMPUTEMODE_DEFAULT))

    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> None:
        state = self._enter("nvmlDeviceSetComputeMode")
        index = self._gpu(state, handle)[1]
        if mode not in (pynvml.NVML_COMPUTEMODE_DEFAULT, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD,
                        pynvml.NVML_COMPUTEMODE_PROHIBITED, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self.store.transaction() as st:
            st["gpus"][index]["compute_mode"] = int(mode)

    # --- driver persistence mode (nvml.h: Linux only, disabled by default, set by root, lost at reboot) ------
    def nvmlDeviceGetPersistenceMode(self, handle: Any) -> int:
        state = self._enter("nvmlDeviceGetPersistenceMode")
        index = self._gpu(state, handle)[1]
        return persistence_mode(state["gpus"][index], self.machine)

    def nvmlDeviceSetPersistenceMode(self, handle: Any, mode: int) -> None:
        """``nvidia-smi -pm``: takes effect at once, until the next reboot; NO_PERMISSION for a non-root
        caller, INVALID_ARGUMENT for a mode other than NVML_FEATURE_DISABLED/ENABLED."""
        state = self._enter("nvmlDeviceSetPersistenceMode")
        index = self._gpu(state, handle)[1]
        if int(mode) not in (pynvml.NVML_FEATURE_DISABLED, pynvml.NVML_FEATURE_ENABLED):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self.store.transaction() as st:
            if st["gpus"][index]["lost"]:
                raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
            st["gpus"][index]["persistence_mode"] = int(mode)

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

    # --- field values -------------------------------------------------------------------------
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and NVML_FI_DEV_MEMORY_TEMP answer; other fields carry
        NOT_SUPPORTED."""
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
            elif fid == FI_MEMORY_TEMP:
                try:
                    values[i].value.uiVal = self.memory_temperature(state, index)
                except pynvml.NVMLError as e:
                    values[i].nvmlReturn = e.value
                else:
                    values[i].nvmlReturn = pynvml.NVML_SUCCESS
                    values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            else:
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

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

    # --- drain state (nvml.h "Drain states": by PCI address; refused while persistence mode is on) ---------
    def _index_of_pci(self, pci: Any) -> int:
        bus = getattr(pci, "busId", pci)
        want = (bus.decode() if isinstance(bus, bytes) else str(bus)).upper()
        for g in self.machine.gpus:
            if g.bus_id == want or g.bus_id[4:] == want:
                return g.index
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceModifyDrainState(self, pciInfo: Any, newState: int) -> None:
        """Enable or disable the drain state: IN_USE while persistence mode is on (the driver counts it as
        attached), GPU_IS_LOST for a GPU off the bus."""
        self._enter("nvmlDeviceModifyDrainState")
        index = self._index_of_pci(pciInfo)
        if int(newState) not in (pynvml.NVML_FEATURE_DISABLED, pynvml.NVML_FEATURE_ENABLED):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self.store.transaction() as st:
            gs = st["gpus"][index]
            if gs["lost"]:
                raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
            if int(newState) == pynvml.NVML_FEATURE_ENABLED and persistence_mode(gs, self.machine):
                raise _err(pynvml.NVML_ERROR_IN_USE)
            gs["drain"] = int(newState)

    def nvmlDeviceQueryDrainState(self, pciInfo: Any) -> int:
        state = self._enter("nvmlDeviceQueryDrainState")
        index = self._index_of_pci(pciInfo)
        if state["gpus"][index]["lost"]:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return int(state["gpus"][index].get("drain", pynvml.NVML_FEATURE_DISABLED))

    # --- simulator extensions -----------------------------------------------------------------
    def simResetGpu(self, handle: Any) -> None:
        """What ``nvidia-smi --gpu-reset -i N`` does: fails while processes run and for a GPU off the bus
        (GPU_IS_LOST); drops all instances and the recovery action the driver asked for (an XID is an event:
        none repeats after a reset unless injected again); applies a pending MIG mode (Ampere) or
        forgets the MIG mode (Hopper and later). A reset keeps the drain state and persistence mode."""
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
        """Reboot the machine (see ``nodeagent.simulator.inject.reboot``)."""
        with self.store.transaction() as st:
            reboot_state(st, self.machine)
