"""The node's DRA devices, derived from the ``Inventory`` (pure apart from the optional sysfs lookup).

A GPU in MIG mode is published through its existing MIG devices only (the whole GPU cannot be handed out
then); any other GPU is published whole. Lost GPUs are left out. Device names are DNS labels:
``gpu-<index>`` and ``gpu-<index>-mig-<gi>-<ci>``.

Dynamic MIG (partitionable devices, KEP-4815): a GPU in MIG mode that the caller selects with
``dynamic_mig`` publishes one device per possible placement of each GPU-instance profile NVML offers
(``gpu-<index>-mig-<profile>-at-<start>``) instead of its existing instances, and one counter set
``gpu-<index>-counters`` the placements consume from:

- ``memory-slice-<i>`` (1 each): a placement consumes every memory slice it covers, so two overlapping
  placements can never be allocated together;
- ``compute-slices`` (the GPU's compute slices): a placement consumes its profile's slice count;
- ``<profile>-instances`` for a profile of which fewer instances fit than it has placements (the
  ``+me`` variants: one per GPU): each placement of that profile consumes 1.

These are the rules NVML applies when a GPU instance is created, so an allocation the scheduler makes
from the counters can always be created on the GPU.

Shared GPUs (consumable capacity, KEP-5075): a whole GPU or a static MIG device of a GPU the caller
selects with ``shareable`` allows multiple allocations; its ``memory`` capacity and a ``computeShare``
capacity (percent of the GPU's compute, 100 in all) are consumed per allocation under a request policy
(``shared_capacity``): memory in steps of ``MEMORY_STEP_MIB`` (a claim that names no amount takes all of it,
so it holds the device alone), compute in steps of 1 percent (none reserved unless asked for: the
allocations then share the compute as time-slicing does). Dynamic MIG placements are never shared.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice, MigProfile
from nodeagent.vfio.allocate import VfioDevice

# Standard attribute names (resource.kubernetes.io): PCI address and PCIe root complex.
PCI_BUS_ID_ATTR = "resource.kubernetes.io/pciBusID"
PCIE_ROOT_ATTR = "resource.kubernetes.io/pcieRoot"
# The standard NUMA node attribute (KEP-6072, stable in 1.37), published beside the driver's own numaNode so
# a claim can match GPUs and other drivers' devices (NICs) on one NUMA node with matchAttribute.
NUMA_NODE_ATTR = "resource.kubernetes.io/numaNode"

# Consumable capacity of a shared device.
MEMORY_CAPACITY = "memory"
COMPUTE_SHARE_CAPACITY = "computeShare"
COMPUTE_SHARE_TOTAL = 100  # percent
MEMORY_STEP_MIB = 256

_PCIE_ROOT_RE = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")


@dataclass(frozen=True)
class Placement:
    """Where a dynamic MIG device's GPU instance goes: profile and start (in memory slices) on a GPU."""

    gpu_index: int
    gpu_uuid: str
    profile: str
    start: int
    size: int


@dataclass(frozen=True)
class CounterSet:
    """One GPU's shared counters (API form of the values is built by ``nodeagent.dra.slices``)."""

    name: str
    gpu_index: int
    counters: Mapping[str, int]


@dataclass(frozen=True)
class DraDevice:
    """One device of the node's pool, with what a container needs to use it."""

    name: str
    kind: str  # "gpu" | "mig" | "channel" (IMEX, nodeagent.dra.channels; gpu_index and minor -1)
    gpu_index: int
    minor: int  # N of /dev/nvidiaN (the parent GPU for a MIG device)
    uuid: str
    gi_id: int | None = None
    ci_id: int | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict)  # API form: {"uuid": {"string": ...}}
    capacity: Mapping[str, Any] = field(default_factory=dict)  # API form: {"memory": {"value": "80Gi"}}
    placement: Placement | None = None  # dynamic MIG: the GPU instance prepare creates
    consumes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # counter set → counter → amount
    shared: bool = False  # allows multiple allocations, each consuming part of its capacity
    share: Share | None = None  # a prepared allocation of a shared device: what this one consumed
    vfio: VfioDevice | None = None  # kind "vfio": the GPU on a VFIO driver (bus id, IOMMU group)
    vfio_resource: str = ""  # kind "vfio": the sandbox plugin's resource name (names PCI_RESOURCE_…)
    channels: int = 0  # kind "channel" (an IMEX channel device) prepared: channels 0..channels-1 go in

    @property
    def dynamic(self) -> bool:
        return self.placement is not None


@dataclass(frozen=True)
class Share:
    """One allocation of a shared device: its share ID and the capacity it consumed (bytes, percent)."""

    share_id: str
    memory_bytes: int
    compute_percent: int


def shared_capacity(memory_mib: int) -> dict[str, Any]:
    """The capacity of a shared device with ``memory_mib`` of memory, in API form with request policies."""
    step = min(MEMORY_STEP_MIB, memory_mib)
    usable = memory_mib - memory_mib % step if step else 0
    return {
        MEMORY_CAPACITY: {
            "value": f"{memory_mib}Mi",
            "requestPolicy": {"default": f"{usable}Mi",
                              "validRange": {"min": f"{step}Mi", "max": f"{usable}Mi", "step": f"{step}Mi"}},
        },
        COMPUTE_SHARE_CAPACITY: {
            "value": str(COMPUTE_SHARE_TOTAL),
            "requestPolicy": {"default": "0",
                              "validRange": {"min": "0", "max": str(COMPUTE_SHARE_TOTAL), "step": "1"}},
        },
    }


def as_shared(dev: DraDevice, memory_mib: int) -> DraDevice:
    return dataclasses.replace(dev, shared=True, capacity=shared_capacity(memory_mib))



def gpu_device_name(index: int) -> str:
    return f"gpu-{index}"


def mig_device_name(index: int, gi_id: int, ci_id: int) -> str:
    return f"gpu-{index}-mig-{gi_id}-{ci_id}"


def vfio_device_name(slot: int) -> str:
    return f"gpu-{slot}-vfio"


_DEVICE_GPU_RE = re.compile(r"^gpu-(\d+)(?:-mig-[a-z0-9-]+|-vfio)?$")


def device_gpu_index(name: str) -> int | None:
    """The GPU index a device name of this pool carries (``gpu-3``, ``gpu-3-mig-…``, ``gpu-3-vfio`` → 3);
    None for any other name."""
    m = _DEVICE_GPU_RE.match(name)
    return int(m.group(1)) if m else None


def semver(version: str) -> str | None:
    """``550.54.15`` → ``550.54.15``; ``535.104.05`` → ``535.104.5``; ``12.4`` → ``12.4.0``; else None."""
    parts = version.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    nums = [int(p) for p in parts] + [0] * (3 - len(parts))
    return "{}.{}.{}".format(*nums)


def pci_bus_id(nvml_bus_id: str) -> str:
    """NVML's ``00000000:07:00.0`` → the standard ``0000:07:00.0`` (lower case, 4-digit domain)."""
    s = nvml_bus_id.strip().lower()
    domain, sep, rest = s.partition(":")
    if not sep:
        return s
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return s


def pcie_root(sys_pci_devices: Path, nvml_bus_id: str) -> str | None:
    """The PCIe root complex (``pci0000:00``) the device hangs off, read from sysfs; None if unknown."""
    try:
        real = (sys_pci_devices / pci_bus_id(nvml_bus_id)).resolve(strict=True)
    except OSError:
        return None
    for part in real.parts:
        if _PCIE_ROOT_RE.match(part):
            return part
    return None


def _str(v: str) -> dict[str, Any]:
    return {"string": v}


def _common(inv: Inventory, gpu: Gpu, roots: Mapping[str, str]) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "productName": _str(gpu.name),
        "architecture": _str(gpu.architecture),
        "cudaComputeCapability": {"version": f"{gpu.compute_major}.{gpu.compute_minor}.0"},
        "cudaDriverVersion": {"version": "{}.{}.0".format(*inv.cuda_version)},
    }
    drv = semver(inv.driver_version)
    if drv is not None:
        attrs["driverVersion"] = {"version": drv}
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        attrs["numaNode"] = {"int": gpu.numa_node}
        attrs[NUMA_NODE_ATTR] = {"int": gpu.numa_node}
    root = roots.get(gpu.pci_bus_id)
    if root:
        attrs[PCIE_ROOT_ATTR] = _str(root)
    return attrs


def _gpu_device(inv: Inventory, gpu: Gpu, roots: Mapping[str, str]) -> DraDevice:
    attrs = {
        "type": _str("gpu"),
        "uuid": _str(gpu.uuid),
        "index": {"int": gpu.index},
        **_common(inv, gpu, roots),
        PCI_BUS_ID_ATTR: _str(pci_bus_id(gpu.pci_bus_id)),
    }
    return DraDevice(
        name=gpu_device_name(gpu.index), kind="gpu", gpu_index=gpu.index, minor=gpu.minor_number,
        uuid=gpu.uuid, attributes=attrs, capacity={"memory": {"value": f"{gpu.memory_mib}Mi"}},
    )


def _mig_device(inv: Inventory, gpu: Gpu, mig: MigDevice, roots: Mapping[str, str]) -> DraDevice:
    attrs = {
        "type": _str("mig"),
        "uuid": _str(mig.uuid),
        "parentUUID": _str(gpu.uuid),
        "parentIndex": {"int": gpu.index},
        "profile": _str(mig.profile),
        "placementStart": {"int": mig.placement_start},
        "placementSize": {"int": mig.placement_size},
        **_common(inv, gpu, roots),
    }
    return DraDevice(
        name=mig_device_name(gpu.index, mig.gi_id, mig.ci_id), kind="mig", gpu_index=gpu.index,
        minor=gpu.minor_number, uuid=mig.uuid, gi_id=mig.gi_id, ci_id=mig.ci_id, attributes=attrs,
        capacity={"memory": {"value": f"{mig.memory_mib}Mi"}},
    )


_PROFILE_BAD = re.compile(r"[^a-z0-9-]+")


def profile_label(profile: str) -> str:
    """A GPU-instance profile name as part of a DNS label: ``1g.10gb+me`` → ``1g-10gb-plus-me``,
    ``1g.24gb-me`` → ``1g-24gb-me`` (``+`` and ``-`` variants stay apart)."""
    s = profile.lower().replace("+", "-plus-").replace(".", "-")
    return _PROFILE_BAD.sub("-", s).strip("-")


def placement_device_name(index: int, profile: str, start: int) -> str:
    return f"gpu-{index}-mig-{profile_label(profile)}-at-{start}"


def counter_set_name(index: int) -> str:
    return f"gpu-{index}-counters"


def memory_slice_counter(i: int) -> str:
    return f"memory-slice-{i}"


COMPUTE_SLICES_COUNTER = "compute-slices"


def instances_counter(profile: str) -> str:
    return f"{profile_label(profile)}-instances"


def _limited(p: MigProfile) -> bool:
    return 0 < p.instance_count < len(p.placement_starts)


def mig_counters(gpu: Gpu) -> dict[str, int]:
    """The GPU's shared counters (see the module text), from the profiles NVML reports."""
    profiles = [p for p in gpu.mig_profiles if p.placement_starts]
    memory_slices = max((s + p.placement_size for p in profiles for s in p.placement_starts), default=0)
    counters = {memory_slice_counter(i): 1 for i in range(memory_slices)}
    counters[COMPUTE_SLICES_COUNTER] = max((p.slice_count for p in profiles), default=0)
    for p in profiles:
        if _limited(p):
            counters[instances_counter(p.name)] = p.instance_count
    return counters


def placement_consumes(gpu: Gpu, prof: MigProfile, start: int) -> dict[str, int]:
    used = {memory_slice_counter(i): 1 for i in range(start, start + prof.placement_size)}
    used[COMPUTE_SLICES_COUNTER] = prof.slice_count
    if _limited(prof):
        used[instances_counter(prof.name)] = 1
    return used


def _placement_devices(inv: Inventory, gpu: Gpu, roots: Mapping[str, str]) -> list[DraDevice]:
    out: list[DraDevice] = []
    cset = counter_set_name(gpu.index)
    common = _common(inv, gpu, roots)
    for prof in sorted(gpu.mig_profiles, key=lambda p: (p.placement_size, p.slice_count, p.memory_mib, p.name)):
        for start in prof.placement_starts:
            attrs = {
                "type": _str("mig"),
                "parentUUID": _str(gpu.uuid),
                "parentIndex": {"int": gpu.index},
                "profile": _str(prof.name),
                "placementStart": {"int": start},
                "placementSize": {"int": prof.placement_size},
                **common,
            }
            out.append(DraDevice(
                name=placement_device_name(gpu.index, prof.name, start), kind="mig", gpu_index=gpu.index,
                minor=gpu.minor_number, uuid="", attributes=attrs,
                capacity={"memory": {"value": f"{prof.memory_mib}Mi"}},
                placement=Placement(gpu.index, gpu.uuid, prof.name, start, prof.placement_size),
                consumes={cset: placement_consumes(gpu, prof, start)},
            ))
    return out


def dynamic_mig_gpu(gpu: Gpu, owned: set[tuple[str, int]]) -> bool:
    """Whether a GPU in MIG mode may serve dynamic MIG: every GPU instance on it is one of ``owned``
    ((profile, placement start) of the instances claim records name); any other instance is a static
    layout, which is published as it is and never changed."""
    return all((m.profile, m.placement_start) in owned for m in (*gpu.mig_devices, *gpu.bare_gpu_instances))


def build_counter_sets(devices: Sequence[DraDevice], inv: Inventory) -> list[CounterSet]:
    """The counter sets the dynamic devices among ``devices`` consume (one per GPU, in GPU order)."""
    indices = sorted({d.gpu_index for d in devices if d.dynamic})
    return [CounterSet(counter_set_name(i), i, mig_counters(inv.gpu(i))) for i in indices]


def build_devices(
    inv: Inventory,
    pcie_roots: Mapping[str, str] | None = None,
    gpu_filter: Callable[[Gpu], bool] | None = None,
    dynamic_mig: Callable[[Gpu], bool] | None = None,
    shareable: Callable[[Gpu], bool] | None = None,
) -> list[DraDevice]:
    """Every device of the node's pool, in a stable order. ``pcie_roots``: NVML bus id → root complex;
    ``gpu_filter``: only GPUs it accepts (and their MIG devices) are published, e.g. the GPUs left to DRA
    when the device plugin serves the others on the same node; ``dynamic_mig``: the GPUs in MIG mode it
    accepts publish their placements (dynamic MIG) instead of their existing MIG devices; ``shareable``: the
    whole GPUs and static MIG devices of the GPUs it accepts allow multiple allocations (consumable
    capacity)."""
    roots = pcie_roots or {}
    out: list[DraDevice] = []
    for gpu in sorted(inv.gpus, key=lambda g: g.index):
        if gpu.lost or (gpu_filter is not None and not gpu_filter(gpu)):
            continue
        share = shareable is not None and shareable(gpu)
        if gpu.mig_current and dynamic_mig is not None and dynamic_mig(gpu):
            out.extend(_placement_devices(inv, gpu, roots))
        elif gpu.mig_current:
            for mig in sorted(gpu.mig_devices, key=lambda m: (m.gi_id, m.ci_id)):
                dev = _mig_device(inv, gpu, mig, roots)
                out.append(as_shared(dev, mig.memory_mib) if share else dev)
        else:
            dev = _gpu_device(inv, gpu, roots)
            out.append(as_shared(dev, gpu.memory_mib) if share else dev)
    return out


def read_pcie_roots(inv: Inventory, sys_pci_devices: Path) -> dict[str, str]:
    """NVML bus id → PCIe root complex for every GPU sysfs knows."""
    out: dict[str, str] = {}
    for gpu in inv.gpus:
        root = pcie_root(sys_pci_devices, gpu.pci_bus_id)
        if root is not None:
            out[gpu.pci_bus_id] = root
    return out


def with_share(dev: DraDevice, share: Share | None) -> DraDevice:
    """A shared device as one allocation holds it (what its CDI spec says: the consumed limits)."""
    return dev if share is None else dataclasses.replace(dev, share=share)


def with_instance(dev: DraDevice, mig: MigDevice) -> DraDevice:
    """A dynamic MIG device once its GPU instance exists: what its CDI spec names (uuid, instance ids)."""
    return dataclasses.replace(dev, uuid=mig.uuid, gi_id=mig.gi_id, ci_id=mig.ci_id)


def build_vfio_devices(resources: Mapping[str, Mapping[str, VfioDevice]], slots: Mapping[str, int],
                       product_names: Mapping[str, str] | None = None) -> list[DraDevice]:
    """The devices of GPUs on a VFIO driver (the workload config ``vm-passthrough``), one per GPU, in slot
    order: ``resources`` is what the sandbox device plugin would serve (resource name → bus id → device),
    ``slots`` a GPU's bus id → its index among the node's NVIDIA GPUs in bus order (the GPU index the
    device name carries: NVML, which no longer sees these GPUs, gives none), ``product_names`` the resource
    → its PCI ID database entry. Attribute ``type`` is ``vfio`` (the class ``vfio.gpu.nodeagent.io``)."""
    out: list[DraDevice] = []
    for resource, devices in sorted(resources.items()):
        for bdf, dev in sorted(devices.items()):
            slot = slots.get(bdf)
            if slot is None:
                continue
            attrs: dict[str, Any] = {
                "type": _str("vfio"),
                "index": {"int": slot},
                "resourceName": _str(resource),
                "iommuGroup": {"int": int(dev.iommu_group)} if dev.iommu_group.isdigit() else _str(dev.iommu_group),
                PCI_BUS_ID_ATTR: _str(bdf),
            }
            name = (product_names or {}).get(resource)
            if name:
                attrs["productName"] = _str(name)
            if dev.numa is not None and dev.numa >= 0:
                attrs["numaNode"] = {"int": dev.numa}
                attrs[NUMA_NODE_ATTR] = {"int": dev.numa}
            out.append(DraDevice(name=vfio_device_name(slot), kind="vfio", gpu_index=slot, minor=-1, uuid="",
                                 attributes=attrs, vfio=dev, vfio_resource=resource))
    return sorted(out, key=lambda d: d.gpu_index)
