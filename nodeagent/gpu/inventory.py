"""Pure data describing a node's GPUs at one moment: the single source of truth in the process.

No I/O here. The NVML adapter builds an ``Inventory``; planners and publishers read it.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class LinkKind(enum.Enum):
    """How two GPUs reach each other, best last (scores as NVIDIA's device plugin gives them)."""

    CROSS_CPU = "cross-cpu"  # NVML_TOPOLOGY_SYSTEM: across the inter-socket link
    SAME_CPU = "same-cpu"  # NVML_TOPOLOGY_NODE: same NUMA node, different host bridges
    HOST_BRIDGE = "host-bridge"  # NVML_TOPOLOGY_HOSTBRIDGE
    MULTI_SWITCH = "multi-switch"  # NVML_TOPOLOGY_MULTIPLE
    SINGLE_SWITCH = "single-switch"  # NVML_TOPOLOGY_SINGLE
    SAME_BOARD = "same-board"  # NVML_TOPOLOGY_INTERNAL
    NVLINK = "nvlink"


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile a MIG-capable GPU offers (from NVML profile info + placements)."""

    name: str  # e.g. "1g.10gb", "1g.10gb+me"
    gi_profile_id: int  # NVML_GPU_INSTANCE_PROFILE_* index passed to GetGpuInstanceProfileInfo
    id: int  # the profile "id" field nvidia-smi shows (19, 15, 14, ...)
    slice_count: int  # compute slices ("1g" → 1)
    memory_mib: int
    instance_count: int  # how many fit on an empty GPU
    placement_starts: tuple[int, ...]  # possible placement starts, in memory slices
    placement_size: int  # memory slices one instance occupies


@dataclass(frozen=True)
class MigDevice:
    """A MIG device = one GPU instance with one compute instance covering it."""

    gpu_index: int
    gi_id: int
    ci_id: int
    profile: str  # GI profile name, e.g. "3g.40gb"
    placement_start: int
    placement_size: int
    memory_mib: int
    uuid: str  # "MIG-…"


@dataclass(frozen=True)
class GpuProcess:
    """A process holding a GPU context."""

    pid: int
    name: str
    used_memory_mib: int = 0


class FabricState(enum.IntEnum):
    """nvmlGpuFabricState_t: how far the fabric manager got registering the GPU with the NVLink fabric."""

    NOT_SUPPORTED = 0
    NOT_STARTED = 1
    IN_PROGRESS = 2
    COMPLETED = 3


class FabricHealthSummary(enum.IntEnum):
    """NVML_GPU_FABRIC_HEALTH_SUMMARY_* (fabric info v3)."""

    NOT_SUPPORTED = 0
    HEALTHY = 1
    UNHEALTHY = 2
    LIMITED_CAPACITY = 3


@dataclass(frozen=True)
class Fabric:
    """A GPU's NVLink fabric info (nvmlGpuFabricInfo v1..v3) as NVML reported it.

    ``status`` is an nvmlReturn_t, meaningful only once ``state`` is COMPLETED; ``health_mask`` exists from
    v2 on and ``health_summary`` from v3 on (``None`` when the driver answered an older version).
    """

    state: int
    status: int
    cluster_uuid: str  # canonical lower-case UUID text; all zeros while the GPU has no cluster
    clique_id: int
    health_mask: int | None = None
    health_summary: int | None = None


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str  # NVML product name, e.g. "NVIDIA H100 80GB HBM3"
    pci_bus_id: str  # "00000000:07:00.0"
    pci_device_id: int  # combined device/vendor id, e.g. 0x233010DE
    memory_mib: int
    numa_node: int | None
    compute_major: int
    compute_minor: int
    minor_number: int  # N in /dev/nvidiaN
    architecture: str  # "ampere", "hopper", "ada", "turing", ...
    mig_capable: bool = False
    mig_current: bool = False
    mig_pending: bool = False
    mig_profiles: tuple[MigProfile, ...] = ()
    mig_devices: tuple[MigDevice, ...] = ()
    processes: tuple[GpuProcess, ...] = ()
    lost: bool = False  # fell off the bus (NVML_ERROR_GPU_IS_LOST); other fields may be stale
    bare_gpu_instances: tuple[MigDevice, ...] = ()  # GPU instances without a compute instance (ci_id -1)
    # the driver's persistence mode (nvmlDeviceGetPersistenceMode); None where NVML does not report it
    persistence_mode: bool | None = None
    # NVLink fabric info; None where NVML answers NOT_SUPPORTED (every GPU before Hopper, PCIe-only boards)
    fabric: Fabric | None = None

    @property
    def pci_device_id_str(self) -> str:
        """The form mig-parted's device-filter uses: ``0x233010DE``."""
        return f"0x{self.pci_device_id:08X}"

    def profile(self, name: str) -> MigProfile | None:
        for p in self.mig_profiles:
            if p.name == name:
                return p
        return None


@dataclass(frozen=True)
class Link:
    """Connection between two GPUs (``a < b``)."""

    a: int
    b: int
    kind: LinkKind
    nvlinks: int = 0  # number of NVLink links when kind is NVLINK


@dataclass(frozen=True)
class Inventory:
    driver_version: str  # "550.54.15"
    cuda_driver_version: int  # NVML form: 12040 for 12.4
    gpus: tuple[Gpu, ...] = ()
    links: tuple[Link, ...] = field(default=())

    @property
    def cuda_version(self) -> tuple[int, int]:
        return self.cuda_driver_version // 1000, (self.cuda_driver_version % 1000) // 10

    def gpu(self, index: int) -> Gpu:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(index)

    def link(self, a: int, b: int) -> Link | None:
        lo, hi = min(a, b), max(a, b)
        for link in self.links:
            if link.a == lo and link.b == hi:
                return link
        return None

    def to_dict(self) -> dict[str, Any]:
        """Stable JSON-ready form (enums as their values)."""

        def conv(v: Any) -> Any:
            if isinstance(v, enum.Enum):
                return v.value
            if isinstance(v, dict):
                return {k: conv(x) for k, x in v.items()}
            if isinstance(v, list | tuple):
                return [conv(x) for x in v]
            return v

        d: dict[str, Any] = conv(asdict(self))
        d["cuda_version"] = "{}.{}".format(*self.cuda_version)
        for g, gd in zip(self.gpus, d["gpus"], strict=True):
            gd["pci_device_id"] = g.pci_device_id_str
        return d
