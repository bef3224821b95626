"""The Python side of the stand-in ``libnvidia-ml.so.1``: NVML's C functions over the simulator.

``libnvml.c`` calls ``dispatch(name, args)`` for every NVML entry point with the C arguments as integers
(pointers as addresses). The functions here and the MIG ones of ``mig.py`` read their inputs, call the
simulator through its pynvml-compatible names, write the answers into the caller's memory with pynvml's
ctypes structs (the layouts of ``nvml.h``; the helpers of ``cmem.py``) and return an ``nvmlReturn_t``. A
name not served makes ``dispatch`` return -1, which the C side turns into NVML_ERROR_NOT_SUPPORTED.
Nothing raised here reaches the caller.

The machine and state (``process.py``) are those of ``configure()`` (nodeagent's ABI mode) or else of the
environment: ``NODEAGENT_SIM_MACHINE`` (a simulated machine name) and ``NODEAGENT_SIM_STATE`` (the shared
state file; ``NODEAGENT_NVML_STATE`` when the stand-in is installed as a host's driver, see
``DRIVER_STATE_ENV``), or the file ``nodeagent-sim.conf`` beside the library (``process.DRIVER_CONF``).
``NODEAGENT_NVML_TRACE=1`` prints each call's name and result on stderr; ``NODEAGENT_NVML_INIT_LOG=FILE``
appends one line per nvmlInit to FILE.
"""

from __future__ import annotations

import ctypes
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pynvml

from nodeagent.simulator.abi import bridge_cc, bridge_telemetry, mig
from nodeagent.simulator.abi.cmem import (
    ARGUMENT_VERSION_MISMATCH,
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    NOT_SERVED,
    SUCCESS,
    UNKNOWN,
    _addr,
    _Error,
    _fill,
    _get_str,
    _get_uint,
    _h,
    _handle_out,
    _need,
    _put_int,
    _put_str,
    _put_uint,
    _put_ull,
    _struct_out,
    _uint_out,
    _version,
)
from nodeagent.simulator.abi.process import _M, _init, _sim


class _ProcessInfoV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class _EventDataV1(ctypes.Structure):
    _fields_ = [
        ("device", ctypes.c_void_p),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
    ]


# --- NVML functions, by C name ----------------------------------------------------------------------
def nvmlInit_v2() -> int:
    return _init()


def nvmlInit() -> int:
    return _init()


def nvmlInitWithFlags(flags: int) -> int:
    return _init()


def nvmlShutdown() -> int:
    with _M.lock:
        sim = _sim()
        sim.nvmlShutdown()
        _M.inits -= 1
    return SUCCESS


def nvmlSystemGetDriverVersion(buf: int, length: int) -> int:
    _put_str(buf, length, _sim().nvmlSystemGetDriverVersion())
    return SUCCESS


def nvmlSystemGetNVMLVersion(buf: int, length: int) -> int:
    _put_str(buf, length, _sim().nvmlSystemGetNVMLVersion())
    return SUCCESS


def nvmlSystemGetCudaDriverVersion(out: int) -> int:
    _put_int(out, _sim().nvmlSystemGetCudaDriverVersion())
    return SUCCESS


def nvmlSystemGetCudaDriverVersion_v2(out: int) -> int:
    _put_int(out, _sim().nvmlSystemGetCudaDriverVersion_v2())
    return SUCCESS


def nvmlDeviceGetCount_v2(out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetCount())


def nvmlDeviceGetHandleByIndex_v2(index: int, out: int) -> int:
    return _handle_out(out, lambda: _sim().nvmlDeviceGetHandleByIndex(index))


def nvmlDeviceGetHandleByUUID(uuid: int, out: int) -> int:
    return _handle_out(out, lambda: _sim().nvmlDeviceGetHandleByUUID(_get_str(uuid).decode(errors="replace")))


def nvmlDeviceGetHandleByPciBusId_v2(bus_id: int, out: int) -> int:
    return _handle_out(out, lambda: _sim().nvmlDeviceGetHandleByPciBusId(_get_str(bus_id)))


def nvmlDeviceGetIndex(dev: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetIndex(_h(dev)))


def nvmlDeviceGetComputeMode(dev: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetComputeMode(_h(dev)))


def nvmlDeviceSetComputeMode(dev: int, mode: int) -> int:
    _sim().nvmlDeviceSetComputeMode(_h(dev), mode)
    return SUCCESS


def nvmlDeviceGetName(dev: int, buf: int, length: int) -> int:
    _put_str(buf, length, _sim().nvmlDeviceGetName(_h(dev)))
    return SUCCESS


def nvmlDeviceGetUUID(dev: int, buf: int, length: int) -> int:
    _put_str(buf, length, _sim().nvmlDeviceGetUUID(_h(dev)))
    return SUCCESS


def nvmlDeviceGetMinorNumber(dev: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetMinorNumber(_h(dev)))


def nvmlDeviceGetPciInfo_v3(dev: int, out: int) -> int:
    return _struct_out(out, pynvml.nvmlPciInfo_t, _sim().nvmlDeviceGetPciInfo(_h(dev)))


def nvmlDeviceGetPciInfo_v2(dev: int, out: int) -> int:
    info = _sim().nvmlDeviceGetPciInfo(_h(dev))
    dst = pynvml.nvmlPciInfo_v2_t.from_address(_need(out))
    _fill(info, dst)
    dst.busId = info.busIdLegacy
    return SUCCESS


def nvmlDeviceGetArchitecture(dev: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetArchitecture(_h(dev)))


def nvmlDeviceGetCudaComputeCapability(dev: int, major: int, minor: int) -> int:
    a, b = _sim().nvmlDeviceGetCudaComputeCapability(_h(dev))
    _put_int(major, a)
    _put_int(minor, b)
    return SUCCESS


def nvmlDeviceGetNumaNodeId(dev: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetNumaNodeId(_h(dev)))


def nvmlDeviceGetMemoryInfo(dev: int, out: int) -> int:
    return _struct_out(out, pynvml.c_nvmlMemory_t, _sim().nvmlDeviceGetMemoryInfo(_h(dev)))


def nvmlDeviceGetMemoryInfo_v2(dev: int, out: int) -> int:
    if _version(out) != 2:
        return ARGUMENT_VERSION_MISMATCH
    mem = _sim().nvmlDeviceGetMemoryInfo(_h(dev))
    dst = pynvml.c_nvmlMemory_v2_t.from_address(out)
    _fill(mem, dst)
    dst.reserved = 0
    return SUCCESS


def nvmlDeviceGetUtilizationRates(dev: int, out: int) -> int:
    return _struct_out(out, pynvml.c_nvmlUtilization_t, _sim().nvmlDeviceGetUtilizationRates(_h(dev)))


def nvmlDeviceGetTemperature(dev: int, sensor: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetTemperature(_h(dev), sensor))


def nvmlDeviceGetPowerUsage(dev: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetPowerUsage(_h(dev)))


def nvmlDeviceGetEnforcedPowerLimit(dev: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetEnforcedPowerLimit(_h(dev)))


def nvmlDeviceGetPersistenceMode(dev: int, out: int) -> int:
    return _uint_out(_need(out), _sim().nvmlDeviceGetPersistenceMode(_h(dev)))


def nvmlDeviceSetPersistenceMode(dev: int, mode: int) -> int:
    _sim().nvmlDeviceSetPersistenceMode(_h(dev), mode)
    return SUCCESS


def nvmlDeviceModifyDrainState(pci: int, new_state: int) -> int:
    _sim().nvmlDeviceModifyDrainState(pynvml.nvmlPciInfo_t.from_address(_need(pci)), new_state)
    return SUCCESS


def nvmlDeviceQueryDrainState(pci: int, out: int) -> int:
    return _uint_out(_need(out), _sim().nvmlDeviceQueryDrainState(pynvml.nvmlPciInfo_t.from_address(_need(pci))))


def _processes(dev: int, count_ptr: int, infos: int, struct: Any) -> int:
    procs = _sim().nvmlDeviceGetComputeRunningProcesses(_h(dev))
    room = _get_uint(count_ptr)
    _put_uint(count_ptr, len(procs))
    if not procs:
        return SUCCESS
    if not infos or room < len(procs):
        return INSUFFICIENT_SIZE
    array = (struct * len(procs)).from_address(infos)
    for i, p in enumerate(procs):
        _fill(p, array[i])
    return SUCCESS


def nvmlDeviceGetComputeRunningProcesses_v3(dev: int, count: int, infos: int) -> int:
    return _processes(dev, count, infos, pynvml.c_nvmlProcessInfo_v2_t)


def nvmlDeviceGetComputeRunningProcesses_v2(dev: int, count: int, infos: int) -> int:
    return _processes(dev, count, infos, pynvml.c_nvmlProcessInfo_v2_t)


def nvmlDeviceGetComputeRunningProcesses(dev: int, count: int, infos: int) -> int:
    return _processes(dev, count, infos, _ProcessInfoV1)


def nvmlDeviceGetTopologyCommonAncestor(dev1: int, dev2: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetTopologyCommonAncestor(_h(dev1), _h(dev2)))


def nvmlDeviceGetNvLinkState(dev: int, link: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetNvLinkState(_h(dev), link))


def nvmlDeviceGetNvLinkRemoteDeviceType(dev: int, link: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetNvLinkRemoteDeviceType(_h(dev), link))


def nvmlDeviceGetNvLinkRemotePciInfo_v2(dev: int, link: int, out: int) -> int:
    info = _sim().nvmlDeviceGetNvLinkRemotePciInfo(_h(dev), link)
    return _struct_out(out, pynvml.nvmlPciInfo_t, info)


def nvmlDeviceGetFieldValues(dev: int, count: int, values: int) -> int:
    """Fills each caller-given ``nvmlFieldValue_t`` (fieldId and scopeId set by the caller) with the
    simulator's answer: the value or that field's own nvmlReturn (NOT_SUPPORTED for fields it lacks)."""
    n = ctypes.c_int(count).value
    if n < 0:
        return INVALID_ARGUMENT
    if n == 0:
        return SUCCESS
    array = (pynvml.c_nvmlFieldValue_t * n).from_address(_need(values))
    asked = [(int(array[i].fieldId), int(array[i].scopeId)) for i in range(n)]
    answers = _sim().nvmlDeviceGetFieldValues(_h(dev), asked)
    for i, (field_id, scope_id) in enumerate(asked):
        _fill(answers[i], array[i])
        array[i].fieldId = field_id
        array[i].scopeId = scope_id
    return SUCCESS


# --- events -----------------------------------------------------------------------------------------
def nvmlEventSetCreate(out: int) -> int:
    return _handle_out(out, lambda: _sim().nvmlEventSetCreate())


def nvmlDeviceGetSupportedEventTypes(dev: int, out: int) -> int:
    _put_ull(out, _sim().nvmlDeviceGetSupportedEventTypes(_h(dev)))
    return SUCCESS


def nvmlDeviceRegisterEvents(dev: int, types: int, event_set: int) -> int:
    _sim().nvmlDeviceRegisterEvents(_h(dev), types, _h(event_set))
    return SUCCESS


def nvmlEventSetWait_v2(event_set: int, out: int, timeout_ms: int) -> int:
    _need(out)
    data = _sim().nvmlEventSetWait_v2(_h(event_set), timeout_ms)
    dst = pynvml.c_nvmlEventData_t.from_address(out)
    _fill(data, dst)
    return SUCCESS


def nvmlEventSetWait(event_set: int, out: int, timeout_ms: int) -> int:
    _need(out)
    data = _sim().nvmlEventSetWait_v2(_h(event_set), timeout_ms)
    dst = _EventDataV1.from_address(out)
    dst.device = _addr(data.device)
    dst.eventType = data.eventType
    dst.eventData = data.eventData
    return SUCCESS


def nvmlEventSetFree(event_set: int) -> int:
    _sim().nvmlEventSetFree(_h(event_set))
    return SUCCESS


def nvmlDeviceGetGpuFabricInfo(dev: int, out: int) -> int:
    return int(_sim().nvmlDeviceGetGpuFabricInfo(_h(dev), pynvml.c_nvmlGpuFabricInfo_t.from_address(_need(out))))


def nvmlDeviceGetGpuFabricInfoV(dev: int, out: int) -> int:
    """The caller's struct says its version (v2 or v3, the whole word as nvml.h's nvmlGpuFabricInfo_v*)."""
    version = _get_uint(_need(out))
    struct = {pynvml.nvmlGpuFabricInfo_v2: pynvml.c_nvmlGpuFabricInfo_v2_t,
              pynvml.nvmlGpuFabricInfo_v3: pynvml.c_nvmlGpuFabricInfo_v3_t}.get(version)
    if struct is None:
        return ARGUMENT_VERSION_MISMATCH
    return int(_sim().nvmlDeviceGetGpuFabricInfoV(_h(dev), struct.from_address(out)))


# Unversioned names kept by libnvidia-ml for old callers, with the same meaning here.
nvmlDeviceGetCount = nvmlDeviceGetCount_v2
nvmlDeviceGetHandleByIndex = nvmlDeviceGetHandleByIndex_v2
nvmlDeviceGetHandleByPciBusId = nvmlDeviceGetHandleByPciBusId_v2
nvmlDeviceGetNvLinkRemotePciInfo = nvmlDeviceGetNvLinkRemotePciInfo_v2

_FUNCTIONS: dict[str, Callable[..., int]] = {
    name: fn
    for name, fn in (*globals().items(), *vars(mig).items())
    if name.startswith("nvml") and callable(fn)
}
_FUNCTIONS.update(bridge_telemetry.functions(_sim))
_FUNCTIONS.update(bridge_cc.functions(_sim))
_TRACE = os.environ.get("NODEAGENT_NVML_TRACE", "") not in ("", "0")


def served() -> frozenset[str]:
    """The NVML function names answered by the simulator (every other one is NOT_SUPPORTED)."""
    return frozenset(_FUNCTIONS)


def dispatch(name: str, args: tuple[int, ...]) -> int:
    """Run one NVML call for the C library; -1 when ``name`` is not served."""
    fn = _FUNCTIONS.get(name)
    if fn is None:
        if _TRACE:
            print(f"nvml-abi: {name} -> not supported", file=sys.stderr)
        return NOT_SERVED
    try:
        rc = int(fn(*args))
    except _Error as e:
        rc = e.code
    except pynvml.NVMLError as e:
        rc = int(e.value)
    except TypeError as e:
        print(f"libnvidia-ml (nodeagent stand-in): {name}: {e}", file=sys.stderr)
        rc = INVALID_ARGUMENT
    except Exception:
        print(f"libnvidia-ml (nodeagent stand-in): {name} failed:", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        rc = UNKNOWN
    if _TRACE:
        print(f"nvml-abi: {name}{args} -> {rc}", file=sys.stderr)
    return rc
