"""The NVML side of GPU remediation, by GPU UUID: processes on it, persistence mode, NVML drain state,
health and the driver's recovery action (``nodeagent.remediation.pipeline.GpuControl``).

NVML's drain calls take the GPU's PCI address and are refused (IN_USE) while persistence mode is on, so the
pipeline turns persistence off first (nvml.h, "Drain states").
"""

from __future__ import annotations

from typing import Any

from nodeagent.errors import GpuLostError, NvmlError
from nodeagent.gpu.nvml_events import FI_GPU_RECOVERY_ACTION
from nodeagent.gpu.nvml_session import FEATURE_DISABLED, FEATURE_ENABLED, SUCCESS, NvmlSession, as_int


class NvmlRemediation(NvmlSession):
    def _by_uuid(self, uuid: str) -> Any:
        return self._call("nvmlDeviceGetHandleByUUID", uuid)

    def process_count(self, uuid: str) -> int:
        """Compute processes on the GPU, its MIG instances included (what blocks a reset)."""
        return len(self._call("nvmlDeviceGetComputeRunningProcesses", self._by_uuid(uuid)) or ())

    def persistence_mode_of(self, uuid: str) -> bool | None:
        return self._persistence(self._by_uuid(uuid))

    def set_persistence_mode_of(self, uuid: str, enabled: bool) -> None:
        self._set_persistence(self._by_uuid(uuid), enabled)

    def set_drain(self, uuid: str, draining: bool) -> None:
        pci = self._call("nvmlDeviceGetPciInfo", self._by_uuid(uuid))
        self._call("nvmlDeviceModifyDrainState", pci, FEATURE_ENABLED if draining else FEATURE_DISABLED)

    def drain_state(self, uuid: str) -> bool:
        pci = self._call("nvmlDeviceGetPciInfo", self._by_uuid(uuid))
        return as_int(self._call("nvmlDeviceQueryDrainState", pci)) == FEATURE_ENABLED

    def healthy(self, uuid: str) -> bool:
        """False when the GPU does not answer (lost) or cannot be found by its UUID any more."""
        try:
            self._call("nvmlDeviceGetMemoryInfo", self._by_uuid(uuid))
        except GpuLostError:
            return False
        except NvmlError:
            return False
        return True

    def recovery_action_of(self, uuid: str) -> int:
        values = self._try("nvmlDeviceGetFieldValues", self._by_uuid(uuid), [FI_GPU_RECOVERY_ACTION])
        if values is None or len(values) == 0 or int(values[0].nvmlReturn) != SUCCESS:
            return 0
        return int(values[0].value.uiVal)
