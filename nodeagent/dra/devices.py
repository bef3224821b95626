"""The node's DRA devices, derived from the ``Inventory`` (pure apart from the optional sysfs lookup).

A GPU in MIG mode is published through its existing MIG devices only (the whole GPU cannot be handed out
then); any other GPU is published whole. Lost GPUs are left out. Device names are DNS labels:
``gpu-<index>`` and ``gpu-<index>-mig-<gi>-<ci>``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice

# Standard attribute names (resource.kubernetes.io): PCI address and PCIe root complex.
PCI_BUS_ID_ATTR = "resource.kubernetes.io/pciBusID"
PCIE_ROOT_ATTR = "resource.kubernetes.io/pcieRoot"

_PCIE_ROOT_RE = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")


@dataclass(frozen=True)
class DraDevice:
    """One device of the node's pool, with what a container needs to use it."""

    name: str
    kind: str  # "gpu" | "mig"
    gpu_index: int
    minor: int  # N of /dev/nvidiaN (the parent GPU for a MIG device)
    uuid: str
    gi_id: int | None = None
    ci_id: int | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict)  # API form: {"uuid": {"string": ...}}
    capacity: Mapping[str, Any] = field(default_factory=dict)  # API form: {"memory": {"value": "80Gi"}}

    @property
    def health_key(self) -> tuple[int, int | None]:
        """The key ``nodeagent.gpu.health`` uses for this device."""
        return (self.gpu_index, self.gi_id)


def gpu_device_name(index: int) -> str:
    return f"gpu-{index}"


def mig_device_name(index: int, gi_id: int, ci_id: int) -> str:
    return f"gpu-{index}-mig-{gi_id}-{ci_id}"


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


def build_devices(
    inv: Inventory,
    pcie_roots: Mapping[str, str] | None = None,
    gpu_filter: Callable[[Gpu], bool] | None = None,
) -> list[DraDevice]:
    """Every device of the node's pool, in a stable order. ``pcie_roots``: NVML bus id → root complex;
    ``gpu_filter``: only GPUs it accepts (and their MIG devices) are published, e.g. the GPUs left to DRA
    when the device plugin serves the others on the same node."""
    roots = pcie_roots or {}
    out: list[DraDevice] = []
    for gpu in sorted(inv.gpus, key=lambda g: g.index):
        if gpu.lost or (gpu_filter is not None and not gpu_filter(gpu)):
            continue
        if gpu.mig_current:
            for mig in sorted(gpu.mig_devices, key=lambda m: (m.gi_id, m.ci_id)):
                out.append(_mig_device(inv, gpu, mig, roots))
        else:
            out.append(_gpu_device(inv, gpu, roots))
    return out


def read_pcie_roots(inv: Inventory, sys_pci_devices: Path) -> dict[str, str]:
    """NVML bus id → PCIe root complex for every GPU sysfs knows."""
    out: dict[str, str] = {}
    for gpu in inv.gpus:
        root = pcie_root(sys_pci_devices, gpu.pci_bus_id)
        if root is not None:
            out[gpu.pci_bus_id] = root
    return out
