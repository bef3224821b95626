"""The simulator's ``GpuResetter``: what ``nvidia-smi --gpu-reset`` does to a simulated GPU."""

from __future__ import annotations

from collections.abc import Sequence

import pynvml

from nodeagent.errors import GpuBusyError, GpuLostError, NvmlError, ResetRequiredError
from nodeagent.simulator.nvml import SimulatedNvml


class SimGpuResetter:
    """Resets a GPU of ``sim`` (fails while processes run; a passthrough VM cannot reset at all)."""

    def __init__(self, sim: SimulatedNvml) -> None:
        self.sim = sim

    def reset_gpu(self, index: int) -> None:
        try:
            self.sim.simResetGpu(self.sim.nvmlDeviceGetHandleByIndex(index))
        except pynvml.NVMLError as e:
            code = int(e.value)
            msg = f"GPU {index}: GPU reset failed: {e}"
            if code == pynvml.NVML_ERROR_IN_USE:
                raise GpuBusyError(msg, subject=str(index), code=code) from e
            if code == pynvml.NVML_ERROR_RESET_REQUIRED:
                raise ResetRequiredError(msg + "; reboot the host to apply the change", subject=str(index),
                                         code=code) from e
            if code == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLostError(msg, subject=str(index), code=code) from e
            raise NvmlError(msg, subject=str(index), code=code) from e


class SimGroupResetter:
    """The remediation ``Resetter`` on a simulator: resets the GPUs of a group by UUID, one call each (the
    in-process twin of ``nvidia-smi -r -i <UUID>,...``)."""

    def __init__(self, sim: SimulatedNvml) -> None:
        self.sim = sim

    def reset(self, uuids: Sequence[str]) -> None:
        for uuid in uuids:
            try:
                self.sim.simResetGpu(self.sim.nvmlDeviceGetHandleByUUID(uuid))
            except pynvml.NVMLError as e:
                code = int(e.value)
                msg = f"GPU {uuid}: GPU reset failed: {e}"
                if code == pynvml.NVML_ERROR_IN_USE:
                    raise GpuBusyError(msg, subject=uuid, code=code) from e
                if code == pynvml.NVML_ERROR_GPU_IS_LOST:
                    raise GpuLostError(msg + " (fallen off the bus)", subject=uuid, code=code) from e
                raise NvmlError(msg, subject=uuid, code=code) from e
