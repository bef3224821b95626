"""Resource names for GPUs bound to vfio-pci, as NVIDIA's sandbox device plugin forms them (pure).

The plugin groups the vendor-10de devices bound to a VFIO driver by their sysfs ``device`` ID and names
each group after that ID's entry in the PCI ID database (``pci.ids``): upper-cased, ``/`` and ``.`` and
whitespace turned into ``_``, everything outside ``[A-Za-z0-9_]`` dropped, under ``nvidia.com/``:
``2330  GH100 [H100 SXM5 80GB]`` → ``nvidia.com/GH100_H100_SXM5_80GB``. An ID the database lacks (or no
database at all) is named after the ID itself, ``nvidia.com/10DE_2330`` (nodeagent's own fallback).
The container learns its devices from ``PCI_RESOURCE_NVIDIA_COM_<NAME>`` (the bus IDs, comma-separated).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

NVIDIA_VENDOR = "10de"
RESOURCE_DOMAIN = "nvidia.com"
# where distributions keep the PCI ID database (pciutils, hwdata)
PCI_IDS_PATHS = ("/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids", "/usr/share/pci.ids")
MAX_NAME = 63  # the part of an extended resource name after the domain

_SPACE = re.compile(r"\s+")
_DROP = re.compile(r"[^A-Za-z0-9_]")
_VENDOR = re.compile(r"^([0-9a-fA-F]{4})\s+(.*)$")
_DEVICE = re.compile(r"^\t([0-9a-fA-F]{4})\s+(.*)$")


def parse_pci_ids(text: str, vendor: str = NVIDIA_VENDOR) -> dict[str, str]:
    """Device ID (4 lower-case hex digits) → its name, for ``vendor``'s section of a pci.ids text. Comments,
    subsystem lines (two tabs) and the class section (``C ...``) are skipped."""
    out: dict[str, str] = {}
    inside = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("C "):
            inside = False  # the device classes follow the vendors
            continue
        m = _VENDOR.match(line)
        if m:
            inside = m.group(1).lower() == vendor
            continue
        if inside:
            d = _DEVICE.match(line)
            if d:
                out[d.group(1).lower()] = d.group(2).strip()
    return out


def name_part(pci_name: str) -> str:
    """``GH100 [H100 SXM5 80GB]`` → ``GH100_H100_SXM5_80GB``."""
    text = pci_name.upper().replace("/", "_").replace(".", "_")
    text = _SPACE.sub("_", text)
    return _DROP.sub("", text)[:MAX_NAME].strip("_") or "GPU"


def resource_name(device_id: str, names: Mapping[str, str], vendor: str = NVIDIA_VENDOR) -> str:
    """The resource for a device ID (``2330`` or ``0x2330``) given the database's ``names``."""
    did = device_id.lower().removeprefix("0x")
    known = names.get(did)
    part = name_part(known) if known else f"{vendor.upper()}_{did.upper()}"
    return f"{RESOURCE_DOMAIN}/{part}"


def env_name(resource: str) -> str:
    """``nvidia.com/GH100_H100_SXM5_80GB`` → ``PCI_RESOURCE_NVIDIA_COM_GH100_H100_SXM5_80GB``."""
    return "PCI_RESOURCE_" + re.sub(r"[^A-Z0-9_]", "_", resource.upper())


def group_by_resource(devices: Iterable[tuple[str, str]], names: Mapping[str, str]) -> dict[str, list[str]]:
    """(bus id, device id) pairs → resource name → bus ids (sorted)."""
    out: dict[str, list[str]] = {}
    for bdf, did in devices:
        out.setdefault(resource_name(did, names), []).append(bdf)
    return {k: sorted(v) for k, v in sorted(out.items())}
