"""The simulated NVML's confidential-computing calls (nvml.h, "Confidential Computing"), Hopper and later.

Each GPU holds a CC mode (``off``, ``on``, ``devtools``) and a protected-PCIe flag; the admin tool's
stand-in (``ccadmin``) writes the pending values and a GPU reset (or reboot) makes them current. The system
calls summarise the GPUs: the CC feature is enabled when every GPU is in ``on``/``devtools``, devtools mode
when every GPU is in ``devtools``, multi-GPU protected PCIe when every GPU has it. The environment is
production when the machine's CPU has a TEE (``cpu_tee``), unavailable otherwise; a machine without a
CC-capable GPU answers NOT_SUPPORTED, as drivers do on older GPUs. ``nvmlSystemGetConfComputeSettings``
checks its structure's version (ARGUMENT_VERSION_MISMATCH) and, like pynvml's binding, returns the code.
"""

from __future__ import annotations

from typing import Any

import pynvml

from nodeagent.simulator.nvml_base import SimBase, _err
from nodeagent.simulator.state import State

CPU_CAPS = {"none": pynvml.NVML_CC_SYSTEM_CPU_CAPS_NONE, "tdx": pynvml.NVML_CC_SYSTEM_CPU_CAPS_INTEL_TDX,
            "sev-snp": pynvml.NVML_CC_SYSTEM_CPU_CAPS_AMD_SEV_SNP}
CC_MODES = ("off", "on", "devtools")
ERROR_ARGUMENT_VERSION_MISMATCH = 25  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def _struct(arg: Any) -> Any:
    """The structure behind a ``ctypes.byref`` (or the structure itself)."""
    return getattr(arg, "_obj", arg)


class CcCalls(SimBase):
    def _cc_state(self, fname: str) -> State:
        state = self._enter(fname)
        if not any(g.cc_capable for g in self.machine.gpus):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return state

    def _modes(self, state: State) -> list[str]:
        return [str(gs.get("cc_mode", "off")) for gs in state["gpus"]]

    def _environment(self) -> int:
        if self.machine.cpu_tee == "none":
            return int(pynvml.NVML_CC_SYSTEM_ENVIRONMENT_UNAVAILABLE)
        return int(pynvml.NVML_CC_SYSTEM_ENVIRONMENT_PROD)

    def nvmlSystemGetConfComputeState(self) -> Any:
        state = self._cc_state("nvmlSystemGetConfComputeState")
        modes = self._modes(state)
        out = pynvml.c_nvmlConfComputeSystemState_t()
        out.environment = self._environment()
        out.ccFeature = int(all(m in ("on", "devtools") for m in modes))
        out.devToolsMode = int(all(m == "devtools" for m in modes))
        return out

    def nvmlSystemGetConfComputeSettings(self, settings: Any) -> int:
        state = self._cc_state("nvmlSystemGetConfComputeSettings")
        s = _struct(settings)
        if int(s.version) != pynvml.nvmlSystemConfComputeSettings_v1:
            return ERROR_ARGUMENT_VERSION_MISMATCH
        modes = self._modes(state)
        s.environment = self._environment()
        s.ccFeature = int(all(m in ("on", "devtools") for m in modes))
        s.devToolsMode = int(all(m == "devtools" for m in modes))
        s.multiGpuMode = (pynvml.NVML_CC_SYSTEM_MULTIGPU_PROTECTED_PCIE
                          if all(gs.get("ppcie", False) for gs in state["gpus"]) else pynvml.NVML_CC_SYSTEM_MULTIGPU_NONE)
        return int(pynvml.NVML_SUCCESS)

    def nvmlSystemGetConfComputeCapabilities(self) -> Any:
        self._cc_state("nvmlSystemGetConfComputeCapabilities")
        out = pynvml.c_nvmlConfComputeSystemCaps_t()
        out.cpuCaps = CPU_CAPS[self.machine.cpu_tee]
        out.gpusCaps = int(all(g.cc_capable for g in self.machine.gpus))
        return out

    def nvmlDeviceGetConfComputeMemSizeInfo(self, handle: Any) -> Any:
        state = self._enter("nvmlDeviceGetConfComputeMemSizeInfo")
        index = self._gpu(state, handle)[1]
        spec = self._spec(index)
        if not spec.cc_capable:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        total = spec.memory_mib * 1024
        out = pynvml.c_nvmlConfComputeMemSizeInfo_t()
        on = state["gpus"][index].get("cc_mode", "off") != "off"
        out.protectedMemSizeKib = total if on else 0
        out.unprotectedMemSizeKib = 0 if on else total
        return out

    def nvmlSystemGetConfComputeGpusReadyState(self) -> int:
        state = self._cc_state("nvmlSystemGetConfComputeGpusReadyState")
        return int(all(gs.get("cc_ready", 0) == 1 for gs in state["gpus"]))

    def nvmlSystemSetConfComputeGpusReadyState(self, ready: int) -> None:
        state = self._cc_state("nvmlSystemSetConfComputeGpusReadyState")
        if int(ready) not in (pynvml.NVML_CC_ACCEPTING_CLIENT_REQUESTS_FALSE,
                              pynvml.NVML_CC_ACCEPTING_CLIENT_REQUESTS_TRUE):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not all(m in ("on", "devtools") for m in self._modes(state)):
            raise _err(pynvml.NVML_ERROR_INVALID_STATE)  # ready only means something in CC mode
        if not self.privileged:
            raise _err(pynvml.NVML_ERROR_NO_PERMISSION)
        with self.store.transaction() as st:
            for gs in st["gpus"]:
                gs["cc_ready"] = int(ready)
