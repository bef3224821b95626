"""The ``GpuTelemetry`` port over NVML: point-in-time readings for metrics.

One ``metrics(index)`` call is one reading of a GPU: utilisation, memory, temperatures, power, clocks,
total energy, and for each GPU instance in MIG mode its memory. GPU utilisation has no whole-GPU figure in
MIG mode (NVML answers NOT_SUPPORTED, nvidia-smi shows N/A): it is None then, and metrics leave the series
out rather than report zero; so for every other value NVML does not have on this board.

GPM (Hopper and later): each reading takes one GPM sample of the GPU (in MIG mode one per GPU instance,
through the parent with ``nvmlGpmMigSampleGet``: GPM does not take MIG device handles) and computes the
metrics between it and the previous reading's sample, which it then frees; the first reading has none.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from nodeagent.errors import NvmlError
from nodeagent.gpu.nvml_session import NvmlSession, as_int
from nodeagent.gpu.ports import GPM_METRICS, GpuMetrics, MigMetrics

MIB = 1024 * 1024
FI_MEMORY_TEMP = 82  # NVML_FI_DEV_MEMORY_TEMP
CLOCK_SM, CLOCK_MEM = 1, 2  # nvmlClockType_t
GPM_METRICS_GET_VERSION = 1

log = logging.getLogger(__name__)


class NvmlTelemetry(NvmlSession):
    _gpm_support: dict[int, bool] | None = None
    _gpm_last: dict[tuple[int, int | None], Any] | None = None  # (GPU, GPU instance) -> previous sample

    def metrics(self, index: int) -> GpuMetrics:
        h = self._handle(index)
        util = self._try("nvmlDeviceGetUtilizationRates", h, gpu=index)
        mem = self._call("nvmlDeviceGetMemoryInfo", h, gpu=index)
        temp = self._try("nvmlDeviceGetTemperature", h, self.nvml.NVML_TEMPERATURE_GPU, gpu=index)
        power = self._try("nvmlDeviceGetPowerUsage", h, gpu=index)
        sm_clock = self._try("nvmlDeviceGetClockInfo", h, CLOCK_SM, gpu=index)
        mem_clock = self._try("nvmlDeviceGetClockInfo", h, CLOCK_MEM, gpu=index)
        energy = self._try("nvmlDeviceGetTotalEnergyConsumption", h, gpu=index)
        mig = self._mig_readings(index, h)
        if not mig:
            self._gpm_forget(index, keep={None})
        gpm = {} if mig else self._gpm_read(index, h, None)
        return GpuMetrics(
            index=index,
            utilisation_pct=int(util.gpu) if util is not None else None,
            memory_used_mib=int(mem.used) // MIB,
            memory_free_mib=int(mem.free) // MIB,
            memory_total_mib=int(mem.total) // MIB,
            temperature_c=int(temp or 0),
            power_w=round(int(power or 0) / 1000.0, 1),
            sm_clock_mhz=None if sm_clock is None else int(sm_clock),
            mem_clock_mhz=None if mem_clock is None else int(mem_clock),
            memory_temperature_c=self._memory_temperature(index, h),
            energy_mj=None if energy is None else int(energy),
            gpm=gpm,
            mig=mig,
        )

    def _memory_temperature(self, index: int, h: Any) -> int | None:
        values = self._try("nvmlDeviceGetFieldValues", h, [FI_MEMORY_TEMP], gpu=index)
        if values is None or int(values[0].nvmlReturn) != 0:
            return None
        return int(values[0].value.uiVal)

    def _mig_readings(self, index: int, h: Any) -> tuple[MigMetrics, ...]:
        """One reading per GPU instance of a GPU in MIG mode (empty when MIG is off or not offered)."""
        mode = self._try("nvmlDeviceGetMigMode", h, gpu=index)
        if mode is None or not int(mode[0]):
            return ()
        out: dict[int, MigMetrics] = {}
        for i in range(int(self._try("nvmlDeviceGetMaxMigDeviceCount", h, gpu=index) or 0)):
            mh = self._try("nvmlDeviceGetMigDeviceHandleByIndex", h, i, gpu=index)
            if mh is None or not as_int(self._call("nvmlDeviceIsMigDeviceHandle", mh, gpu=index)):
                continue
            gi_id = int(self._call("nvmlDeviceGetGpuInstanceId", mh, gpu=index))
            if gi_id in out:
                continue
            mem = self._call("nvmlDeviceGetMemoryInfo", mh, gpu=index)
            out[gi_id] = MigMetrics(gi_id, int(mem.used) // MIB, int(mem.free) // MIB,
                                    self._gpm_read(index, h, gi_id))
        self._gpm_forget(index, keep=set[int | None](out))
        return tuple(out[k] for k in sorted(out))

    # --- GPM ----------------------------------------------------------------------------------
    def _gpm_ok(self, index: int, h: Any) -> bool:
        if self._gpm_support is None:
            self._gpm_support = {}
        ok = self._gpm_support.get(index)
        if ok is None:
            support = self._try("nvmlGpmQueryDeviceSupport", h, gpu=index)
            ok = support is not None and bool(int(support.isSupportedDevice))
            self._gpm_support[index] = ok
        return ok

    def _gpm_read(self, index: int, h: Any, gi_id: int | None) -> dict[str, float]:
        """GPM metrics since the previous reading of this GPU (instance); {} on the first or without GPM."""
        if not self._gpm_ok(index, h):
            return {}
        if self._gpm_last is None:
            self._gpm_last = {}
        try:
            sample = self._call("nvmlGpmSampleAlloc", gpu=index)
        except NvmlError as e:
            log.debug("%s: no GPM sample buffer: %s", self.label(index), e)
            return {}
        try:
            if gi_id is None:
                got = self._try("nvmlGpmSampleGet", h, sample, gpu=index)
            else:
                got = self._try("nvmlGpmMigSampleGet", h, gi_id, sample, gpu=index)
        except NvmlError as e:  # GPM is extra: a GPM failure (e.g. no permission) leaves the rest of the reading
            log.debug("%s: GPM sample failed: %s", self.label(index), e)
            got = None
        if got is None:
            self._gpm_free(sample)
            return {}
        previous = self._gpm_last.get((index, gi_id))
        self._gpm_last[(index, gi_id)] = sample
        if previous is None:
            return {}
        try:
            return self._gpm_metrics(index, previous, sample)
        finally:
            self._gpm_free(previous)

    def _gpm_metrics(self, index: int, first: Any, second: Any) -> dict[str, float]:
        request = self.nvml.c_nvmlGpmMetricsGet_t()
        request.version = GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = first, second
        for i, metric_id in enumerate(GPM_METRICS.values()):
            request.metrics[i].metricId = metric_id
        try:
            if self._try("nvmlGpmMetricsGet", request, gpu=index) is None:
                return {}
        except NvmlError as e:
            log.debug("%s: GPM metrics failed: %s", self.label(index), e)
            return {}
        return {name: float(request.metrics[i].value) for i, name in enumerate(GPM_METRICS)
                if int(request.metrics[i].nvmlReturn) == 0}

    def _gpm_free(self, sample: Any) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlGpmSampleFree(sample)

    def _gpm_forget(self, index: int, keep: set[int | None]) -> None:
        """Free the samples of GPU instances that are gone (and of the whole GPU, now in MIG mode)."""
        for key in [k for k in (self._gpm_last or {}) if k[0] == index and k[1] not in keep]:
            assert self._gpm_last is not None
            self._gpm_free(self._gpm_last.pop(key))

    def _before_close(self) -> None:
        for sample in (self._gpm_last or {}).values():
            self._gpm_free(sample)
        self._gpm_last = {}
        super()._before_close()

