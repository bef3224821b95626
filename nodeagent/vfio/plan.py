"""The workload config of a node and the sysfs writes that move its GPUs between drivers (pure).

``nvidia.com/gpu.workload.config`` is ``container`` (the GPUs on the nvidia driver, for containers) or
``vm-passthrough`` (every NVIDIA GPU and its auxiliary functions — the HD-audio function beside it — on a
VFIO driver, for virtual machines); ``vm-vgpu`` is the GPU Operator's third value, which nodeagent does
not serve. The binding follows NVIDIA's vfio-manager, one function at a time:

    <dev>/driver_override ← "\\n"          (clear any earlier override)
    drivers/<current>/unbind ← <bdf>       (when bound)
    <dev>/driver_override ← <vfio driver>
    drivers/<vfio driver>/bind ← <bdf>

and back: the override cleared, unbound from the VFIO driver, then ``drivers_probe`` ← <bdf> so the
kernel gives the function its own driver again (nvidia for the GPU, snd_hda_intel for the audio).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nodeagent.errors import ConfigError
from nodeagent.vfio.names import NVIDIA_VENDOR

WORKLOAD_LABEL = "nvidia.com/gpu.workload.config"
WORKLOAD_STATE_LABEL = "nvidia.com/gpu.workload.config.state"
CONTAINER = "container"
VM_PASSTHROUGH = "vm-passthrough"
VM_VGPU = "vm-vgpu"
WORKLOADS = (CONTAINER, VM_PASSTHROUGH)

NVIDIA_DRIVER = "nvidia"
VFIO_PCI = "vfio-pci"
GRACE_VFIO = "nvgrace_gpu_vfio_pci"  # NVIDIA's variant for Grace Hopper/Blackwell superchips
VFIO_DRIVERS = (VFIO_PCI, GRACE_VFIO)

SYS_DEVICES = "/sys/bus/pci/devices"
SYS_DRIVERS = "/sys/bus/pci/drivers"
DRIVERS_PROBE = "/sys/bus/pci/drivers_probe"


@dataclass(frozen=True)
class PciFunction:
    """One PCI function as sysfs shows it."""

    bdf: str  # "0000:18:00.0", lower case
    vendor: str  # "10de"
    device: str  # "2330"
    pci_class: str  # "030200"
    driver: str | None  # the ``driver`` link's name; None when unbound
    iommu_group: str | None = None  # the ``iommu_group`` link's name

    @property
    def slot(self) -> str:
        return self.bdf.rsplit(".", 1)[0]

    @property
    def is_gpu(self) -> bool:
        """A display controller of NVIDIA's: VGA (0300) or 3D (0302)."""
        return self.vendor == NVIDIA_VENDOR and self.pci_class[:4] in ("0300", "0302")


@dataclass(frozen=True)
class SysfsWrite:
    path: str  # host path
    value: str

    def __str__(self) -> str:
        return f"{self.value.strip() or '(empty line)'} > {self.path}"


def parse_workload(value: str) -> str:
    """The workload config a label value asks for; ``ConfigError`` naming the label otherwise."""
    if value in WORKLOADS:
        return value
    if value == VM_VGPU:
        raise ConfigError(f"label {WORKLOAD_LABEL}={VM_VGPU}: vGPU is not served by nodeagent "
                          f"(use {CONTAINER} or {VM_PASSTHROUGH})", subject=WORKLOAD_LABEL)
    raise ConfigError(f"label {WORKLOAD_LABEL} has the value {value!r}: use {CONTAINER} or {VM_PASSTHROUGH}",
                      subject=WORKLOAD_LABEL)


def passthrough_set(functions: Iterable[PciFunction]) -> list[PciFunction]:
    """The NVIDIA GPUs and the other NVIDIA functions in their slots (audio, auxiliary), by bus id."""
    funcs = list(functions)
    slots = {f.slot for f in funcs if f.is_gpu}
    return sorted((f for f in funcs if f.vendor == NVIDIA_VENDOR and f.slot in slots), key=lambda f: f.bdf)


def workload_of(functions: Sequence[PciFunction]) -> str | None:
    """``vm-passthrough`` when every function of ``passthrough_set`` is on a VFIO driver, ``container``
    when no GPU is, None when mixed (or no GPU at all)."""
    funcs = passthrough_set(functions)
    gpus = [f for f in funcs if f.is_gpu]
    if not gpus:
        return None
    if all(f.driver in VFIO_DRIVERS for f in funcs):
        return VM_PASSTHROUGH
    if not any(f.driver in VFIO_DRIVERS for f in funcs):
        return CONTAINER
    return None


def bind_writes(function: PciFunction, driver: str) -> list[SysfsWrite]:
    """Move one function to ``driver`` (nothing when it is there already)."""
    if function.driver == driver:
        return []
    dev = f"{SYS_DEVICES}/{function.bdf}"
    out = [SysfsWrite(f"{dev}/driver_override", "\n")]
    if function.driver:
        out.append(SysfsWrite(f"{SYS_DRIVERS}/{function.driver}/unbind", function.bdf))
    out += [SysfsWrite(f"{dev}/driver_override", driver),
            SysfsWrite(f"{SYS_DRIVERS}/{driver}/bind", function.bdf)]
    return out


def release_writes(function: PciFunction) -> list[SysfsWrite]:
    """Give one function on a VFIO driver back to the kernel's choice (nothing when it is not on one)."""
    if function.driver not in VFIO_DRIVERS:
        return []
    return [SysfsWrite(f"{SYS_DEVICES}/{function.bdf}/driver_override", "\n"),
            SysfsWrite(f"{SYS_DRIVERS}/{function.driver}/unbind", function.bdf),
            SysfsWrite(DRIVERS_PROBE, function.bdf)]


def restore_writes(function: PciFunction, now: str | None) -> list[SysfsWrite]:
    """Put one function back on the driver ``function`` records, from driver ``now`` (a failed switch's
    undo)."""
    if now == function.driver:
        return []
    current = PciFunction(function.bdf, function.vendor, function.device, function.pci_class, now)
    if function.driver is None:
        return [SysfsWrite(f"{SYS_DEVICES}/{function.bdf}/driver_override", "\n")] + (
            [SysfsWrite(f"{SYS_DRIVERS}/{now}/unbind", function.bdf)] if now else [])
    if function.driver in VFIO_DRIVERS:
        return bind_writes(current, function.driver)
    if now in VFIO_DRIVERS:
        return release_writes(current)
    # bound to its own driver by name; the override that took it there is cleared again
    return [*bind_writes(current, function.driver), SysfsWrite(f"{SYS_DEVICES}/{function.bdf}/driver_override", "\n")]


def vfio_driver(available: Iterable[str], grace: bool) -> str:
    """The VFIO driver to bind to: NVIDIA's Grace variant on a Grace superchip when it is there, else
    vfio-pci."""
    return GRACE_VFIO if grace and GRACE_VFIO in set(available) else VFIO_PCI


def switch_writes(functions: Sequence[PciFunction], workload: str, driver: str = VFIO_PCI) -> list[SysfsWrite]:
    """Every write that brings the node's GPUs (and their slot's functions) to ``workload``."""
    out: list[SysfsWrite] = []
    for f in passthrough_set(functions):
        out += bind_writes(f, driver) if workload == VM_PASSTHROUGH else release_writes(f)
    return out
