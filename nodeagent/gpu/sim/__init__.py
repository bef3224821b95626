"""A simulated NVML for machines described in ``machines/*.yaml``, with shared state and fault injection.

Used instead of pynvml when no GPU is present (tests, demos, ``--simulate``); never imports a real driver.
"""

from __future__ import annotations

from pathlib import Path

from nodeagent.gpu.sim.machine import SimGpuSpec, SimMachine, load_machine, machine_names
from nodeagent.gpu.sim.nvml import SimulatedNvml
from nodeagent.gpu.sim.state import SimStore

__all__ = ["SimGpuSpec", "SimMachine", "SimStore", "SimulatedNvml", "load_machine", "machine_names", "open_sim"]


def open_sim(machine: str | None, sim_state: Path | None = None) -> SimulatedNvml:
    """A simulated NVML module for ``machine`` (or the machine recorded in ``sim_state``)."""
    return SimulatedNvml(SimStore.open(machine, sim_state))
