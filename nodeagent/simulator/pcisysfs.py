"""A simulated machine's PCI tree in sysfs, under the sandbox root, and the kernel's reaction to writes.

``SimPciTree.materialise`` lays out what the kernel shows for the machine's GPUs:

    /sys/devices/pci<domain>:00/<bdf>/{vendor,device,class,subsystem_*,numa_node,driver_override,reset}
    /sys/devices/pci<domain>:00/<bdf>/driver       → /sys/bus/pci/drivers/nvidia (relative links)
    /sys/devices/pci<domain>:00/<bdf>/iommu_group  → /sys/kernel/iommu_groups/<n>
    /sys/bus/pci/devices/<bdf>                     → the device directory
    /sys/bus/pci/drivers/{nvidia,vfio-pci,snd_hda_intel}/{bind,unbind,<bdf> links}
    /sys/bus/pci/drivers_probe
    /sys/module/kvm_intel/parameters/tdx, /sys/module/kvm_amd/parameters/sev_snp   (the CPU's TEE)
    /usr/share/misc/pci.ids                        (the entries of the machine's devices)

plus, for models with an audio function (``audio_device_id``), function ``.1`` of the GPU's slot on
snd_hda_intel in the GPU's IOMMU group. ``settle`` is the kernel: it acts on what was written into
``bind``, ``unbind``, ``drivers_probe`` and ``reset`` (then empties them), honouring ``driver_override``
as the kernel does (a device with an override binds only to that driver; vfio-pci binds nothing
without one), and keeps the stand-in ``/dev/vfio/vfio`` and ``/dev/vfio/<group>`` files for the groups
with a function on vfio-pci. Regular files stand in for the sysfs attributes. Given the simulator's
store, the kernel also records in each GPU's state which driver owns it (``driver``, absent while it is
``nvidia``): the simulated NVML, like the real one, no longer enumerates a GPU the nvidia driver lost.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from nodeagent.hostpaths import HostPaths
from nodeagent.simulator.machine import SimMachine
from nodeagent.simulator.state import SimStore

NVIDIA, VFIO, HDA, GRACE_VFIO = "nvidia", "vfio-pci", "snd_hda_intel", "nvgrace_gpu_vfio_pci"
GRACE_MARKS = ("GH200", "GB200", "GB300")  # superchips: NVIDIA's Grace variant of vfio-pci is loaded there
GPU_CLASS = {"vga": "0x030000", "3d": "0x030200"}
AUDIO_CLASS = "0x040300"
IOMMU_GROUP_BASE = 20
# pci.ids entries of the devices the bundled machines have (device ID → name under vendor 10de)
PCI_NAMES = {
    0x2330: "GH100 [H100 SXM5 80GB]",
    0x20B5: "GA100 [A100 PCIe 80GB]",
    0x20B0: "GA100 [A100 SXM4 40GB]",
    0x20B2: "GA100 [A100 SXM4 80GB]",
    0x26B9: "AD102GL [L40S]",
    0x22BA: "AD102 High Definition Audio Controller",
}
TEE_FILES = {"tdx": "/sys/module/kvm_intel/parameters/tdx", "sev-snp": "/sys/module/kvm_amd/parameters/sev_snp"}


def sysfs_bdf(bus_id: str) -> str:
    domain, _, rest = bus_id.lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}"


@dataclass(frozen=True)
class _Function:
    bdf: str
    device_id: int
    pci_class: str
    default_driver: str
    group: int
    numa: int | None
    subsystem: int
    gpu: int | None = None  # the machine's GPU index of a GPU function


def _functions(machine: SimMachine) -> list[_Function]:
    out: list[_Function] = []
    for g in machine.gpus:
        bdf = sysfs_bdf(g.bus_id)
        group = IOMMU_GROUP_BASE + g.index
        device = g.pci_device_id >> 16
        out.append(_Function(bdf, device, GPU_CLASS["vga" if g.audio_device_id else "3d"], NVIDIA, group,
                             g.numa, g.pci_subsystem_id, g.index))
        if g.audio_device_id:
            out.append(_Function(bdf[:-1] + "1", g.audio_device_id, AUDIO_CLASS, HDA, group, g.numa,
                                 g.pci_subsystem_id))
    return out


class SimPciTree:
    def __init__(self, paths: HostPaths, machine: SimMachine, store: SimStore | None = None,
                 quiet_s: float = 0.0) -> None:
        self.paths = paths
        # a kernel in another process than the writer (settling on its own clock): an emptied
        # driver_override shows as "(null)" only once it has been left alone that long, so a value the
        # writer puts there right after is never overwritten
        self.quiet_s = quiet_s
        self.machine = machine
        self.store = store
        self.functions = {f.bdf: f for f in _functions(machine)}
        grace = any(m in g.name for g in machine.gpus for m in GRACE_MARKS)
        self.drivers = (NVIDIA, VFIO, HDA) + ((GRACE_VFIO,) if grace else ())

    def _p(self, host_path: str) -> Path:
        return self.paths.within(self.paths(host_path))

    def _dev(self, bdf: str) -> Path:
        return self._p(f"/sys/devices/pci{bdf[:4]}:00/{bdf}")

    @property
    def materialised(self) -> bool:
        return self._p("/sys/bus/pci/drivers_probe").exists()

    def materialise(self) -> None:
        """Lay the tree out (again): every function on its own driver, no override."""
        for d in self.drivers:
            dd = self._p(f"/sys/bus/pci/drivers/{d}")
            dd.mkdir(parents=True, exist_ok=True)
            for name in ("bind", "unbind", "new_id"):
                (dd / name).write_text("")
        self._p("/sys/bus/pci/devices").mkdir(parents=True, exist_ok=True)
        self._p("/sys/bus/pci/drivers_probe").write_text("")
        for f in self.functions.values():
            dev = self._dev(f.bdf)
            dev.mkdir(parents=True, exist_ok=True)
            for name, value in (("vendor", "0x10de"), ("device", f"0x{f.device_id:04x}"), ("class", f.pci_class),
                                ("subsystem_vendor", f"0x{f.subsystem & 0xFFFF:04x}"),
                                ("subsystem_device", f"0x{f.subsystem >> 16:04x}"),
                                ("numa_node", str(-1 if f.numa is None else f.numa)),
                                ("driver_override", "(null)"), ("reset", "")):
                (dev / name).write_text(value + ("\n" if value else ""))
            groups = self._p(f"/sys/kernel/iommu_groups/{f.group}/devices")
            groups.mkdir(parents=True, exist_ok=True)
            self._link(groups / f.bdf, dev)
            self._link(dev / "iommu_group", groups.parent)
            self._link(self._p(f"/sys/bus/pci/devices/{f.bdf}"), dev)
            self._bind(f.bdf, f.default_driver)
        for tee, path in TEE_FILES.items():
            p = self._p(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("Y\n" if self.machine.cpu_tee == tee else "N\n")
        ids = self._p("/usr/share/misc/pci.ids")
        ids.parent.mkdir(parents=True, exist_ok=True)
        lines = ["# the simulated machine's devices", "10de  NVIDIA Corporation"]
        lines += [f"\t{d:04x}  {n}" for d, n in sorted(PCI_NAMES.items())
                  if any(f.device_id == d for f in self.functions.values())]
        ids.write_text("\n".join(lines) + "\n")
        self._vfio_nodes()
        self._sync_nvml()

    # -- links -----------------------------------------------------------------------------------
    def _link(self, at: Path, target: Path) -> None:
        if at.is_symlink() or at.exists():
            at.unlink()
        at.symlink_to(os.path.relpath(target, at.parent))

    def driver_of(self, bdf: str) -> str | None:
        link = self._dev(bdf) / "driver"
        return os.path.basename(os.readlink(link)) if link.is_symlink() else None

    def _bind(self, bdf: str, driver: str) -> None:
        dd = self._p(f"/sys/bus/pci/drivers/{driver}")
        self._link(self._dev(bdf) / "driver", dd)
        self._link(dd / bdf, self._dev(bdf))

    def _unbind(self, bdf: str) -> None:
        driver = self.driver_of(bdf)
        if driver is None:
            return
        (self._dev(bdf) / "driver").unlink()
        link = self._p(f"/sys/bus/pci/drivers/{driver}") / bdf
        if link.is_symlink():
            link.unlink()

    def _override(self, bdf: str) -> str | None:
        text = (self._dev(bdf) / "driver_override").read_text().strip()
        return None if text in ("", "(null)") else text

    def _accepts(self, driver: str, bdf: str) -> bool:
        """Would ``driver`` take the function (override, then the driver's own ID table)?"""
        f = self.functions[bdf]
        override = self._override(bdf)
        if override is not None:
            return override == driver
        if driver == NVIDIA:
            return f.pci_class.startswith("0x0300") or f.pci_class.startswith("0x0302")
        if driver == HDA:
            return f.pci_class == AUDIO_CLASS
        return False  # vfio-pci and its variants have no ID table of their own

    # -- the kernel ------------------------------------------------------------------------------
    def _take(self, path: Path) -> str:
        try:
            text = path.read_text().strip()
        except OSError:
            return ""
        if text:
            path.write_text("")
        return text

    def settle(self) -> None:
        """Act on what was written since the last call. The binds and the probe are taken first: whatever
        the writer put before them (the unbind, the override) is then already there to be seen, even from
        another process."""
        binds = {d: self._take(self._p(f"/sys/bus/pci/drivers/{d}/bind")) for d in self.drivers}
        probe = self._take(self._p("/sys/bus/pci/drivers_probe"))
        for d in self.drivers:
            bdf = self._take(self._p(f"/sys/bus/pci/drivers/{d}/unbind"))
            if bdf in self.functions and self.driver_of(bdf) == d:
                self._unbind(bdf)
        for d, bdf in binds.items():
            if bdf in self.functions and self.driver_of(bdf) is None and self._accepts(d, bdf):
                self._bind(bdf, d)
        bdf = probe
        if bdf in self.functions and self.driver_of(bdf) is None:
            for d in self.drivers:
                if self._accepts(d, bdf):
                    self._bind(bdf, d)
                    break
        for f in self.functions.values():
            dev = self._dev(f.bdf)
            text = (dev / "driver_override").read_text()
            if text.strip() == "" and (self.quiet_s <= 0 or time.time() - (dev / "driver_override").stat().st_mtime
                                       >= self.quiet_s):
                (dev / "driver_override").write_text("(null)\n")  # an empty line clears the override
            self._take(dev / "reset")
        self._vfio_nodes()
        self._sync_nvml()

    def _sync_nvml(self) -> None:
        """Record in the simulator's state the driver of every GPU not on ``nvidia`` (what NVML sees)."""
        if self.store is None:
            return
        owners = {f.gpu: self.driver_of(f.bdf) or "" for f in self.functions.values() if f.gpu is not None}
        state = self.store.read()
        if all(state["gpus"][i].get("driver", NVIDIA) == d for i, d in owners.items()):
            return
        with self.store.transaction() as st:
            for i, driver in owners.items():
                if driver == NVIDIA:
                    st["gpus"][i].pop("driver", None)
                else:
                    st["gpus"][i]["driver"] = driver

    def _vfio_nodes(self) -> None:
        vfio = self._p("/dev/vfio")
        groups = {str(f.group) for f in self.functions.values() if self.driver_of(f.bdf) in (VFIO, GRACE_VFIO)}
        if groups:
            vfio.mkdir(parents=True, exist_ok=True)
            (vfio / "vfio").write_text("")
        if vfio.is_dir():
            for name in os.listdir(vfio):
                if name.isdigit() and name not in groups:
                    (vfio / name).unlink()
        for g in groups:
            if not (vfio / g).exists():
                (vfio / g).write_text("")
