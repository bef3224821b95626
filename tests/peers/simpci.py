"""The simulated machine's PCI tree for the whole-node cluster (tests/peers/cluster.py), and its kernel.

The agent's DaemonSet mounts the node's ``/sys`` at ``/host/sys``. The host's own sysfs has no NVIDIA GPU
(and must never be written by a test), so for the VFIO switch the cluster's DaemonSet mounts this tree
instead: ``<root>/sys`` on the host, laid out by the simulator (``nodeagent.simulator.pcisysfs``) for the
cluster's machine, its drivers' records kept in the node's simulator state file, which the NVML stand-in
reads (a GPU moved to vfio-pci leaves NVML, as on a real node).

``SimPciKernel.running()`` is the kernel while a test needs one: a thread acting on what the agent writes
into ``bind``, ``unbind``, ``drivers_probe`` and ``driver_override`` (a real kernel's binding is
asynchronous too: the agent polls the driver link), and keeping the VFIO device nodes on the host's
``/dev/vfio`` — real character devices (``/dev/vfio/vfio`` 10:196 as the kernel's, the groups on a major no
driver of this host uses), which containerd needs to hand them to a container as the device plugin's Allocate
names them, as it does for the cluster's ``/dev/nvidia*``. Every node it made goes when the kernel stops.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from nodeagent.hostpaths import HostPaths
from nodeagent.simulator.machine import load_machine
from nodeagent.simulator.pcisysfs import SimPciTree
from nodeagent.simulator.state import SimStore

HOST_VFIO = Path("/dev/vfio")
VFIO_CONTAINER = (10, 196)  # the misc device the kernel's vfio module registers
VFIO_GROUP_MAJOR = 509  # dynamic on a real host; any major this host's drivers do not use will do for runc
SETTLE_S = 0.05
# An emptied driver_override is shown as "(null)" only after this long untouched: the agent writes the empty
# line, unbinds (and waits for it), then writes its override, and on a loaded machine that took over 0.5 s,
# so the kernel's "(null)" overwrote the agent's override and the bind that followed found none.
OVERRIDE_QUIET_S = 30.0


class SimPciKernel:
    def __init__(self, root: Path, machine: str, state: Path) -> None:
        self.root = root
        self.tree = SimPciTree(HostPaths(root), load_machine(machine), SimStore.open(machine, state),
                                quiet_s=OVERRIDE_QUIET_S)
        self._made: list[Path] = []
        self._made_dir = False

    @property
    def sys(self) -> Path:
        """The host directory the DaemonSet mounts as the node's ``/sys``."""
        return self.root / "sys"

    def pci_ids(self) -> bytes:
        """The PCI ID database's entries of the machine's devices (as the simulator lays it out)."""
        return (self.root / "usr/share/misc/pci.ids").read_bytes()

    def lay_out(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.tree.materialised:
            self.tree.materialise()

    def settle(self) -> None:
        self.tree.settle()
        self._host_nodes()

    def _host_nodes(self) -> None:
        sim = self.root / "dev/vfio"
        groups = {n for n in (os.listdir(sim) if sim.is_dir() else ()) if n.isdigit()}
        if groups and not HOST_VFIO.exists():
            HOST_VFIO.mkdir()
            self._made_dir = True
        wanted = {HOST_VFIO / "vfio": VFIO_CONTAINER} if groups else {}
        wanted.update({HOST_VFIO / g: (VFIO_GROUP_MAJOR, int(g)) for g in groups})
        for path, (major, minor) in wanted.items():
            if not path.exists():
                os.mknod(path, 0o666 | 0o020000, os.makedev(major, minor))
                self._made.append(path)
        for path in [p for p in self._made if p not in wanted]:
            path.unlink(missing_ok=True)
            self._made.remove(path)

    def remove_nodes(self) -> None:
        for path in self._made:
            path.unlink(missing_ok=True)
        self._made.clear()
        if self._made_dir:
            with contextlib.suppress(OSError):
                HOST_VFIO.rmdir()
            self._made_dir = False

    @contextlib.contextmanager
    def running(self) -> Iterator[SimPciKernel]:
        stop = threading.Event()
        errors: list[BaseException] = []

        def loop() -> None:
            while not stop.wait(SETTLE_S):
                try:
                    self.settle()
                except Exception as e:  # a write caught half-done: the next round sees it whole
                    errors.append(e)
                    if len(errors) > 20:
                        return

        thread = threading.Thread(target=loop, name="sim-pci-kernel", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join(timeout=5)
            self.remove_nodes()
        if len(errors) > 20:
            raise RuntimeError(f"the simulated PCI kernel stopped: {errors[-1]!r}")
