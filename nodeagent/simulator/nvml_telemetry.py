"""The simulated NVML's telemetry beyond utilisation and power: clocks, total energy, memory temperature and
GPU Performance Monitoring (GPM), with the support matrix of real boards.

- ``nvmlDeviceGetClockInfo``: SM clock at the board's idle clock while nothing runs, near its boost clock
  under load (a little lower as the load rises, as power and thermals pull it); memory clock fixed on HBM
  boards, idle-low on GDDR boards. MHz, whole GPUs only (a MIG device handle is INVALID_ARGUMENT).
- ``nvmlDeviceGetTotalEnergyConsumption``: mJ since the driver loaded, never decreasing: the idle draw over
  the host's uptime (the monotonic clock, so every process sees the same figure for an idle GPU) plus the
  extra drawn under load, integrated by this process from its first reading on.
- Memory temperature (field ``NVML_FI_DEV_MEMORY_TEMP``): only HBM boards have the sensor; GDDR boards (L4,
  L40, L40S, A10, T4, RTX PRO) answer NOT_SUPPORTED, as nvidia-smi's "N/A" shows.
- GPM: Hopper and later only (``nvmlGpmQueryDeviceSupport`` says ``isSupportedDevice`` 0 before, and sample
  calls answer NOT_SUPPORTED). ``nvmlGpmSampleGet`` takes a whole GPU (a MIG device handle is NOT_SUPPORTED:
  a GPU instance is sampled through its parent with ``nvmlGpmMigSampleGet``); ``nvmlGpmMetricsGet`` turns two
  samples of one GPU (or GPU instance) into the mean activity between them, per metric with its own return
  code (NOT_SUPPORTED for the metrics not simulated).

Activity is the same slow wave as ``nvmlDeviceGetUtilizationRates`` (zero without processes); a GPU
instance's wave follows the processes inside it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import pynvml

from nodeagent.simulator.machine import SimGpuSpec
from nodeagent.simulator.nvml_base import _DEV, _MIG, SimBase, _decode, _err, _key, _ptr
from nodeagent.simulator.state import State

FI_MEMORY_TEMP = 82  # NVML_FI_DEV_MEMORY_TEMP
CLOCK_GRAPHICS, CLOCK_SM, CLOCK_MEM = 0, 1, 2
_GPM = 6  # handle kind of a GPM sample buffer
GPM_SUPPORT_VERSION = 1
GPM_METRICS_GET_VERSION = 1

# board name (prefix) -> (SM idle MHz, SM boost MHz, memory MHz, HBM)
_CLOCKS: tuple[tuple[str, tuple[int, int, int, bool]], ...] = (
    ("NVIDIA A100-SXM4-40GB", (210, 1410, 1215, True)),
    ("NVIDIA A100", (210, 1410, 1593, True)),
    ("NVIDIA A30", (210, 1440, 1215, True)),
    ("NVIDIA A10", (210, 1695, 6251, False)),
    ("NVIDIA H100 NVL", (345, 1785, 2619, True)),
    ("NVIDIA H100", (345, 1980, 2619, True)),
    ("NVIDIA H200", (345, 1980, 3201, True)),
    ("NVIDIA H20", (345, 1980, 2619, True)),
    ("NVIDIA GH200 144G", (345, 1980, 3201, True)),
    ("NVIDIA GH200", (345, 1980, 2619, True)),
    ("NVIDIA B200", (345, 1965, 3996, True)),
    ("NVIDIA B300", (345, 2032, 3996, True)),
    ("NVIDIA GB200", (345, 2062, 3996, True)),
    ("NVIDIA GB300", (345, 2062, 3996, True)),
    ("NVIDIA L40S", (210, 2520, 9001, False)),
    ("NVIDIA L40", (210, 2490, 9001, False)),
    ("NVIDIA L4", (210, 2040, 6251, False)),
    ("NVIDIA RTX PRO 6000", (180, 2617, 14001, False)),
    ("Tesla T4", (300, 1590, 5001, False)),
)
_GDDR_IDLE_MEM_MHZ = 405

# GPM metric id -> share of the activity it shows (0..1 scale of 100%), or MiB/s at full activity for PCIe
_GPM_SHARE = {
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 1.0,
    pynvml.NVML_GPM_METRIC_SM_UTIL: 0.92,
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 0.48,
    pynvml.NVML_GPM_METRIC_INTEGER_UTIL: 0.12,
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 0.63,
    pynvml.NVML_GPM_METRIC_DFMA_TENSOR_UTIL: 0.0,
    pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL: 0.61,
    pynvml.NVML_GPM_METRIC_DMMA_TENSOR_UTIL: 0.0,
    pynvml.NVML_GPM_METRIC_IMMA_TENSOR_UTIL: 0.02,
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 0.6,
    pynvml.NVML_GPM_METRIC_FP64_UTIL: 0.01,
    pynvml.NVML_GPM_METRIC_FP32_UTIL: 0.21,
    pynvml.NVML_GPM_METRIC_FP16_UTIL: 0.09,
}
_GPM_PCIE_MIBS = {pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 1800.0, pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 5400.0}
GPM_METRIC_INFO = {
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: ("gr_util", "Graphics/compute engine utilization", "%"),
    pynvml.NVML_GPM_METRIC_SM_UTIL: ("sm_util", "SM utilization", "%"),
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: ("sm_occupancy", "SM occupancy", "%"),
    pynvml.NVML_GPM_METRIC_INTEGER_UTIL: ("integer_util", "Integer pipe utilization", "%"),
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: ("any_tensor_util", "Tensor pipe utilization (any)", "%"),
    pynvml.NVML_GPM_METRIC_DFMA_TENSOR_UTIL: ("dfma_tensor_util", "DFMA tensor utilization", "%"),
    pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL: ("hmma_tensor_util", "HMMA tensor utilization", "%"),
    pynvml.NVML_GPM_METRIC_DMMA_TENSOR_UTIL: ("dmma_tensor_util", "DMMA tensor utilization", "%"),
    pynvml.NVML_GPM_METRIC_IMMA_TENSOR_UTIL: ("imma_tensor_util", "IMMA tensor utilization", "%"),
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: ("dram_bw_util", "DRAM bandwidth utilization", "%"),
    pynvml.NVML_GPM_METRIC_FP64_UTIL: ("fp64_util", "FP64 pipe utilization", "%"),
    pynvml.NVML_GPM_METRIC_FP32_UTIL: ("fp32_util", "FP32 pipe utilization", "%"),
    pynvml.NVML_GPM_METRIC_FP16_UTIL: ("fp16_util", "FP16 pipe utilization", "%"),
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: ("pcie_tx", "PCIe traffic from the GPU", "MiB/sec"),
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: ("pcie_rx", "PCIe traffic to the GPU", "MiB/sec"),
}

_AMPLITUDE, _MEAN, _PERIOD = 0.275, 0.675, 7.0  # the load wave of nvml.py: MEAN + AMPLITUDE*sin(t/PERIOD + phase)


@dataclass(frozen=True)
class Board:
    sm_idle_mhz: int
    sm_boost_mhz: int
    mem_mhz: int
    hbm: bool


def board(spec: SimGpuSpec) -> Board:
    """The clocks and memory kind of a simulated board (by its name; an unknown board gets an H100's)."""
    for prefix, (idle, boost, mem, hbm) in _CLOCKS:
        if spec.name.startswith(prefix):
            return Board(idle, boost, mem, hbm)
    return Board(345, 1980, 2619, True)


def gpm_supported(spec: SimGpuSpec) -> bool:
    """GPM exists on Hopper and later."""
    return spec.arch_nvml >= int(pynvml.NVML_DEVICE_ARCH_HOPPER)


@dataclass(frozen=True)
class _Sample:
    gpu: int
    gi: int | None  # GPU instance sampled, None for the whole GPU
    t: float  # seconds on the simulator's clock
    busy: bool


class TelemetryCalls(SimBase):
    """Clocks, energy, memory temperature and GPM of the simulated NVML."""

    _energy: dict[int, tuple[float, float]] | None = None  # GPU -> (clock of last reading, extra mJ so far)
    _gpm: dict[int, _Sample | None] | None = None  # allocated sample buffers -> their content
    _gpm_next = 1

    # --- activity -----------------------------------------------------------------------------
    def _phase(self, index: int, gi: int | None) -> float:
        return index * 1.3 + (0.0 if gi is None else gi * 0.7)

    def _busy(self, state: State, index: int, gi: int | None) -> bool:
        procs = state["gpus"][index]["processes"]
        return any(p.get("gi_id") == gi for p in procs) if gi is not None else bool(procs)

    def _activity_at(self, t: float, index: int, gi: int | None) -> float:
        return _MEAN + _AMPLITUDE * math.sin(t / _PERIOD + self._phase(index, gi))

    def _activity_mean(self, t1: float, t2: float, index: int, gi: int | None) -> float:
        """Mean of the load wave over [t1, t2] (its integral in closed form)."""
        if t2 - t1 < 1e-9:
            return self._activity_at(t2, index, gi)
        phase = self._phase(index, gi)
        integral = _MEAN * (t2 - t1) - _AMPLITUDE * _PERIOD * (
            math.cos(t2 / _PERIOD + phase) - math.cos(t1 / _PERIOD + phase))
        return integral / (t2 - t1)

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _gpu_activity(self, state: State, index: int) -> float:
        return self._activity_at(self._now(), index, None) if self._busy(state, index, None) else 0.0

    # --- clocks, energy, memory temperature -----------------------------------------------------
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        state = self._enter("nvmlDeviceGetClockInfo")
        index = self._gpu(state, handle)[1]
        b = board(self._spec(index))
        load = self._gpu_activity(state, index)
        if type in (CLOCK_SM, CLOCK_GRAPHICS):
            return b.sm_idle_mhz if load == 0 else round(b.sm_boost_mhz - 120 * (load - 0.4))
        if type == CLOCK_MEM:
            return b.mem_mhz if b.hbm or load > 0 else _GDDR_IDLE_MEM_MHZ
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        state = self._enter("nvmlDeviceGetTotalEnergyConsumption")
        index = self._gpu(state, handle)[1]
        spec = self._spec(index)
        uptime = time.monotonic()
        with self._lock:
            if self._energy is None:
                self._energy = {}
            now = self._now()
            last, extra = self._energy.get(index, (now, 0.0))
            if self._busy(state, index, None) and now > last:
                mean = self._activity_mean(last, now, index, None)
                extra += (spec.power_max_w - spec.power_idle_w) * mean * (now - last) * 1000.0
            self._energy[index] = (now, extra)
        return int(spec.power_idle_w * uptime * 1000.0 + extra)

    def memory_temperature(self, state: State, index: int) -> int:
        """NVML_FI_DEV_MEMORY_TEMP of a whole GPU; NVMLError NOT_SUPPORTED on boards without the sensor."""
        if not board(self._spec(index)).hbm:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return round(36 + index % 3 + 38 * self._gpu_activity(state, index))

    # --- GPM ----------------------------------------------------------------------------------
    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        state = self._enter("nvmlGpmQueryDeviceSupport")
        kind, index, _, _ = self._gpu(state, device, (_DEV, _MIG))
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = GPM_SUPPORT_VERSION
        support.isSupportedDevice = 1 if gpm_supported(self._spec(index)) and kind == _DEV else 0
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self._enter("nvmlGpmSampleAlloc")
        with self._lock:
            if self._gpm is None:
                self._gpm = {}
            n = self._gpm_next
            self._gpm_next = n + 1
            self._gpm[n] = None
        return _ptr(_key(_GPM, n), pynvml.c_nvmlGpmSample_t)

    def _sample_id(self, sample: Any) -> int:
        kind, n, _, _ = _decode(sample)
        if kind != _GPM or self._gpm is None or n not in self._gpm:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return n

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        self._enter("nvmlGpmSampleFree")
        with self._lock:
            n = self._sample_id(gpmSample)
            assert self._gpm is not None
            del self._gpm[n]

    def _take(self, fname: str, device: Any, gi: int | None, sample: Any) -> Any:
        state = self._enter(fname)
        kind, index, _, _ = _decode(device)
        if kind == _MIG:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # GPU instances are sampled through their parent
        self._gpu(state, device)
        if not gpm_supported(self._spec(index)):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        gs = state["gpus"][index]
        if gs.get("lost"):
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if gi is not None:
            if not gs["mig_current"]:
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            self._find_gi(gs, gi)  # NOT_FOUND for an instance that does not exist
        with self._lock:
            n = self._sample_id(sample)
            assert self._gpm is not None
            self._gpm[n] = _Sample(index, gi, self._now(), self._busy(state, index, gi))
        return sample

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        return self._take("nvmlGpmSampleGet", device, None, gpmSample)

    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> Any:
        return self._take("nvmlGpmMigSampleGet", device, int(gpuInstanceId), gpmSample)

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        """Fill ``metricsGet.metrics[:numMetrics]`` (a ``c_nvmlGpmMetricsGet_t``) from its two samples."""
        self._enter("nvmlGpmMetricsGet")
        if int(metricsGet.version) != GPM_METRICS_GET_VERSION:
            raise _err(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        with self._lock:
            s1 = self._gpm.get(self._sample_id(metricsGet.sample1)) if self._gpm else None
            s2 = self._gpm.get(self._sample_id(metricsGet.sample2)) if self._gpm else None
        if s1 is None or s2 is None or (s1.gpu, s1.gi) != (s2.gpu, s2.gi) or s2.t <= s1.t:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        count = int(metricsGet.numMetrics)
        if count > len(metricsGet.metrics):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        mean = self._activity_mean(s1.t, s2.t, s1.gpu, s1.gi)
        # idle at both ends: nothing ran; busy at one end only: the wave over the half that ran
        activity = mean * (int(s1.busy) + int(s2.busy)) / 2.0
        for i in range(count):
            m = metricsGet.metrics[i]
            mid = int(m.metricId)
            if mid in _GPM_SHARE:
                m.value = 100.0 * activity * _GPM_SHARE[mid]
            elif mid in _GPM_PCIE_MIBS:
                m.value = activity * _GPM_PCIE_MIBS[mid]
            else:
                m.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                m.value = 0.0
                continue
            m.nvmlReturn = pynvml.NVML_SUCCESS
            short, long, unit = GPM_METRIC_INFO[mid]
            m.metricInfo.shortName, m.metricInfo.longName, m.metricInfo.unit = (
                short.encode(), long.encode(), unit.encode())
        return metricsGet

