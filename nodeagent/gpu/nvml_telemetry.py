"""The ``GpuTelemetry`` port over NVML: point-in-time readings for metrics.

GPU utilisation has no whole-GPU figure in MIG mode (NVML answers NOT_SUPPORTED, nvidia-smi shows N/A):
it is None then, and metrics leave the series out rather than report zero.
"""

from __future__ import annotations

from nodeagent.gpu.nvml_session import NvmlSession
from nodeagent.gpu.ports import GpuMetrics

MIB = 1024 * 1024


class NvmlTelemetry(NvmlSession):
    def metrics(self, index: int) -> GpuMetrics:
        h = self._handle(index)
        util = self._try("nvmlDeviceGetUtilizationRates", h, gpu=index)
        mem = self._call("nvmlDeviceGetMemoryInfo", h, gpu=index)
        temp = self._try("nvmlDeviceGetTemperature", h, self.nvml.NVML_TEMPERATURE_GPU, gpu=index)
        power = self._try("nvmlDeviceGetPowerUsage", h, gpu=index)
        return GpuMetrics(
            index=index,
            utilisation_pct=int(util.gpu) if util is not None else None,
            memory_used_mib=int(mem.used) // MIB,
            memory_free_mib=int(mem.free) // MIB,
            memory_total_mib=int(mem.total) // MIB,
            temperature_c=int(temp or 0),
            power_w=round(int(power or 0) / 1000.0, 1),
        )
