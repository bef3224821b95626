"""Writing the spec: atomically, only when its bytes change, and never a stale one left behind.

``CdiWriter.refresh(inventory)`` is the one call the daemon, the MIG apply path, ``bootstrap`` and the
CLI make. It regenerates the whole spec from the inventory, so MIG devices that vanished lose their
entries in the same write; equal content writes nothing; no GPU removes the file (a CDI spec without
devices is invalid, and names that no longer exist must not resolve).

Kept lean for the MIG apply path (apply → spec → first Allocate): the driver root is listed again only
when its directories changed (``host.driver_key``); the device nodes and mig-minors are read on every
refresh; and a refresh whose inventory and host facts equal those of the last write renders nothing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from nodeagent import fileio
from nodeagent.cdi.host import CdiError, DriverFacts, HostFacts, collect, collect_driver, driver_key
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
        self._driver: tuple[tuple[object, ...], DriverFacts] | None = None
        # (inventory, host facts, file bytes) of the last write or check that left the file current
        self._current: tuple[Inventory, HostFacts, bytes] | None = None

    @property
    def file(self) -> str:
        return str(self.paths(self.spec_path))

    def render(self, inventory: Inventory) -> str | None:
        return build(self.paths, inventory, self.driver_root)

    def _driver_facts(self, driver_version: str) -> DriverFacts:
        key = driver_key(self.paths, driver_version, self.driver_root)
        if self._driver is None or self._driver[0] != key:
            self._driver = (key, collect_driver(self.paths, driver_version, self.driver_root))
        return self._driver[1]

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
        facts = collect(self.paths, inventory, self.driver_root, self._driver_facts(inventory.driver_version))
        try:
            old = fileio.read_bytes(target, root=self.paths)  # a FIFO or device in its place is refused, never waited on
        except fileio.UnreadableFileError as e:
            raise CdiError(str(e), subject=str(target)) from e
        except OSError as e:
            raise CdiError(f"cannot read {target}: {e}", subject=str(target)) from e
        current = self._current
        if current is not None and old == current[2] and current[0] == inventory and current[1] == facts:
            # same GPUs, same host, and the file still holds what was written for them: nothing to render
            assert self.last is not None
            result = WriteResult("unchanged", str(target), self.last.devices, time.perf_counter() - start)
            self.last = result
            return result
        self._current = None
        spec = generate(inventory, facts)
        if spec is None:
            action: Literal["written", "unchanged", "removed", "absent"] = "absent"
            if old is not None:
                try:
                    fileio.remove(target, root=self.paths)
                except OSError as e:
                    raise CdiError(f"cannot remove {target}: {e}", subject=str(target)) from e
                action = "removed"
            result = WriteResult(action, str(target), (), time.perf_counter() - start)
        else:
            data = render(spec).encode("utf-8")
            action = "unchanged"
            if data != old:
                try:
                    fileio.atomic_write(target, data, mode=SPEC_MODE, backup=False, root=self.paths, parents=True)
                except OSError as e:
                    raise CdiError(f"cannot write {target}: {e}", subject=str(target)) from e
                action = "written"
            self._current = (inventory, facts, data)
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
