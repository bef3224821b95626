"""The workload-config switch: all GPUs of the node to a VFIO driver (vm-passthrough) and back (container).

To vm-passthrough: no GPU may run a process (NVML); persistence mode is turned off on the GPUs that have
it (a GPU in persistence mode counts as in use, and the driver would keep it) and remembered in
``<state_dir>/vfio-state.json``; then each function of ``plan.passthrough_set`` is moved with the writes of
``plan.bind_writes`` and its driver link checked. Back to container: no VFIO group may be open by a
process (``/proc/*/fd``), each function is released to the kernel's own driver, and the remembered
persistence mode is turned on again. Any failure puts every function back on the driver it had and the
persistence mode as it was, and the error says what failed (and whether the undo did too).
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from nodeagent import fileio
from nodeagent.errors import GpuBusyError, NodeAgentError, OperationError
from nodeagent.gpu.inventory import GpuProcess, Inventory
from nodeagent.hostpaths import HostPaths
from nodeagent.vfio.allocate import VfioDevice
from nodeagent.vfio.names import PCI_IDS_PATHS, parse_pci_ids, resource_name
from nodeagent.vfio.plan import (
    CONTAINER,
    GRACE_VFIO,
    VFIO_DRIVERS,
    VM_PASSTHROUGH,
    WORKLOAD_LABEL,
    WORKLOAD_STATE_LABEL,
    PciFunction,
    bind_writes,
    parse_workload,
    passthrough_set,
    release_writes,
    restore_writes,
    vfio_driver,
    workload_of,
)
from nodeagent.vfio.sysfs import PciSysfs

log = logging.getLogger(__name__)

STATE_FILE = "vfio-state.json"
MAX_PCI_IDS = 8 << 20  # the whole database is about 1.4 MB


class VfioGpus(Protocol):
    """What the switch needs of the NVML adapter (the GPUs still on the nvidia driver)."""

    def discover(self) -> Inventory: ...

    def processes(self, index: int) -> tuple[GpuProcess, ...]: ...

    def set_persistence_mode(self, index: int, enabled: bool) -> None: ...


def nvml_bus_to_sysfs(bus_id: str) -> str:
    """``00000000:18:00.0`` → ``0000:18:00.0``."""
    domain, _, rest = bus_id.lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}"


def vfio_users(paths: HostPaths, groups: set[str]) -> list[str]:
    """``pid 42 (qemu-kvm) has /dev/vfio/7 open``, for each process under the root's /proc holding one of
    these VFIO groups."""
    proc = paths.within(paths.proc)
    wanted = {f"/dev/vfio/{g}" for g in groups}
    out: list[str] = []
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            fds = os.listdir(proc / pid / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(proc / pid / "fd" / fd)
            except OSError:
                continue
            if target in wanted:
                comm = (proc / pid / "comm").read_text().strip() if (proc / pid / "comm").exists() else "?"
                out.append(f"pid {pid} ({comm}) has {target} open")
    return out


class VfioSwitch:
    """The ``labelswitch.Switch`` of ``nvidia.com/gpu.workload.config``."""

    name = "WorkloadConfig"
    desired_label = WORKLOAD_LABEL
    state_label = WORKLOAD_STATE_LABEL

    def __init__(self, paths: HostPaths, gpus: VfioGpus, sysfs: PciSysfs | None = None,
                 state_dir: Path | None = None) -> None:
        self.paths = paths
        self.gpu = gpus
        self.sysfs = sysfs or PciSysfs(paths)
        self.state_path = (state_dir or paths.state_dir) / STATE_FILE

    # -- what the device plugin serves --------------------------------------------------------------
    def pci_names(self) -> dict[str, str]:
        """The NVIDIA section of the root's PCI ID database (empty without one)."""
        for path in PCI_IDS_PATHS:
            try:
                text = fileio.read_text(self.paths(path), root=self.paths, max_bytes=MAX_PCI_IDS)
            except NodeAgentError:
                continue
            if text:
                return parse_pci_ids(text)
        return {}

    def resources(self) -> dict[str, dict[str, VfioDevice]]:
        """Resource name → bus id → device, for the GPUs on a VFIO driver (the sandbox plugin's grouping)."""
        names = self.pci_names()
        out: dict[str, dict[str, VfioDevice]] = {}
        for f in self.sysfs.functions():
            if not f.is_gpu or f.driver not in VFIO_DRIVERS or f.iommu_group is None:
                continue
            numa = self.sysfs.numa(f.bdf)
            out.setdefault(resource_name(f.device, names), {})[f.bdf] = VfioDevice(
                f.bdf, f.iommu_group, self.sysfs.vfio_cdev(f.bdf), numa)
        return out

    # -- the Switch protocol --------------------------------------------------------------------
    def parse(self, value: str) -> str:
        return parse_workload(value)

    def current(self) -> str | None:
        return workload_of(self.sysfs.functions())

    def gpus(self) -> frozenset[int]:
        try:
            return frozenset(g.index for g in self.gpu.discover().gpus)
        except NodeAgentError:
            return frozenset()

    def state_labels(self, applied: str | None) -> Mapping[str, str | None]:
        return {WORKLOAD_STATE_LABEL: applied if applied is not None else "failed"}

    def apply(self, wanted: str) -> str:
        before = passthrough_set(self.sysfs.functions())
        if not any(f.is_gpu for f in before):
            raise OperationError("no NVIDIA GPU in the PCI tree (/sys/bus/pci/devices)", subject=WORKLOAD_LABEL)
        if wanted == VM_PASSTHROUGH:
            return self._to_vfio(before)
        return self._to_container(before)

    # -- the two directions ---------------------------------------------------------------------
    def _to_vfio(self, before: list[PciFunction]) -> str:
        inventory = self.gpu.discover()
        busy = [f"GPU {g.index}: " + ", ".join(f"pid {p.pid} ({p.name})" for p in procs)
                for g in inventory.gpus if (procs := self.gpu.processes(g.index))]
        if busy:
            raise GpuBusyError("GPUs run processes: " + "; ".join(busy) + "; nothing was changed",
                               subject=WORKLOAD_LABEL)
        drivers = self.sysfs.drivers()
        driver = vfio_driver(drivers, grace=GRACE_VFIO in drivers)
        if driver not in drivers:
            raise OperationError(f"the {driver} driver is not loaded (/sys/bus/pci/drivers/{driver}); "
                                 "load it (modprobe) first; nothing was changed", subject=WORKLOAD_LABEL)
        persistent = [g for g in inventory.gpus if g.persistence_mode]
        self._save({"persistence": sorted(nvml_bus_to_sysfs(g.pci_bus_id) for g in persistent)})
        turned_off: list[int] = []
        try:
            for g in persistent:
                self.gpu.set_persistence_mode(g.index, False)
                turned_off.append(g.index)
            for f in before:
                for w in bind_writes(f, driver):
                    self.sysfs.write(w)
                self.sysfs.wait_driver(f.bdf, lambda d: d == driver, f"binding it to {driver}")
        except NodeAgentError as e:
            undo = self._undo(before)
            for index in turned_off:
                try:
                    self.gpu.set_persistence_mode(index, True)
                except NodeAgentError as pe:
                    undo.append(f"persistence mode of GPU {index}: {pe}")
            if not undo:
                self._save({})  # back as before: nothing to restore later
            raise OperationError(f"binding the GPUs to {driver} failed: {e}; " + _undo_said(undo),
                                 subject=WORKLOAD_LABEL) from e
        gpus = [f.bdf for f in before if f.is_gpu]
        others = len(before) - len(gpus)
        return (f"{VM_PASSTHROUGH}: GPU(s) {', '.join(gpus)} bound to {driver}"
                + (f" with {others} auxiliary function(s)" if others else "")
                + (f"; persistence mode turned off on {len(persistent)}" if persistent else ""))

    def _to_container(self, before: list[PciFunction]) -> str:
        groups = {f.iommu_group for f in before if f.iommu_group and f.driver in VFIO_DRIVERS}
        users = vfio_users(self.paths, groups)
        if users:
            raise GpuBusyError("VFIO groups are in use: " + "; ".join(users) + "; nothing was changed",
                               subject=WORKLOAD_LABEL)
        try:
            for f in before:
                for w in release_writes(f):
                    self.sysfs.write(w)
                if f.driver in VFIO_DRIVERS:
                    self.sysfs.wait_driver(f.bdf, lambda d: d is not None and d not in VFIO_DRIVERS,
                                           "releasing it to its own driver")
        except NodeAgentError as e:
            undo = self._undo(before)
            raise OperationError(f"releasing the GPUs from VFIO failed: {e}; " + _undo_said(undo),
                                 subject=WORKLOAD_LABEL) from e
        restored = self._restore_persistence()
        gpus = [f.bdf for f in before if f.is_gpu]
        return (f"{CONTAINER}: GPU(s) {', '.join(gpus)} back on their driver"
                + (f"; persistence mode turned on again on {restored}" if restored else ""))

    # -- undo and the persistence record --------------------------------------------------------
    def _undo(self, before: list[PciFunction]) -> list[str]:
        """Put every function back on its driver of ``before``; the problems met (empty: all back)."""
        problems: list[str] = []
        for f in before:
            try:
                now = self.sysfs.function(f.bdf).driver
                for w in restore_writes(f, now):
                    self.sysfs.write(w)
                if now != f.driver:
                    self.sysfs.wait_driver(f.bdf, functools.partial(operator.eq, f.driver), "putting it back")
            except NodeAgentError as e:
                problems.append(str(e))
        return problems

    def _restore_persistence(self) -> int:
        record = self._load()
        wanted = set(record.get("persistence", []))
        if not wanted:
            return 0
        done = 0
        for g in self.gpu.discover().gpus:
            if nvml_bus_to_sysfs(g.pci_bus_id) in wanted:
                try:
                    self.gpu.set_persistence_mode(g.index, True)
                    done += 1
                except NodeAgentError as e:
                    log.warning("vfio: persistence mode of GPU %d not restored: %s", g.index, e)
        self._save({})
        return done

    def _load(self) -> dict[str, list[str]]:
        text = fileio.read_text(self.state_path, root=self.paths)
        if not text:
            return {}
        try:
            doc = json.loads(text)
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def _save(self, doc: Mapping[str, list[str]]) -> None:
        fileio.atomic_write(self.state_path, (json.dumps(dict(doc), sort_keys=True) + "\n").encode(),
                            root=self.paths, backup=False, parents=True)


def _undo_said(problems: list[str]) -> str:
    if not problems:
        return "every function is back on the driver it had"
    return "putting the functions back failed too: " + "; ".join(problems)
