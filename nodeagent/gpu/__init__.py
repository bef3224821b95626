"""GPU layer: the Inventory model, the NVML adapter, the simulator, topology and health.

Only ``gpu/nvml.py`` (and the simulator it may be handed) touches NVML; nothing here talks to Kubernetes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from nodeagent.errors import InputError
from nodeagent.hostpaths import HostPaths

if TYPE_CHECKING:
    from nodeagent.gpu.nvml import NvmlAdapter


def open_nvml(simulate: str | None, sim_state: Path | None = None, paths: HostPaths | None = None) -> NvmlAdapter:
    """The NVML adapter over the simulator (``simulate`` machine and/or an existing ``sim_state`` file)
    or, with neither, over the real driver (NvmlNotFoundError when it is not installed)."""
    from nodeagent.gpu.nvml import NvmlAdapter

    if simulate is not None or sim_state is not None:
        from nodeagent.gpu.sim import open_sim

        if sim_state is not None and not sim_state.absolute().parent.is_dir():
            raise InputError(f"sim-state file {sim_state}: directory {sim_state.absolute().parent} does not exist",
                             subject=str(sim_state))

        from nodeagent.gpu import abi

        if abi.abi_mode_requested():  # the real pynvml over the stand-in libnvidia-ml.so.1 (README: ABI mode)
            return NvmlAdapter(abi.open_pynvml(simulate, sim_state), paths)
        return NvmlAdapter(open_sim(simulate, sim_state), paths)
    import pynvml

    return NvmlAdapter(pynvml, paths)
