"""The stand-in's telemetry entry points: clocks, total energy and GPM over the simulator.

``functions(sim)`` gives the C functions by name for ``bridge.dispatch`` (``sim()`` is the bridge's current
simulator). GPM sample buffers are the simulator's own handles (opaque pointers to the caller). The metric
names ``nvmlGpmMetricsGet`` points the caller at live in this module for the life of the process, as the
driver's static strings do.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pynvml

from nodeagent.simulator.abi.cmem import (
    ARGUMENT_VERSION_MISMATCH,
    INVALID_ARGUMENT,
    SUCCESS,
    _get_uint,
    _h,
    _need,
    _put_handle,
    _put_uint,
    _put_ull,
)
from nodeagent.simulator.nvml import SimulatedNvml


class _GpmMetric(ctypes.Structure):
    """nvmlGpmMetric_t: id, return code, value, and the three name pointers of its metricInfo."""

    _fields_ = [
        ("metricId", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", ctypes.c_double),
        ("shortName", ctypes.c_void_p),
        ("longName", ctypes.c_void_p),
        ("unit", ctypes.c_void_p),
    ]


class _GpmMetricsGetHead(ctypes.Structure):
    """The fixed head of nvmlGpmMetricsGet_t; ``metrics[]`` follows it (its length differs between nvml.h
    releases, so only the first ``numMetrics`` entries are touched)."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("numMetrics", ctypes.c_uint),
        ("sample1", ctypes.c_void_p),
        ("sample2", ctypes.c_void_p),
    ]


_STRINGS: dict[bytes, ctypes.Array[ctypes.c_char]] = {}  # kept for the process's life: callers keep pointers


def _static(text: bytes | None) -> int:
    if not text:
        return 0
    buf = _STRINGS.get(text)
    if buf is None:
        buf = _STRINGS[text] = ctypes.create_string_buffer(text)
    return ctypes.addressof(buf)


def functions(sim: Callable[[], SimulatedNvml]) -> dict[str, Callable[..., int]]:
    """The telemetry entry points, answering from ``sim()``."""

    def nvmlDeviceGetClockInfo(dev: int, clock_type: int, out: int) -> int:
        _need(out)
        _put_uint(out, sim().nvmlDeviceGetClockInfo(_h(dev), clock_type))
        return SUCCESS

    def nvmlDeviceGetTotalEnergyConsumption(dev: int, out: int) -> int:
        _need(out)
        _put_ull(out, sim().nvmlDeviceGetTotalEnergyConsumption(_h(dev)))
        return SUCCESS

    def nvmlGpmQueryDeviceSupport(dev: int, out: int) -> int:
        if _get_uint(out) != 1:  # NVML_GPM_SUPPORT_VERSION
            return ARGUMENT_VERSION_MISMATCH
        support = sim().nvmlGpmQueryDeviceSupport(_h(dev))
        _put_uint(out + 4, support.isSupportedDevice)
        return SUCCESS

    def nvmlGpmSampleAlloc(out: int) -> int:
        _need(out)
        _put_handle(out, sim().nvmlGpmSampleAlloc())
        return SUCCESS

    def nvmlGpmSampleFree(sample: int) -> int:
        sim().nvmlGpmSampleFree(_sample(sample))
        return SUCCESS

    def nvmlGpmSampleGet(dev: int, sample: int) -> int:
        sim().nvmlGpmSampleGet(_h(dev), _sample(sample))
        return SUCCESS

    def nvmlGpmMigSampleGet(dev: int, gi_id: int, sample: int) -> int:
        sim().nvmlGpmMigSampleGet(_h(dev), gi_id & 0xFFFFFFFF, _sample(sample))
        return SUCCESS

    def nvmlGpmMetricsGet(out: int) -> int:
        head = _GpmMetricsGetHead.from_address(_need(out))
        if head.version != 1:  # NVML_GPM_METRICS_GET_VERSION
            return ARGUMENT_VERSION_MISMATCH
        n = int(head.numMetrics)
        if n > pynvml.NVML_GPM_METRIC_MAX:
            return INVALID_ARGUMENT
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version, request.numMetrics = head.version, n
        request.sample1, request.sample2 = _sample(head.sample1 or 0), _sample(head.sample2 or 0)
        entries = (_GpmMetric * n).from_address(out + ctypes.sizeof(_GpmMetricsGetHead)) if n else ()
        for i in range(n):
            request.metrics[i].metricId = entries[i].metricId
        sim().nvmlGpmMetricsGet(request)
        for i in range(n):
            src, dst = request.metrics[i], entries[i]
            dst.nvmlReturn, dst.value = int(src.nvmlReturn), float(src.value)
            info = src.metricInfo
            dst.shortName, dst.longName, dst.unit = (
                _static(info.shortName), _static(info.longName), _static(info.unit))
        return SUCCESS

    return {fn.__name__: fn for fn in (
        nvmlDeviceGetClockInfo, nvmlDeviceGetTotalEnergyConsumption, nvmlGpmQueryDeviceSupport,
        nvmlGpmSampleAlloc, nvmlGpmSampleFree, nvmlGpmSampleGet, nvmlGpmMigSampleGet, nvmlGpmMetricsGet,
    )}


def _sample(address: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpmSample_t)

