"""Typed GPU ports: what the rest of nodeagent may ask of the GPU layer, one Protocol per concern.

``NvmlAdapter`` (``gpu/nvml.py``) implements all of them over real NVML or the simulator; callers depend on
the narrowest port they need, and tests hand in small fakes of that port. Nothing outside ``nodeagent.gpu``
should need more than these.

- ``GpuDiscovery``: the node's GPUs as one ``Inventory`` (identity, MIG state, profiles, processes, links).
- ``MigAdministration``: MIG mode, GPU instances, and the GPU reset that activates a pending mode.
- ``HealthEvents``: XID/ECC events, the lost-GPU probe and the driver's recovery action.
- ``GpuTelemetry``: point-in-time readings for metrics.
- ``GpuResetter``: how a GPU is reset (``nvidia-smi --gpu-reset`` on a host, the simulator's reset
  in simulation); injected into the adapter, so production code never asks whether it is simulated.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from nodeagent.gpu.inventory import GpuProcess, Inventory, MigDevice, MigProfile

# nvmlDeviceGpuRecoveryAction_t, read through field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230)
RECOVERY_NONE = 0
RECOVERY_ACTION_NAMES = {
    0: "none",
    1: "GPU reset",
    2: "node reboot",
    3: "drain P2P",
    4: "drain and reset",
    5: "recover IMEX domain",
    6: "bus reset",
    7: "system reboot",
}


def recovery_action_name(action: int) -> str:
    return RECOVERY_ACTION_NAMES.get(action, f"action {action}")


@dataclasses.dataclass(frozen=True)
class GpuEvent:
    """One health-relevant NVML event."""

    gpu_index: int | None
    kind: str  # "xid" | "ecc-double" | "ecc-single" | "other"
    xid: int = 0  # XID code for kind "xid" (79 = fallen off the bus)
    event_type: int = 0  # raw nvmlEventType bits
    gi_id: int | None = None  # GPU instance the event is about, when NVML says
    ci_id: int | None = None


@dataclasses.dataclass(frozen=True)
class MigMetrics:
    """Readings of one GPU instance (its MIG device): memory, and GPM activity on Hopper and later."""

    gi_id: int
    memory_used_mib: int
    memory_free_mib: int
    gpm: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class GpuMetrics:
    """Point-in-time readings of one GPU; None where NVML has no figure (utilisation in MIG mode, memory
    temperature on GDDR boards, GPM before Hopper or before the second sample).

    ``gpm`` maps GPM metric names (``GPM_METRICS``) to their value over the time since the previous reading
    of this GPU: percentages, PCIe in MiB/s. ``mig`` has one entry per GPU instance in MIG mode."""

    index: int
    utilisation_pct: int | None
    memory_used_mib: int
    memory_free_mib: int
    memory_total_mib: int
    temperature_c: int
    power_w: float
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    memory_temperature_c: int | None = None
    energy_mj: int | None = None
    gpm: dict[str, float] = dataclasses.field(default_factory=dict)
    mig: tuple[MigMetrics, ...] = ()


# GPM metrics read, by name: NVML's metric id (nvmlGpmMetricId_t)
GPM_METRICS: dict[str, int] = {
    "graphics_util": 1,
    "sm_util": 2,
    "sm_occupancy": 3,
    "any_tensor_util": 5,
    "dram_bw_util": 10,
    "fp64_util": 11,
    "fp32_util": 12,
    "fp16_util": 13,
    "pcie_tx_mibs": 20,
    "pcie_rx_mibs": 21,
}


class GpuDiscovery(Protocol):
    def device_count(self) -> int: ...

    def discover(self, *, partial: bool = False) -> Inventory: ...

    def processes(self, index: int) -> tuple[GpuProcess, ...]: ...

    @property
    def restricted_facts(self) -> tuple[str, ...]:
        """Facts the last discovery could not read without root (empty when it read everything)."""
        ...


class MigAdministration(Protocol):
    def discover(self) -> Inventory: ...

    @property
    def restricted_facts(self) -> tuple[str, ...]:
        """Facts the last discovery could not read without root (a MIG apply refuses to act without them)."""
        ...

    def mig_mode(self, index: int) -> tuple[bool, bool]: ...

    def set_mig_mode(self, index: int, enabled: bool) -> bool:
        """True when the new mode waits for a GPU reset (``reset_gpu``) or a reboot to take effect;
        ``ResetRequiredError`` when only a reboot can make it effective."""
        ...

    def reset_gpu(self, index: int) -> None: ...

    def offered_profile(self, index: int, profile_name: str) -> MigProfile: ...

    def create_mig_device(self, index: int, profile_name: str, placement_start: int | None = None) -> MigDevice:
        ...

    def destroy_mig_device(self, index: int, gi_id: int) -> None: ...

    def processes(self, index: int) -> tuple[GpuProcess, ...]: ...


class HealthEvents(Protocol):
    def wait_events(self, timeout_ms: int) -> list[GpuEvent]: ...

    def gpu_healthy(self, index: int) -> bool: ...

    def recovery_action(self, index: int) -> int:
        """The driver's recovery action for the GPU (``RECOVERY_NONE`` when it needs none or the driver
        does not report one)."""
        ...


class GpuTelemetry(Protocol):
    def metrics(self, index: int) -> GpuMetrics: ...


class GpuResetter(Protocol):
    def reset_gpu(self, index: int) -> None:
        """Reset one GPU; raises ``nodeagent.errors`` classes (``GpuBusyError`` while processes run,
        ``ResetRequiredError`` where no reset is possible and only a reboot helps)."""
        ...
