"""The PCI tree in sysfs, under the injectable root: reading functions and writing the binding files.

Every path is resolved inside the root at the moment it is used (``HostPaths.within``). A write opens an
existing file write-only (sysfs never creates files; a missing one is an error) and writes the value in
one call, as ``echo`` does. ``after_write`` runs after each write: on the simulator it is the simulated
kernel reacting to it (``nodeagent.simulator.pcisysfs``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from nodeagent.errors import OperationError
from nodeagent.hostpaths import HostPaths
from nodeagent.vfio.plan import SYS_DEVICES, SYS_DRIVERS, PciFunction, SysfsWrite

BIND_WAIT_S = 5.0  # how long a bind may take before the driver link shows it (default of bind_wait_s)
BIND_POLL_S = 0.05


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _link_name(path: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


class PciSysfs:
    def __init__(self, paths: HostPaths, after_write: Callable[[], None] | None = None) -> None:
        self.paths = paths
        self.after_write = after_write
        self.bind_wait_s = BIND_WAIT_S

    def _dir(self, host_path: str) -> Path:
        return self.paths.within(self.paths(host_path))

    def function(self, bdf: str) -> PciFunction:
        d = self._dir(f"{SYS_DEVICES}/{bdf}")
        return PciFunction(
            bdf=bdf,
            vendor=_read(d / "vendor").lower().removeprefix("0x"),
            device=_read(d / "device").lower().removeprefix("0x"),
            pci_class=_read(d / "class").lower().removeprefix("0x"),
            driver=_link_name(d / "driver"),
            iommu_group=_link_name(d / "iommu_group"),
        )

    def functions(self) -> list[PciFunction]:
        """Every PCI function (none when the root has no PCI tree)."""
        try:
            names = sorted(os.listdir(self._dir(SYS_DEVICES)))
        except OSError:
            return []
        return [self.function(n) for n in names]

    def drivers(self) -> list[str]:
        """The PCI drivers loaded (``/sys/bus/pci/drivers``)."""
        try:
            return sorted(os.listdir(self._dir(SYS_DRIVERS)))
        except OSError:
            return []

    def numa(self, bdf: str) -> int | None:
        try:
            return int(_read(self._dir(f"{SYS_DEVICES}/{bdf}") / "numa_node"))
        except ValueError:
            return None

    def vfio_cdev(self, bdf: str) -> str | None:
        """``vfio3`` when the function has an iommufd character device."""
        try:
            names = os.listdir(self._dir(f"{SYS_DEVICES}/{bdf}/vfio-dev"))
        except OSError:
            return None
        return sorted(names)[0] if names else None

    def write(self, w: SysfsWrite) -> None:
        path = self._dir(w.path)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                os.write(fd, w.value.encode())
            finally:
                os.close(fd)
        except OSError as e:
            raise OperationError(f"writing {w}: {e.strerror or e}", subject=w.path) from e
        if self.after_write is not None:
            self.after_write()

    def wait_driver(self, bdf: str, ok: Callable[[str | None], bool], what: str) -> str | None:
        """Poll the function's driver link until ``ok`` accepts it (a bind is asynchronous for some drivers);
        ``OperationError`` naming ``what`` after ``bind_wait_s``."""
        deadline = time.monotonic() + self.bind_wait_s
        while True:
            driver = _link_name(self._dir(f"{SYS_DEVICES}/{bdf}") / "driver")
            if ok(driver):
                return driver
            if time.monotonic() >= deadline:
                raise OperationError(f"{bdf} is on driver {driver or '(none)'} after {what}", subject=bdf)
            time.sleep(BIND_POLL_S)
