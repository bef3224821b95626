"""A do-nothing GPU source of the daemon's ``GpuSource`` shape; test fakes override what they exercise."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from nodeagent.errors import NvmlError
from nodeagent.gpu.inventory import GpuProcess, Inventory, MigDevice, MigProfile
from nodeagent.gpu.ports import RECOVERY_NONE, GpuMetrics


class QuietGpus:
    """No GPUs, no events, every GPU healthy; MIG administration refuses."""

    fault_domain: str | None = None
    restricted_facts: tuple[str, ...] = ()

    def discover(self, *, partial: bool = False) -> Inventory:
        return Inventory("550.54.15", 12040, ())

    def device_count(self) -> int:
        return len(self.discover().gpus)

    def processes(self, index: int) -> tuple[GpuProcess, ...]:
        return ()

    def wait_events(self, timeout_ms: int) -> Sequence[Any]:
        time.sleep(timeout_ms / 1000.0)  # an idle NVML wait: nothing happened within the timeout
        return []

    def gpu_healthy(self, index: int) -> bool:
        return True

    def recovery_action(self, index: int) -> int:
        return RECOVERY_NONE

    def gpu_uuid(self, index: int) -> str:
        return f"GPU-{index}"

    def metrics(self, index: int) -> GpuMetrics:
        return GpuMetrics(index, 0, 0, 81559, 81559, 30, 60.0)

    def mig_mode(self, index: int) -> tuple[bool, bool]:
        return False, False

    def set_mig_mode(self, index: int, enabled: bool) -> bool:
        raise NvmlError("MIG administration is not part of this fake", subject=f"GPU {index}")

    def reset_gpu(self, index: int) -> None:
        raise NvmlError("reset is not part of this fake", subject=f"GPU {index}")

    def offered_profile(self, index: int, profile_name: str) -> MigProfile:
        raise NvmlError("MIG administration is not part of this fake", subject=f"GPU {index}")

    def create_mig_device(self, index: int, profile_name: str, placement_start: int | None = None) -> MigDevice:
        raise NvmlError("MIG administration is not part of this fake", subject=f"GPU {index}")

    def destroy_mig_device(self, index: int, gi_id: int) -> None:
        raise NvmlError("MIG administration is not part of this fake", subject=f"GPU {index}")

    def close(self) -> None:
        pass
