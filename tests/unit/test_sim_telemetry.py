"""The simulator's telemetry answers as NVML does: clocks and memory temperature by board, energy that only
grows, and GPM's rules (Hopper and later, GPU instances through their parent, two samples of one source)."""

from __future__ import annotations

import time

import pynvml
import pytest

from nodeagent.simulator.inject import inject_process, write_mig_layout
from nodeagent.simulator.open import open_sim


def _code(fn: object, *args: object) -> int:
    with pytest.raises(pynvml.NVMLError) as e:
        fn(*args)  # type: ignore[operator]
    return int(e.value.value)


def test_clocks_and_memory_temperature_follow_the_board_and_the_load() -> None:
    sim = open_sim("dgx-h100")
    sim.nvmlInit()
    h0, h1 = sim.nvmlDeviceGetHandleByIndex(0), sim.nvmlDeviceGetHandleByIndex(1)
    inject_process(sim.store, 1, 99, "train", 1000)
    assert sim.nvmlDeviceGetClockInfo(h0, pynvml.NVML_CLOCK_SM) == 345
    assert sim.nvmlDeviceGetClockInfo(h0, pynvml.NVML_CLOCK_MEM) == 2619
    assert 1800 <= sim.nvmlDeviceGetClockInfo(h1, pynvml.NVML_CLOCK_SM) <= 1980
    assert _code(sim.nvmlDeviceGetClockInfo, h0, 7) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    (temp,) = sim.nvmlDeviceGetFieldValues(h0, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    assert temp.nvmlReturn == pynvml.NVML_SUCCESS and temp.value.uiVal == 36
    l4 = open_sim("l4x2")
    l4.nvmlInit()
    (none,) = l4.nvmlDeviceGetFieldValues(l4.nvmlDeviceGetHandleByIndex(0), [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    assert none.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # GDDR: no memory sensor
    assert l4.nvmlDeviceGetClockInfo(l4.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_CLOCK_MEM) == 405  # idle GDDR


def test_energy_only_grows_and_faster_under_load() -> None:
    sim = open_sim("dgx-h100")
    sim.nvmlInit()
    idle, busy = sim.nvmlDeviceGetHandleByIndex(0), sim.nvmlDeviceGetHandleByIndex(1)
    inject_process(sim.store, 1, 99, "train", 1000)
    t0 = time.monotonic()
    e0, e1 = sim.nvmlDeviceGetTotalEnergyConsumption(idle), sim.nvmlDeviceGetTotalEnergyConsumption(busy)
    time.sleep(0.5)
    d0 = sim.nvmlDeviceGetTotalEnergyConsumption(idle) - e0
    d1 = sim.nvmlDeviceGetTotalEnergyConsumption(busy) - e1
    took = time.monotonic() - t0
    assert 0 < d0 < d1  # mJ: 72 W idle, 72 W plus up to 628 W of load busy
    assert 72_000 * 0.45 <= d0 <= 72_000 * took + 1 and d1 >= d0 + 628_000 * 0.4 * 0.45


def test_gpm_rules() -> None:
    sim = open_sim("dgx-h100")
    sim.nvmlInit()
    write_mig_layout(sim.store, 0, ["3g.40gb"])
    h0, h1 = sim.nvmlDeviceGetHandleByIndex(0), sim.nvmlDeviceGetHandleByIndex(1)
    mig = sim.nvmlDeviceGetMigDeviceHandleByIndex(h0, 0)
    gi = sim.nvmlDeviceGetGpuInstanceId(mig)
    assert sim.nvmlGpmQueryDeviceSupport(h1).isSupportedDevice == 1
    a, b = sim.nvmlGpmSampleAlloc(), sim.nvmlGpmSampleAlloc()
    assert _code(sim.nvmlGpmSampleGet, mig, a) == pynvml.NVML_ERROR_NOT_SUPPORTED  # MIG devices: via the parent
    assert _code(sim.nvmlGpmMigSampleGet, h1, 1, a) == pynvml.NVML_ERROR_NOT_SUPPORTED  # GPU 1 is not in MIG mode
    assert _code(sim.nvmlGpmMigSampleGet, h0, 13, a) == pynvml.NVML_ERROR_NOT_FOUND
    inject_process(sim.store, 0, 7, "infer", 500, gi_id=gi)
    sim.nvmlGpmMigSampleGet(h0, gi, a)
    time.sleep(0.1)
    sim.nvmlGpmMigSampleGet(h0, gi, b)
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version, request.numMetrics, request.sample1, request.sample2 = 1, 3, a, b
    for i, mid in enumerate((pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, 99)):
        request.metrics[i].metricId = mid
    sim.nvmlGpmMetricsGet(request)
    assert 40.0 <= request.metrics[0].value <= 95.0 and request.metrics[0].metricInfo.unit == b"%"
    assert 0 < request.metrics[1].value < request.metrics[0].value
    assert request.metrics[2].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # not a simulated metric
    request.sample1, request.sample2 = b, a  # the second sample must be the later one
    assert _code(sim.nvmlGpmMetricsGet, request) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    sim.nvmlGpmSampleGet(h1, a)  # samples of two sources do not make a metric
    request.sample1, request.sample2 = b, a
    assert _code(sim.nvmlGpmMetricsGet, request) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    sim.nvmlGpmSampleFree(a)
    assert _code(sim.nvmlGpmSampleGet, h1, a) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # freed
    a100 = open_sim("dgx-a100-80gb")
    a100.nvmlInit()
    ha = a100.nvmlDeviceGetHandleByIndex(0)
    assert a100.nvmlGpmQueryDeviceSupport(ha).isSupportedDevice == 0
    assert _code(a100.nvmlGpmSampleGet, ha, a100.nvmlGpmSampleAlloc()) == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_a_gpm_failure_leaves_the_rest_of_the_reading() -> None:
    from nodeagent.gpu.nvml import NvmlAdapter
    from nodeagent.simulator.inject import fail_next

    sim = open_sim("dgx-h100")
    with NvmlAdapter(sim) as adapter:
        adapter.metrics(0)
        fail_next(sim.store, "nvmlGpmSampleGet", pynvml.NVML_ERROR_NO_PERMISSION)
        m = adapter.metrics(0)
        assert m.gpm == {} and m.sm_clock_mhz == 345 and m.memory_free_mib > 0
        time.sleep(0.05)
        assert adapter.metrics(0).gpm["graphics_util"] == 0.0  # the next reading pairs with the last good sample
