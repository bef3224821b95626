"""Writing the spec: atomically, only when its bytes change, and never a stale one left behind.

``CdiWriter.refresh(inventory)`` is the one call the daemon, the MIG apply path, ``bootstrap`` and the
CLI make. It regenerates the whole spec from the inventory, so MIG devices that vanished lose their
entries in the same write; equal content writes nothing; no GPU removes the file (a CDI spec without
devices is invalid, and names that no longer exist must not resolve).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from nodeagent import fileio
from nodeagent.cdi.host import CdiError, collect
from nodeagent.cdi.spec import device_names, generate, render
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths

log = logging.getLogger(__name__)

SPEC_PATH = "/var/run/cdi/nvidia.yaml"
SPEC_MODE = 0o644

Outcome = Literal["changed", "unchanged", "failed"]


@dataclass(frozen=True)
class WriteResult:
    """What one refresh did."""

    action: Literal["written", "unchanged", "removed", "absent"]
    path: str
    devices: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def changed(self) -> bool:
        return self.action in ("written", "removed")


@dataclass(frozen=True)
class CdiStepResult:
    """``bootstrap``'s ``cdi`` step: outcome changed / unchanged / failed, a one-line reason, details."""

    outcome: Outcome
    message: str
    details: dict[str, Any] = field(default_factory=dict)


def build(paths: HostPaths, inventory: Inventory, driver_root: str = "/") -> str | None:
    """The spec text for ``inventory`` on this host (``None``: no GPU, no spec)."""
    spec = generate(inventory, collect(paths, inventory, driver_root))
    return None if spec is None else render(spec)


class CdiWriter:
    """Keeps ``/var/run/cdi/nvidia.yaml`` (under ``paths``) equal to what the inventory says.

    ``refresh`` is synchronous and fast (a few stats and at most one small atomic write); the daemon
    may call ``on_inventory`` from its event loop instead. Calls are serialised here: the daemon writes
    from a rediscovery and from a MIG apply that may overlap; ``last`` keeps the most recent result.
    """

    def __init__(self, paths: HostPaths, *, driver_root: str = "/", spec_path: str = SPEC_PATH,
                 sim_host_files: bool = False) -> None:
        self.paths = paths
        self.driver_root = driver_root
        self.spec_path = spec_path
        # With the NVML simulator there is no driver to keep /proc and /dev in step with the MIG layout:
        # each write first lays them out for the inventory (nodeagent.cdi.simhost), as the driver would.
        self.sim_host_files = sim_host_files
        self.last: WriteResult | None = None
        self._lock = threading.Lock()

    @property
    def file(self) -> str:
        return str(self.paths(self.spec_path))

    def render(self, inventory: Inventory) -> str | None:
        return build(self.paths, inventory, self.driver_root)

    def write(self, inventory: Inventory) -> WriteResult:
        """Bring the file in line with ``inventory``; raises ``CdiError`` (file untouched) on failure."""
        with self._lock:
            return self._write(inventory)

    def _write(self, inventory: Inventory) -> WriteResult:
        start = time.perf_counter()
        target = self.paths(self.spec_path)
        if self.sim_host_files:
            from nodeagent.cdi.simhost import materialise

            materialise(self.paths, inventory)
        spec = generate(inventory, collect(self.paths, inventory, self.driver_root))
        try:
            old = fileio.read_bytes(target)
        except OSError as e:
            raise CdiError(f"cannot read {target}: {e}", subject=str(target)) from e
        if spec is None:
            action: Literal["written", "unchanged", "removed", "absent"] = "absent"
            if old is not None:
                try:
                    fileio.remove(target)
                except OSError as e:
                    raise CdiError(f"cannot remove {target}: {e}", subject=str(target)) from e
                action = "removed"
            result = WriteResult(action, str(target), (), time.perf_counter() - start)
        else:
            data = render(spec).encode("utf-8")
            action = "unchanged"
            if data != old:
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    fileio.atomic_write(target, data, mode=SPEC_MODE, backup=False)
                except OSError as e:
                    raise CdiError(f"cannot write {target}: {e}", subject=str(target)) from e
                action = "written"
            result = WriteResult(action, str(target), tuple(device_names(spec)), time.perf_counter() - start)
        if result.changed:
            log.info("CDI spec %s %s (%d device names)", result.action, result.path, len(result.devices))
        self.last = result
        return result

    def refresh(self, inventory: Inventory) -> bool:
        """``write`` for callers that only need to know whether the file changed."""
        return self.write(inventory).changed

    async def on_inventory(self, inventory: Inventory) -> bool:
        """The daemon's hook: run ``refresh`` off the event loop; errors propagate as ``CdiError``."""
        return await asyncio.to_thread(self.refresh, inventory)


def cdi_step(paths: HostPaths, inventory: Inventory, driver_root: str = "/", *,
             sim_host_files: bool = False) -> CdiStepResult:
    """``bootstrap``'s ``cdi`` step: write the spec for ``inventory``; never raises for host problems.
    ``sim_host_files``: running on the NVML simulator (see ``CdiWriter``)."""
    writer = CdiWriter(paths, driver_root=driver_root, sim_host_files=sim_host_files)
    try:
        r = writer.write(inventory)
    except CdiError as e:
        return CdiStepResult("failed", str(e), {"path": writer.file})
    details: dict[str, Any] = {"path": r.path, "devices": len(r.devices)}
    if r.action == "written":
        return CdiStepResult("changed", f"wrote {r.path} ({len(r.devices)} device names)", details)
    if r.action == "removed":
        return CdiStepResult("changed", f"removed {r.path} (no GPU)", details)
    if r.action == "absent":
        return CdiStepResult("unchanged", "no GPU, no CDI spec", details)
    return CdiStepResult("unchanged", f"{r.path} is up to date", details)
