"""The NVML adapter: the only code that calls NVML, as one object implementing every GPU port.

``NvmlAdapter`` receives the NVML module by injection — the real ``pynvml`` or
``nodeagent.simulator.SimulatedNvml`` — and runs the same code on both, plus a ``GpuResetter`` (how a GPU is
reset; ``nvidia-smi --gpu-reset`` unless another is given). Its parts, one module per port
(``gpu/ports.py``): discovery (``nvml_discovery``), MIG administration (``nvml_mig``), health events
(``nvml_events``) and telemetry (``nvml_telemetry``), over one NVML session (``nvml_session``).
"""

from __future__ import annotations

from nodeagent.gpu.nvml_cc import NvmlConfCompute
from nodeagent.gpu.nvml_events import NvmlHealthEvents
from nodeagent.gpu.nvml_mig import NvmlMigAdmin
from nodeagent.gpu.nvml_remediation import NvmlRemediation
from nodeagent.gpu.nvml_session import DRIVER_NOT_LOADED_MESSAGE, NOT_FOUND_MESSAGE, as_int
from nodeagent.gpu.nvml_telemetry import NvmlTelemetry
from nodeagent.gpu.ports import GpuEvent, GpuMetrics

__all__ = ["DRIVER_NOT_LOADED_MESSAGE", "NOT_FOUND_MESSAGE", "GpuEvent", "GpuMetrics", "NvmlAdapter"]


class NvmlAdapter(NvmlMigAdmin, NvmlHealthEvents, NvmlTelemetry, NvmlConfCompute, NvmlRemediation):
    """NVML for the rest of nodeagent. Methods are blocking; call them from a thread in async code."""

    def __enter__(self) -> NvmlAdapter:
        return self

    # --- compute mode (the MPS manager's ComputeModes port; setting it needs root) ---------------------------
    def compute_mode(self, uuid: str) -> int:
        """The compute mode (nvmlComputeMode_t) of the GPU with ``uuid``."""
        return as_int(self._call("nvmlDeviceGetComputeMode", self._call("nvmlDeviceGetHandleByUUID", uuid)))

    def set_compute_mode(self, uuid: str, mode: int) -> None:
        """Set the compute mode of the GPU with ``uuid`` (at once; the driver resets it to DEFAULT at reboot)."""
        self._call("nvmlDeviceSetComputeMode", self._call("nvmlDeviceGetHandleByUUID", uuid), mode)
