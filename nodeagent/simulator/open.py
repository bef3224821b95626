"""Open a simulated NVML module for a named machine or an existing state file."""

from __future__ import annotations

from pathlib import Path

from nodeagent.simulator.nvml import SimulatedNvml
from nodeagent.simulator.state import SimStore


def open_sim(machine: str | None, sim_state: Path | None = None) -> SimulatedNvml:
    """A simulated NVML module for ``machine`` (or the machine recorded in ``sim_state``)."""
    return SimulatedNvml(SimStore.open(machine, sim_state))
