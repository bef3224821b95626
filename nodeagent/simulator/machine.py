"""Simulated machines: the YAML files in ``machines/`` turned into frozen dataclasses."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from nodeagent.boundedyaml import shown
from nodeagent.errors import InputError
from nodeagent.gpu.profiles import PRODUCTS, MigProduct

_UUID_NAMESPACE = uuid.UUID("6f1d3a52-8c1e-4c55-9d0b-6a0c1f1e2b7d")

ARCH_NVML = {"turing": 6, "ampere": 7, "ada": 8, "hopper": 9, "blackwell": 10}
FABRICS = ("nvswitch", "bridges", "none")
VIRTUALIZATION = ("baremetal", "passthrough")
CPU_TEES = ("none", "tdx", "sev-snp")  # the CPU's trusted execution environment, as KVM has it enabled
SWITCH_LEVELS = {"single": 10, "multiple": 20, "hostbridge": 30}


@dataclass(frozen=True)
class SimGpuSpec:
    index: int
    uuid: str
    name: str
    pci_device_id: int
    pci_subsystem_id: int
    bus_id: str  # "00000000:18:00.0"
    numa: int | None
    switch: int
    memory_mib: int
    architecture: str
    compute_capability: tuple[int, int]
    mig_product: MigProduct | None
    nvlinks: int
    power_idle_w: int
    power_max_w: int
    audio_device_id: int = 0  # the PCI device ID of the HD-audio function beside the GPU (0: none)

    @property
    def arch_nvml(self) -> int:
        return ARCH_NVML[self.architecture]

    @property
    def mig_needs_reset(self) -> bool:
        """Ampere keeps a MIG mode change pending until a GPU reset; Hopper and later apply it at once."""
        return self.architecture == "ampere"

    @property
    def cc_capable(self) -> bool:
        """Confidential computing: Hopper and later."""
        return self.architecture in ("hopper", "blackwell")

    @property
    def bus_tuple(self) -> tuple[int, int, int]:
        domain, bus, rest = self.bus_id.split(":")
        return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)


@dataclass(frozen=True)
class SimMachine:
    name: str
    description: str
    driver_version: str
    cuda_driver_version: int
    nvlink_fabric: str  # nvswitch | bridges | none
    nvlink_bridges: tuple[tuple[int, int], ...]
    pcie_switch_level: int  # NVML topology level between GPUs behind the same PCIe switch
    gpus: tuple[SimGpuSpec, ...]
    virtualization: str = "baremetal"  # "passthrough": a VM guest, no GPU reset; MIG mode needs a reboot
    # NVML functions this driver lacks in their versioned form (pynvml raises NVMLLibraryMismatchError)
    missing_functions: frozenset[str] = frozenset()
    # the host starts nvidia-persistenced at boot (its default --persistence-mode enables persistence mode on
    # every GPU); without it the driver's own default holds after each boot: persistence mode disabled
    persistenced: bool = True
    cpu_tee: str = "none"  # tdx | sev-snp | none: what the simulated host's KVM has enabled
    # nodes of the NVLink rack this machine is one compute tray of (18 for GB200/GB300 NVL72); 0: no rack
    rack_nodes: int = 0

    @property
    def passthrough(self) -> bool:
        return self.virtualization == "passthrough"

    def nvlink_peers(self, index: int) -> tuple[int, ...]:
        """GPUs this GPU reaches over NVLink."""
        if self.nvlink_fabric == "nvswitch":
            return tuple(g.index for g in self.gpus if g.index != index and g.nvlinks)
        out: list[int] = []
        for a, b in self.nvlink_bridges:
            if index == a:
                out.append(b)
            elif index == b:
                out.append(a)
        return tuple(out)


def machine_names() -> list[str]:
    """Names of the bundled machines."""
    root = resources.files("nodeagent.simulator") / "machines"
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_machine(name: str) -> SimMachine:
    """Load a bundled machine by name; unknown names are an InputError listing the known ones."""
    if name not in machine_names():
        raise InputError(
            f"unknown simulated machine {shown(name)}; known: {', '.join(machine_names())}", subject=name
        )
    text = (resources.files("nodeagent.simulator") / "machines" / f"{name}.yaml").read_text()
    return parse_machine(name, yaml.safe_load(text))


def parse_machine(name: str, doc: Any) -> SimMachine:
    """Build a machine from its YAML document (pure)."""
    try:
        models: dict[str, Any] = doc["models"]
        gpus: list[SimGpuSpec] = []
        for index, entry in enumerate(doc["gpus"]):
            m = models[entry["model"]]
            product = m.get("mig_product")
            if product is not None and product not in PRODUCTS:
                raise ValueError(f"unknown mig_product {product!r}")
            if product is not None and max(p.memory_mib for p in PRODUCTS[product].profiles) > int(m["memory_mib"]):
                raise ValueError(f"model {entry['model']!r}: a {product} MIG profile is larger than its memory_mib")
            if m["architecture"] not in ARCH_NVML:
                raise ValueError(f"unknown architecture {m['architecture']!r}")
            gpus.append(
                SimGpuSpec(
                    index=index,
                    uuid="GPU-" + str(uuid.uuid5(_UUID_NAMESPACE, f"{name}/{index}")),
                    name=str(m["name"]),
                    pci_device_id=int(m["pci_device_id"]),
                    pci_subsystem_id=int(m.get("pci_subsystem_id", 0)),
                    bus_id=str(entry["bus_id"]).upper(),
                    numa=None if entry.get("numa") is None else int(entry["numa"]),
                    switch=int(entry.get("switch", index)),
                    memory_mib=int(m["memory_mib"]),
                    architecture=str(m["architecture"]),
                    compute_capability=(int(m["compute_capability"][0]), int(m["compute_capability"][1])),
                    mig_product=PRODUCTS[product] if product else None,
                    nvlinks=int(m.get("nvlinks", 0)),
                    power_idle_w=int(m.get("power_idle_w", 30)),
                    power_max_w=int(m.get("power_max_w", 300)),
                    audio_device_id=int(m.get("audio_device_id", 0)),
                )
            )
        fabric = str(doc.get("nvlink_fabric", "none"))
        if fabric not in FABRICS:
            raise ValueError(f"nvlink_fabric must be one of {FABRICS}")
        bridges = tuple((int(a), int(b)) for a, b in doc.get("nvlink_bridges", []))
        persistenced = doc.get("persistenced", True)
        if not isinstance(persistenced, bool):
            raise ValueError(f"persistenced must be true or false, not {shown(persistenced)}")
        virtualization = str(doc.get("virtualization", "baremetal"))
        if virtualization not in VIRTUALIZATION:
            raise ValueError(f"virtualization must be one of {VIRTUALIZATION}")
        cpu_tee = str(doc.get("cpu_tee", "none"))
        if cpu_tee not in CPU_TEES:
            raise ValueError(f"cpu_tee must be one of {CPU_TEES}")
        rack_nodes = doc.get("rack_nodes", 0)
        if isinstance(rack_nodes, bool) or not isinstance(rack_nodes, int) or not 0 <= rack_nodes <= 576:
            raise ValueError(f"rack_nodes must be an integer 0..576, not {shown(rack_nodes)}")
        return SimMachine(
            name=name,
            description=str(doc.get("description", name)),
            driver_version=str(doc["driver_version"]),
            cuda_driver_version=int(doc["cuda_driver_version"]),
            nvlink_fabric=fabric,
            nvlink_bridges=bridges,
            pcie_switch_level=SWITCH_LEVELS[str(doc.get("pcie_switch_level", "single"))],
            gpus=tuple(gpus),
            virtualization=virtualization,
            missing_functions=frozenset(str(f) for f in doc.get("missing_functions", ())),
            persistenced=persistenced,
            cpu_tee=cpu_tee,
            rack_nodes=rack_nodes,
        )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise InputError(f"simulated machine {name!r} is malformed: {e}", subject=name) from e
