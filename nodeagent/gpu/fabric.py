"""The NVLink clique of a node from its GPUs' fabric info (pure): the ``nvidia.com/gpu.clique`` value and,
when it is withheld, why.

The value is what gpu-feature-discovery writes: the cluster UUID in canonical lower-case form, ``.``, the
clique ID in decimal (``7b968a6d-c8aa-45e1-9e07-e1e51be99c31.1``). A GPU counts only when it is attached to
the fabric as NVIDIA's go-nvlib decides it (state COMPLETED, status SUCCESS, a non-zero cluster UUID); the
label is withheld while any fabric GPU is not, or when the node's GPUs name different cliques. GPUs without
fabric support (before Hopper, PCIe boards) make the node no rack member: no label, nothing to report.
The health mask and summary do not withhold the label (GFD does not look at them); they are reported.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nodeagent.gpu.inventory import Fabric, FabricHealthSummary, FabricState, Inventory

CLIQUE_LABEL = "nvidia.com/gpu.clique"
ZERO_UUID = "00000000-0000-0000-0000-000000000000"
NVML_SUCCESS = 0

# healthMask fields: name -> (shift, width), nvml.h NVML_GPU_FABRIC_HEALTH_MASK_*
HEALTH_FIELDS: dict[str, tuple[int, int]] = {
    "degraded_bandwidth": (0, 0x3),
    "route_recovery": (2, 0x3),
    "route_unhealthy": (4, 0x3),
    "access_timeout_recovery": (6, 0x3),
    "incorrect_configuration": (8, 0xF),
    "partition_assigned": (12, 0x3),
}
TRUE, FALSE = 1, 2  # the values of the two-state fields (0: not supported)
INCORRECT_CONFIGURATION = {
    1: "none", 2: "incorrect system GUID", 3: "incorrect chassis serial number", 4: "no partition",
    5: "insufficient NVLinks", 6: "incompatible GPU firmware", 7: "invalid location", 8: "GPU state invalid",
}
_PROBLEM_FIELDS = {  # two-state fields whose TRUE is a problem, as a message names it
    "degraded_bandwidth": "degraded bandwidth",
    "route_recovery": "route recovery in progress",
    "route_unhealthy": "route unhealthy",
    "access_timeout_recovery": "access-timeout recovery in progress",
}


class CliqueReason(enum.Enum):
    """Why the label is (not) there: the Node condition's reason."""

    JOINED = "CliqueJoined"
    NOT_STARTED = "FabricNotStarted"
    IN_PROGRESS = "FabricInProgress"
    FABRIC_ERROR = "FabricError"
    NO_CLUSTER = "NoFabricCluster"
    DISAGREE = "CliqueMismatch"
    GPU_LOST = "GpuLost"


def health_field(mask: int, name: str) -> int:
    shift, width = HEALTH_FIELDS[name]
    return (mask >> shift) & width


def health_problems(fabric: Fabric) -> list[str]:
    """The health mask's problems in words (empty: healthy, or no mask)."""
    if fabric.health_mask is None:
        return []
    out = [text for name, text in _PROBLEM_FIELDS.items() if health_field(fabric.health_mask, name) == TRUE]
    config = health_field(fabric.health_mask, "incorrect_configuration")
    if config > 1:
        out.append("incorrect configuration: " + INCORRECT_CONFIGURATION.get(config, f"code {config}"))
    if health_field(fabric.health_mask, "partition_assigned") == FALSE:
        out.append("no partition assigned")
    return out


def state_name(state: int) -> str:
    try:
        return FabricState(state).name
    except ValueError:
        return f"UNKNOWN({state})"


def summary_name(summary: int | None) -> str:
    if summary is None:
        return "NOT_SUPPORTED"
    try:
        return FabricHealthSummary(summary).name
    except ValueError:
        return f"UNKNOWN({summary})"


def attached(f: Fabric) -> bool:
    """go-nvlib's IsFabricAttached: COMPLETED, SUCCESS and a non-zero cluster UUID."""
    return f.state == FabricState.COMPLETED and f.status == NVML_SUCCESS and f.cluster_uuid != ZERO_UUID


def clique_id(f: Fabric) -> str:
    return f"{f.cluster_uuid.lower()}.{f.clique_id}"


@dataclass(frozen=True)
class CliqueDecision:
    """The node's clique: ``value`` the label value or None; ``applicable`` False when the node is no rack
    member at all (no fabric support, or an NVSwitch system without a cluster): then nothing is reported."""

    applicable: bool
    value: str | None
    reason: CliqueReason | None
    message: str
    degraded: tuple[str, ...] = ()  # health-mask problems (reported, the label stays)

    @property
    def withheld(self) -> bool:
        return self.applicable and self.value is None


def decide(inv: Inventory) -> CliqueDecision:
    """The clique label decision for ``inv`` (pure)."""
    fabric_gpus = [g for g in sorted(inv.gpus, key=lambda g: g.index)
                   if g.fabric is not None and g.fabric.state != FabricState.NOT_SUPPORTED]
    if not fabric_gpus:
        return CliqueDecision(False, None, None, "no GPU of this node is on an NVLink fabric")
    if all(g.fabric is not None and g.fabric.state == FabricState.COMPLETED and g.fabric.status == NVML_SUCCESS
           and g.fabric.cluster_uuid == ZERO_UUID for g in fabric_gpus):
        return CliqueDecision(False, None, None, "the NVLink fabric has no cluster (a single NVSwitch system)")
    degraded = tuple(f"GPU {g.index}: {p}" for g in fabric_gpus if g.fabric is not None
                     for p in health_problems(g.fabric))
    lost = [g for g in inv.gpus if g.lost]
    if lost:
        return CliqueDecision(True, None, CliqueReason.GPU_LOST,
                              "GPU " + ", ".join(str(g.index) for g in lost) + " is lost; its clique is unknown",
                              degraded)
    for g in fabric_gpus:
        f = g.fabric
        assert f is not None
        if f.state == FabricState.NOT_STARTED:
            return CliqueDecision(True, None, CliqueReason.NOT_STARTED,
                                  f"GPU {g.index}: the fabric manager has not started registering it "
                                  "(fabric state NOT_STARTED)", degraded)
        if f.state == FabricState.IN_PROGRESS:
            return CliqueDecision(True, None, CliqueReason.IN_PROGRESS,
                                  f"GPU {g.index}: fabric registration in progress (fabric state IN_PROGRESS)",
                                  degraded)
        if f.state != FabricState.COMPLETED or f.status != NVML_SUCCESS:
            return CliqueDecision(True, None, CliqueReason.FABRIC_ERROR,
                                  f"GPU {g.index}: fabric state {state_name(f.state)} with status "
                                  f"{f.status} (NVML return code), not SUCCESS", degraded)
        if f.cluster_uuid == ZERO_UUID:
            return CliqueDecision(True, None, CliqueReason.NO_CLUSTER,
                                  f"GPU {g.index}: fabric registration completed without a cluster UUID", degraded)
    cliques = {clique_id(g.fabric) for g in fabric_gpus if g.fabric is not None}
    if len(cliques) > 1 or len(fabric_gpus) != len(inv.gpus):
        parts = [f"GPU {g.index}: {clique_id(g.fabric) if g.fabric else 'none'}" for g in inv.gpus]
        return CliqueDecision(True, None, CliqueReason.DISAGREE,
                              "the GPUs name different NVLink cliques (" + "; ".join(parts) + ")", degraded)
    value = cliques.pop()
    message = f"every GPU is in NVLink clique {value}"
    if degraded:
        message += "; fabric health: " + "; ".join(degraded)
    return CliqueDecision(True, value, CliqueReason.JOINED, message, degraded)
