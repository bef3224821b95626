"""Confidential computing and persistence mode through NVML (nvml.h "Confidential Computing" and
``nvmlDeviceSet/GetPersistenceMode``): the system's CC state, settings and capabilities, the protected
memory of a GPU, the GPUs' ready state; and the persistence mode the workload switch turns off and on."""

from __future__ import annotations

import ctypes
from typing import Any

from nodeagent.gpu.nvml_session import NvmlSession, as_int

NVML_SUCCESS = 0


class NvmlConfCompute(NvmlSession):
    def cc_system(self) -> dict[str, int] | None:
        """``environment``, ``feature``, ``devtools``, ``multi_gpu``, ``cpu_caps``, ``gpus_caps`` and
        ``ready`` (-1: unknown) as NVML reports them; None when this driver has no CC calls."""
        state = self._try("nvmlSystemGetConfComputeState")
        if state is None:
            return None
        caps = self._try("nvmlSystemGetConfComputeCapabilities")
        out = {"environment": as_int(state.environment), "feature": as_int(state.ccFeature),
               "devtools": as_int(state.devToolsMode), "multi_gpu": 0,
               "cpu_caps": 0 if caps is None else as_int(caps.cpuCaps),
               "gpus_caps": 0 if caps is None else as_int(caps.gpusCaps)}
        settings_type = getattr(self.nvml, "c_nvmlSystemConfComputeSettings_v1_t", None)
        if settings_type is not None:
            settings = settings_type()
            # pynvml hands the pointer through and returns the bare return code of this one call
            code = self._try("nvmlSystemGetConfComputeSettings", ctypes.byref(settings))
            if code is not None and as_int(code) == NVML_SUCCESS:
                out["multi_gpu"] = as_int(settings.multiGpuMode)
        ready = self._try("nvmlSystemGetConfComputeGpusReadyState")
        out["ready"] = -1 if ready is None else as_int(ready)
        return out

    def cc_memory_kib(self, index: int) -> tuple[int, int] | None:
        """(protected, unprotected) memory of a GPU in KiB; None where NVML does not report it."""
        info: Any = self._try("nvmlDeviceGetConfComputeMemSizeInfo", self._handle(index), gpu=index)
        if info is None:
            return None
        return as_int(info.protectedMemSizeKib), as_int(info.unprotectedMemSizeKib)

    def set_cc_ready(self, ready: bool) -> None:
        """Let the GPUs accept client requests (or not) in CC mode."""
        self._call("nvmlSystemSetConfComputeGpusReadyState", 1 if ready else 0)

    def persistence_mode(self, index: int) -> bool | None:
        return self._persistence(self._handle(index), gpu=index)

    def set_persistence_mode(self, index: int, enabled: bool) -> None:
        self._set_persistence(self._handle(index), enabled, gpu=index)
