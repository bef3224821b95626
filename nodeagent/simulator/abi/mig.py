"""The stand-in's MIG functions, by C name: GPU and compute instances, their profiles, MIG device handles."""

from __future__ import annotations

import ctypes

import pynvml

from nodeagent.simulator.abi.cmem import (
    INSUFFICIENT_SIZE,
    NOT_FOUND,
    SUCCESS,
    _fill_versioned,
    _get_uint,
    _h,
    _handle_out,
    _need,
    _put_handle,
    _put_handles,
    _put_uint,
    _struct_out,
    _uint_out,
)
from nodeagent.simulator.abi.process import _sim


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
    return _put_handles(
        out,
        count,
        pynvml.c_nvmlGpuInstance_t,
        lambda array, n: _sim().nvmlDeviceGetGpuInstances(_h(dev), profile_id, array, n),
    )


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
    return _put_handles(
        out,
        count,
        pynvml.c_nvmlComputeInstance_t,
        lambda array, n: _sim().nvmlGpuInstanceGetComputeInstances(_h(gi), profile_id, array, n),
    )


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


# Unversioned names kept by libnvidia-ml for old callers, with the same meaning here.
nvmlDeviceGetGpuInstancePossiblePlacements = nvmlDeviceGetGpuInstancePossiblePlacements_v2
nvmlComputeInstanceGetInfo = nvmlComputeInstanceGetInfo_v2
nvmlDeviceGetAttributes = nvmlDeviceGetAttributes_v2
