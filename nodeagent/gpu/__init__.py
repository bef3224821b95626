"""GPU layer: the Inventory model, the NVML adapter, the simulator and the ABI stand-in, topology and health.

NVML is called only by the adapter (``gpu/nvml.py`` and its ``nvml_*.py`` parts), on the module it is
handed: the real ``pynvml`` (``open_nvml`` imports it for that), the simulator (``gpu/sim/``, built from
pynvml's own constants, structs and error classes) or pynvml bound to the stand-in library (``gpu/abi/``).
Nothing here talks to Kubernetes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from nodeagent.errors import InputError
from nodeagent.hostpaths import HostPaths

if TYPE_CHECKING:
    from nodeagent.gpu.nvml import NvmlAdapter
    from nodeagent.gpu.sim import SimulatedNvml


def open_nvml(simulate: str | None, sim_state: Path | None = None, paths: HostPaths | None = None) -> NvmlAdapter:
    """The NVML adapter over the simulator (``simulate`` machine and/or an existing ``sim_state`` file)
    or, with neither, over the real driver (NvmlNotFoundError when it is not installed)."""
    from nodeagent.gpu.nvml import NvmlAdapter

    if simulate is not None or sim_state is not None:
        from nodeagent.gpu.sim import open_sim

        if paths is not None and paths.root == Path("/"):
            # the simulator lays out stand-in host files (/dev/nvidia*, /proc/devices, the CDI spec)
            raise InputError("the NVML simulator never acts on the real host: give it a sandbox root "
                             "(--root DIR), not /")

        if sim_state is not None and not sim_state.absolute().parent.is_dir():
            raise InputError(f"sim-state file {sim_state}: directory {sim_state.absolute().parent} does not exist",
                             subject=str(sim_state))

        from nodeagent.gpu import abi

        if abi.abi_mode_requested():  # the real pynvml over the stand-in libnvidia-ml.so.1 (docs/simulator.md: ABI mode)
            adapter = NvmlAdapter(abi.open_pynvml(simulate, sim_state), paths)
            if sim_state is not None:  # one simulated machine: the same fault domain as the Python path
                adapter.fault_domain = f"sim:{sim_state.absolute()}"
            return adapter
        return adapter_for_sim(open_sim(simulate, sim_state), paths)
    import pynvml

    return NvmlAdapter(pynvml, paths)


def adapter_for_sim(sim: SimulatedNvml, paths: HostPaths | None = None) -> NvmlAdapter:
    """The NVML adapter over a simulator, resetting GPUs the simulator's way."""
    from nodeagent.gpu.nvml import NvmlAdapter
    from nodeagent.gpu.sim.reset import SimGpuResetter

    adapter = NvmlAdapter(sim, paths, SimGpuResetter(sim))
    path = sim.store.path
    adapter.fault_domain = None if path is None else f"sim:{path.absolute()}"
    return adapter
