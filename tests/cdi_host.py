"""A simulated host for the CDI tests: simulator state + MIG layout + /proc, /dev and a fake driver."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from nodeagent.cdi import simhost
from nodeagent.gpu.inventory import Inventory
from nodeagent.gpu.profiles import MigProduct
from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import open_nvml
from nodeagent.simulator import inject
from nodeagent.simulator.machine import load_machine, machine_names
from nodeagent.simulator.state import SimStore

SPEC_DIR = "/var/run/cdi"


@dataclass
class SimHost:
    root: Path
    state: Path
    paths: HostPaths
    store: SimStore

    def discover(self) -> Inventory:
        with open_nvml(None, self.state, self.paths) as nvml:
            inv: Inventory = nvml.discover()
        return inv

    def refresh_host_files(self) -> Inventory:
        """Rediscover and lay out /proc and /dev as the driver would for the current layout."""
        inv = self.discover()
        simhost.materialise(self.paths, inv)
        return inv

    @property
    def spec_dir(self) -> Path:
        return self.paths(SPEC_DIR)


def make_host(tmp: Path, machine: str, *, hook: bool = True) -> SimHost:
    root = tmp / "root"
    root.mkdir(parents=True, exist_ok=True)
    state = tmp / "sim.json"
    store = SimStore.open(machine, state)
    host = SimHost(root, state, HostPaths(root), store)
    inv = host.refresh_host_files()
    simhost.make_driver_root(host.paths, inv.driver_version, hook=hook)
    return host


def _products(machine: str) -> dict[int, MigProduct]:
    return {g.index: g.mig_product for g in load_machine(machine).gpus if g.mig_product is not None}


def layouts(machine: str) -> dict[str, dict[int, list[str] | None]]:
    """Named MIG layouts for a machine: GPU index -> profiles (``[]`` MIG on, empty; ``None`` MIG off)."""
    products = _products(machine)
    if not products:
        return {"off": {}}
    out: dict[str, dict[int, list[str] | None]] = {"off": {}}
    smallest = {i: [p.profiles[0].name] * len(p.profiles[0].placement_starts) for i, p in products.items()}
    out["all-smallest"] = dict(smallest)
    halves: dict[int, list[str] | None] = {}
    for i, p in products.items():
        half = next(x for x in p.profiles if len(x.placement_starts) == 2 and "+" not in x.name)
        halves[i] = [half.name, half.name]
    out["halves"] = halves
    varied: dict[int, list[str] | None] = {}
    for n, (i, p) in enumerate(sorted(products.items())):
        if n % 4 == 0:
            varied[i] = [p.profiles[-1].name]  # the whole GPU as one MIG device
        elif n % 4 == 1:
            varied[i] = [p.profiles[0].name, p.profiles[1].name, p.profiles[-3].name]
        elif n % 4 == 2:
            varied[i] = []  # MIG on, no instances
        else:
            varied[i] = None
    out["varied"] = varied
    return out


def apply_layout(host: SimHost, layout: Mapping[int, list[str] | None]) -> Inventory:
    """Write ``layout`` into the simulator (GPUs not named: MIG off) and refresh the host files."""
    for i in _products(host.store.machine.name):
        profiles = layout.get(i)
        if profiles is None:
            inject.set_mig_mode(host.store, i, False)
        elif profiles:
            inject.write_mig_layout(host.store, i, profiles)
        else:
            inject.write_mig_layout(host.store, i, [])
            inject.set_mig_mode(host.store, i, True)
    return host.refresh_host_files()


def all_machine_layouts() -> list[tuple[str, str]]:
    return [(m, name) for m in machine_names() for name in layouts(m)]
