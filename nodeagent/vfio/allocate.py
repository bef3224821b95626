"""The Allocate answer for VFIO devices, as NVIDIA's sandbox device plugin gives it (pure).

A container given GPUs bound to a VFIO driver gets the VFIO container device ``/dev/vfio/vfio``, the
group device ``/dev/vfio/<group>`` of each GPU's IOMMU group (once per group), with the iommufd backend
also each GPU's ``/dev/vfio/devices/vfioN`` and ``/dev/iommu``, and one environment variable
``PCI_RESOURCE_NVIDIA_COM_<NAME>`` listing the GPUs' bus ids, comma-separated (KubeVirt reads it to find
the host devices for the VM).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nodeagent.errors import InputError
from nodeagent.vfio.names import env_name

VFIO_CONTAINER = "/dev/vfio/vfio"
IOMMU_DEVICE = "/dev/iommu"


@dataclass(frozen=True)
class VfioDevice:
    """One GPU on a VFIO driver, as the device plugin advertises it (its ID is the bus id)."""

    bdf: str
    iommu_group: str
    cdev: str | None = None  # "vfio3" when the kernel offers the iommufd character device
    numa: int | None = None


@dataclass(frozen=True)
class VfioAllocation:
    envs: dict[str, str] = field(default_factory=dict)
    devices: tuple[tuple[str, str], ...] = ()  # (container path, host path), read-write


def vfio_allocation(resource: str, devices: Mapping[str, VfioDevice], requested: Sequence[str],
                    *, iommufd: bool = False) -> VfioAllocation:
    """The answer for one container asking for ``requested`` device IDs of ``resource``; ``InputError``
    naming an ID this resource does not have."""
    unknown = [d for d in requested if d not in devices]
    if unknown:
        raise InputError(f"{resource} has no device {', '.join(unknown)} (it has {', '.join(sorted(devices))})",
                         subject=resource)
    if not requested:
        raise InputError(f"{resource}: no device requested", subject=resource)
    paths: list[str] = [VFIO_CONTAINER]
    for bdf in requested:
        group = f"/dev/vfio/{devices[bdf].iommu_group}"
        if group not in paths:
            paths.append(group)
    if iommufd:
        cdevs = [devices[b].cdev for b in requested]
        paths += [f"/dev/vfio/devices/{c}" for c in cdevs if c]
        paths.append(IOMMU_DEVICE)
    return VfioAllocation(envs={env_name(resource): ",".join(requested)},
                          devices=tuple((p, p) for p in paths))
