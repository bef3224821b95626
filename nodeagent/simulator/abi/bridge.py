"""The Python side of the stand-in ``libnvidia-ml.so.1``: NVML's C functions over the simulator.

``libnvml.c`` calls ``dispatch(name, args)`` for every NVML entry point with the C arguments as integers
(pointers as addresses). The functions here read their inputs, call the simulator through its
pynvml-compatible names, write the answers into the caller's memory with pynvml's ctypes structs (the
layouts of ``nvml.h``) and return an ``nvmlReturn_t``. A name not served here makes ``dispatch`` return
-1, which the C side turns into NVML_ERROR_NOT_SUPPORTED. Nothing raised here reaches the caller.

The machine and state are those of ``configure()`` (nodeagent's ABI mode) or else of the environment:
``NODEAGENT_SIM_MACHINE`` (a simulated machine name) and ``NODEAGENT_SIM_STATE`` (the shared state file;
``NODEAGENT_NVML_STATE`` when the stand-in is installed as a host's driver, see ``DRIVER_STATE_ENV``).
``NODEAGENT_NVML_TRACE=1`` prints each call's name and result on stderr; ``NODEAGENT_NVML_INIT_LOG=FILE``
appends one line per nvmlInit to FILE.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml

from nodeagent.errors import InputError
from nodeagent.simulator.nvml import SimulatedNvml
from nodeagent.simulator.open import open_sim

SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
DRIVER_NOT_LOADED = 9
ARGUMENT_VERSION_MISMATCH = 25
UNKNOWN = 999
NOT_SERVED = -1
_MAX_INSTANCES = 8  # more GPU/compute instances of one profile than any GPU offers


class _GpuInstanceProfileInfoV3(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("id", ctypes.c_uint),
        ("sliceCount", ctypes.c_uint),
        ("instanceCount", ctypes.c_uint),
        ("multiprocessorCount", ctypes.c_uint),
        ("copyEngineCount", ctypes.c_uint),
        ("decoderCount", ctypes.c_uint),
        ("encoderCount", ctypes.c_uint),
        ("jpegCount", ctypes.c_uint),
        ("ofaCount", ctypes.c_uint),
        ("memorySizeMB", ctypes.c_ulonglong),
        ("name", ctypes.c_char * 96),
        ("capabilities", ctypes.c_uint),
    ]


class _ComputeInstanceProfileInfoV3(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("id", ctypes.c_uint),
        ("sliceCount", ctypes.c_uint),
        ("instanceCount", ctypes.c_uint),
        ("multiprocessorCount", ctypes.c_uint),
        ("sharedCopyEngineCount", ctypes.c_uint),
        ("sharedDecoderCount", ctypes.c_uint),
        ("sharedEncoderCount", ctypes.c_uint),
        ("sharedJpegCount", ctypes.c_uint),
        ("sharedOfaCount", ctypes.c_uint),
        ("name", ctypes.c_char * 96),
        ("capabilities", ctypes.c_uint),
    ]


class _ProcessInfoV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class _EventDataV1(ctypes.Structure):
    _fields_ = [
        ("device", ctypes.c_void_p),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
    ]


class _Error(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


# --- memory helpers ---------------------------------------------------------------------------------
def _need(ptr: int) -> int:
    if not ptr:
        raise _Error(INVALID_ARGUMENT)
    return ptr


def _plain(value: Any) -> int:
    # some simulator answers are ctypes values, as pynvml's own are (nvmlDeviceIsMigDeviceHandle: c_uint)
    return int(value.value if isinstance(value, ctypes._SimpleCData) else value)


def _put_uint(ptr: int, value: Any) -> None:
    ctypes.c_uint.from_address(_need(ptr)).value = _plain(value)


def _put_int(ptr: int, value: Any) -> None:
    ctypes.c_int.from_address(_need(ptr)).value = _plain(value)


def _put_ull(ptr: int, value: Any) -> None:
    ctypes.c_ulonglong.from_address(_need(ptr)).value = _plain(value)


def _put_handle(ptr: int, handle: Any) -> None:
    ctypes.c_void_p.from_address(_need(ptr)).value = _addr(handle)


def _put_str(ptr: int, length: int, value: str | bytes) -> None:
    data = value.encode() if isinstance(value, str) else value
    _need(ptr)
    if len(data) + 1 > length:
        raise _Error(INSUFFICIENT_SIZE)
    ctypes.memmove(ptr, data + b"\0", len(data) + 1)


def _get_str(ptr: int) -> bytes:
    return ctypes.string_at(_need(ptr))


def _get_uint(ptr: int) -> int:
    return int(ctypes.c_uint.from_address(_need(ptr)).value)


def _addr(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def _h(value: int) -> Any:
    return ctypes.c_void_p(value)


def _fill(src: Any, dst: Any) -> None:
    """Copy the fields ``dst`` (a struct in the caller's memory) shares with ``src`` (a pynvml answer)."""
    if type(src) is type(dst):  # same layout: one copy instead of a field-by-field walk
        versioned = dst._fields_[0][0] == "version"
        version = ctypes.c_uint.from_address(ctypes.addressof(dst)).value if versioned else 0
        ctypes.memmove(ctypes.addressof(dst), ctypes.addressof(src), ctypes.sizeof(dst))
        if versioned:  # the caller's struct keeps the version it asked for
            ctypes.c_uint.from_address(ctypes.addressof(dst)).value = version
        return
    for field in dst._fields_:
        name = field[0]
        if name != "version" and hasattr(src, name):
            setattr(dst, name, getattr(src, name))


def _version(ptr: int) -> int:
    return _get_uint(ptr) >> 24


def _handle_out(out: int, answer: Callable[[], Any]) -> int:
    """A call that answers one handle: ``out`` must be given before the simulator is asked (a create call
    with nowhere to put its handle creates nothing)."""
    _need(out)
    _put_handle(out, answer())
    return SUCCESS


def _uint_out(out: int, value: int) -> int:
    _put_uint(out, value)
    return SUCCESS


def _struct_out(out: int, struct: Any, value: Any) -> int:
    """The simulator's answer ``value`` into the caller's ``struct`` at ``out``."""
    _fill(value, struct.from_address(_need(out)))
    return SUCCESS


def _fill_versioned(out: int, structs: dict[int, Any], answer: Callable[[], Any]) -> int:
    """A ``..._v`` call: the caller's struct at ``out`` says its version (top byte of its first field);
    fill it with the simulator's ``answer()`` in that layout. Version 3 adds ``capabilities`` (none here)."""
    version = _version(out)
    struct = structs.get(version)
    if struct is None:
        return ARGUMENT_VERSION_MISMATCH
    dst = struct.from_address(out)
    _fill(answer(), dst)
    if version == 3:
        dst.capabilities = 0
    return SUCCESS


def _put_handles(out: int, count: int, handle_type: Any, query: Callable[[Any, Any], object]) -> int:
    """An instance list: ``query(array, n)`` fills a local array of ``handle_type`` and ``n``; the handles go
    to the caller's array at ``out`` (needed unless there are none) and their number to ``count``."""
    _need(count)
    array = (handle_type * _MAX_INSTANCES)()
    n = ctypes.c_uint(0)
    query(array, n)
    if n.value and not out:
        return INVALID_ARGUMENT
    for i in range(n.value):
        _put_handle(out + i * ctypes.sizeof(ctypes.c_void_p), array[i])
    _put_uint(count, n.value)
    return SUCCESS


# --- the simulator of this process ------------------------------------------------------------------
class _Machine:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sim: SimulatedNvml | None = None
        self.key: tuple[str | None, str | None] | None = None
        self.configured: tuple[str | None, str | None] | None = None
        self.inits = 0


_M = _Machine()

# The state file when the stand-in plays the driver of a host: nodeagent's own commands read
# NODEAGENT_SIM_STATE as --sim-state (the sandboxed simulator, never on "/"), so a nodeagent that runs as on
# a GPU node (the real pynvml, no --simulate) gets its simulated machine's state through this name instead.
DRIVER_STATE_ENV = "NODEAGENT_NVML_STATE"


def configure(machine: str | None, state: Path | None) -> None:
    """Serve ``machine`` / ``state`` from the next nvmlInit on (instead of the environment)."""
    with _M.lock:
        _M.configured = (machine, None if state is None else str(state))


def _wanted() -> tuple[str | None, str | None]:
    if _M.configured is not None:
        return _M.configured
    state = os.environ.get("NODEAGENT_SIM_STATE") or os.environ.get(DRIVER_STATE_ENV) or None
    return os.environ.get("NODEAGENT_SIM_MACHINE") or None, state


def _sim() -> SimulatedNvml:
    sim = _M.sim
    if sim is None or _M.inits <= 0:
        raise _Error(UNINITIALIZED)
    return sim


def _init() -> int:
    with _M.lock:
        key = _wanted()
        if _M.sim is None or (_M.inits == 0 and key != _M.key):
            machine, state = key
            if machine is None and state is None:
                print(
                    "libnvidia-ml (nodeagent stand-in): no simulated machine: set NODEAGENT_SIM_MACHINE "
                    "and/or NODEAGENT_SIM_STATE (NODEAGENT_NVML_STATE)",
                    file=sys.stderr,
                )
                return DRIVER_NOT_LOADED
            try:
                _M.sim = open_sim(machine, None if state is None else Path(state))
            except InputError as e:
                print(f"libnvidia-ml (nodeagent stand-in): {e}", file=sys.stderr)
                return DRIVER_NOT_LOADED
            _M.key = key
        assert _M.sim is not None
        _M.sim.nvmlInit()
        _M.inits += 1
    _note_init(key)
    return SUCCESS


def _note_init(key: tuple[str | None, str | None]) -> None:
    """With ``NODEAGENT_NVML_INIT_LOG`` set, append "pid machine state" for each nvmlInit (tests use it
    to prove that a process really went through the C library)."""
    path = os.environ.get("NODEAGENT_NVML_INIT_LOG")
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {key[0] or '-'} {key[1] or '-'}\n")
    except OSError as e:
        print(f"libnvidia-ml (nodeagent stand-in): cannot append to {path}: {e}", file=sys.stderr)


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


# --- MIG --------------------------------------------------------------------------------------------
def nvmlDeviceGetMigMode(dev: int, current: int, pending: int) -> int:
    cur, pend = _sim().nvmlDeviceGetMigMode(_h(dev))
    _put_uint(current, cur)
    _put_uint(pending, pend)
    return SUCCESS


def nvmlDeviceSetMigMode(dev: int, mode: int, status: int) -> int:
    _need(status)
    _put_uint(status, _sim().nvmlDeviceSetMigMode(_h(dev), mode))
    return SUCCESS


def nvmlDeviceGetGpuInstanceProfileInfo(dev: int, profile: int, out: int) -> int:
    info = _sim().nvmlDeviceGetGpuInstanceProfileInfo(_h(dev), profile)
    return _struct_out(out, pynvml.c_nvmlGpuInstanceProfileInfo_t, info)


def nvmlDeviceGetGpuInstanceProfileInfoV(dev: int, profile: int, out: int) -> int:
    return _fill_versioned(
        out, {2: pynvml.c_nvmlGpuInstanceProfileInfo_v2_t, 3: _GpuInstanceProfileInfoV3},
        lambda: _sim().nvmlDeviceGetGpuInstanceProfileInfo(_h(dev), profile),
    )  # fmt: skip


def nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    dev: int, profile_id: int, placements: int, count: int
) -> int:
    n = ctypes.c_uint(0)
    _need(count)
    sim = _sim()
    sim.nvmlDeviceGetGpuInstancePossiblePlacements(_h(dev), profile_id, None, n)
    if not placements:
        _put_uint(count, n.value)
        return SUCCESS
    room = _get_uint(count)
    _put_uint(count, n.value)
    if room < n.value:
        return INSUFFICIENT_SIZE
    array = (pynvml.c_nvmlGpuInstancePlacement_t * max(n.value, 1)).from_address(placements)
    sim.nvmlDeviceGetGpuInstancePossiblePlacements(_h(dev), profile_id, array, n)
    return SUCCESS


def nvmlDeviceGetGpuInstanceRemainingCapacity(dev: int, profile_id: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetGpuInstanceRemainingCapacity(_h(dev), profile_id))


def nvmlDeviceCreateGpuInstance(dev: int, profile_id: int, out: int) -> int:
    return _handle_out(out, lambda: _sim().nvmlDeviceCreateGpuInstance(_h(dev), profile_id))


def nvmlDeviceCreateGpuInstanceWithPlacement(dev: int, profile_id: int, placement: int, out: int) -> int:
    _need(out)
    p = pynvml.c_nvmlGpuInstancePlacement_t.from_address(_need(placement))
    _put_handle(out, _sim().nvmlDeviceCreateGpuInstanceWithPlacement(_h(dev), profile_id, p))
    return SUCCESS


def nvmlDeviceGetGpuInstances(dev: int, profile_id: int, out: int, count: int) -> int:
    return _put_handles(out, count, pynvml.c_nvmlGpuInstance_t,
                        lambda array, n: _sim().nvmlDeviceGetGpuInstances(_h(dev), profile_id, array, n))


def nvmlDeviceGetGpuInstanceById(dev: int, gi_id: int, out: int) -> int:
    return _handle_out(out, lambda: _sim().nvmlDeviceGetGpuInstanceById(_h(dev), gi_id))


def nvmlGpuInstanceGetInfo(gi: int, out: int) -> int:
    return _struct_out(out, pynvml.c_nvmlGpuInstanceInfo_t, _sim().nvmlGpuInstanceGetInfo(_h(gi)))


def nvmlGpuInstanceDestroy(gi: int) -> int:
    _sim().nvmlGpuInstanceDestroy(_h(gi))
    return SUCCESS


def nvmlGpuInstanceGetComputeInstanceProfileInfo(gi: int, profile: int, eng: int, out: int) -> int:
    info = _sim().nvmlGpuInstanceGetComputeInstanceProfileInfo(_h(gi), profile, eng)
    return _struct_out(out, pynvml.c_nvmlComputeInstanceProfileInfo_t, info)


def nvmlGpuInstanceGetComputeInstanceProfileInfoV(gi: int, profile: int, eng: int, out: int) -> int:
    return _fill_versioned(
        out, {2: pynvml.c_nvmlComputeInstanceProfileInfo_v2_t, 3: _ComputeInstanceProfileInfoV3},
        lambda: _sim().nvmlGpuInstanceGetComputeInstanceProfileInfo(_h(gi), profile, eng),
    )  # fmt: skip


def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi: int, profile_id: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlGpuInstanceGetComputeInstanceRemainingCapacity(_h(gi), profile_id))


def nvmlGpuInstanceCreateComputeInstance(gi: int, profile_id: int, out: int) -> int:
    return _handle_out(out, lambda: _sim().nvmlGpuInstanceCreateComputeInstance(_h(gi), profile_id))


def nvmlGpuInstanceGetComputeInstances(gi: int, profile_id: int, out: int, count: int) -> int:
    return _put_handles(out, count, pynvml.c_nvmlComputeInstance_t,
                        lambda array, n: _sim().nvmlGpuInstanceGetComputeInstances(_h(gi), profile_id, array, n))


def nvmlGpuInstanceGetComputeInstanceById(gi: int, ci_id: int, out: int) -> int:
    return _handle_out(out, lambda: _sim().nvmlGpuInstanceGetComputeInstanceById(_h(gi), ci_id))


def nvmlComputeInstanceGetInfo_v2(ci: int, out: int) -> int:
    info = _sim().nvmlComputeInstanceGetInfo(_h(ci))
    return _struct_out(out, pynvml.c_nvmlComputeInstanceInfo_t, info)


def nvmlComputeInstanceDestroy(ci: int) -> int:
    _sim().nvmlComputeInstanceDestroy(_h(ci))
    return SUCCESS


def nvmlDeviceGetMaxMigDeviceCount(dev: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetMaxMigDeviceCount(_h(dev)))


def nvmlDeviceGetMigDeviceHandleByIndex(dev: int, index: int, out: int) -> int:
    return _handle_out(out, lambda: _sim().nvmlDeviceGetMigDeviceHandleByIndex(_h(dev), index))


def nvmlDeviceIsMigDeviceHandle(dev: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceIsMigDeviceHandle(_h(dev)))


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(dev: int, out: int) -> int:
    return _handle_out(out, lambda: _sim().nvmlDeviceGetDeviceHandleFromMigDeviceHandle(_h(dev)))


def nvmlDeviceGetGpuInstanceId(dev: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetGpuInstanceId(_h(dev)))


def nvmlDeviceGetComputeInstanceId(dev: int, out: int) -> int:
    return _uint_out(out, _sim().nvmlDeviceGetComputeInstanceId(_h(dev)))


def nvmlDeviceGetAttributes_v2(dev: int, out: int) -> int:
    """Engine counts, slices and memory of a MIG device (NVML answers this for MIG device handles only)."""
    _need(out)
    sim = _sim()
    mig = _h(dev)
    if not sim.nvmlDeviceIsMigDeviceHandle(mig):
        return int(pynvml.NVML_ERROR_NOT_SUPPORTED)
    parent = sim.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    gi = sim.nvmlDeviceGetGpuInstanceById(parent, sim.nvmlDeviceGetGpuInstanceId(mig))
    gi_info = sim.nvmlGpuInstanceGetInfo(gi)
    ci = sim.nvmlGpuInstanceGetComputeInstanceById(gi, sim.nvmlDeviceGetComputeInstanceId(mig))
    ci_info = sim.nvmlComputeInstanceGetInfo(ci)
    gi_prof = None
    for index in range(int(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
        try:
            candidate = sim.nvmlDeviceGetGpuInstanceProfileInfo(parent, index)
        except pynvml.NVMLError:
            continue
        if int(candidate.id) == int(gi_info.profileId):
            gi_prof = candidate
            break
    if gi_prof is None:
        return NOT_FOUND
    ci_prof = sim.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, int(ci_info.profileId), int(pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    )
    dst = pynvml.c_nvmlDeviceAttributes.from_address(out)
    dst.multiprocessorCount = int(ci_prof.multiprocessorCount)
    dst.sharedCopyEngineCount = int(gi_prof.copyEngineCount)
    dst.sharedDecoderCount = int(gi_prof.decoderCount)
    dst.sharedEncoderCount = int(gi_prof.encoderCount)
    dst.sharedJpegCount = int(gi_prof.jpegCount)
    dst.sharedOfaCount = int(gi_prof.ofaCount)
    dst.gpuInstanceSliceCount = int(gi_prof.sliceCount)
    dst.computeInstanceSliceCount = int(ci_prof.sliceCount)
    dst.memorySizeMB = int(gi_prof.memorySizeMB)
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


# Unversioned names kept by libnvidia-ml for old callers, with the same meaning here.
nvmlDeviceGetCount = nvmlDeviceGetCount_v2
nvmlDeviceGetHandleByIndex = nvmlDeviceGetHandleByIndex_v2
nvmlDeviceGetHandleByPciBusId = nvmlDeviceGetHandleByPciBusId_v2
nvmlDeviceGetNvLinkRemotePciInfo = nvmlDeviceGetNvLinkRemotePciInfo_v2
nvmlDeviceGetGpuInstancePossiblePlacements = nvmlDeviceGetGpuInstancePossiblePlacements_v2
nvmlComputeInstanceGetInfo = nvmlComputeInstanceGetInfo_v2
nvmlDeviceGetAttributes = nvmlDeviceGetAttributes_v2

_FUNCTIONS: dict[str, Callable[..., int]] = {
    name: fn for name, fn in globals().items() if name.startswith("nvml") and callable(fn)
}
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
