"""Which NVML the adapter is handed: the real driver's, the simulator, or the real pynvml over the stand-in.

The production path (``nodeagent.gpu``) never imports the simulator; this module is the one place that
chooses, for the commands and the daemon that take ``--simulate`` / ``--sim-state``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from nodeagent.errors import InputError
from nodeagent.hostpaths import HostPaths

if TYPE_CHECKING:
    from nodeagent.gpu.mps import ComputeModes, MpsManager
    from nodeagent.gpu.nvml import NvmlAdapter
    from nodeagent.simulator.nvml import SimulatedNvml


def open_nvml(simulate: str | None, sim_state: Path | None = None, paths: HostPaths | None = None) -> NvmlAdapter:
    """The NVML adapter over the simulator (``simulate`` machine and/or an existing ``sim_state`` file)
    or, with neither, over the real driver (NvmlNotFoundError when it is not installed)."""
    from nodeagent.gpu.nvml import NvmlAdapter

    if simulate is None and sim_state is None:
        import pynvml

        return NvmlAdapter(pynvml, paths)

    if paths is not None and paths.root == Path("/"):
        # the simulator lays out stand-in host files (/dev/nvidia*, /proc/devices, the CDI spec)
        raise InputError("the NVML simulator never acts on the real host: give it a sandbox root "
                         "(--root DIR), not /")
    if sim_state is not None and not sim_state.absolute().parent.is_dir():
        raise InputError(f"sim-state file {sim_state}: directory {sim_state.absolute().parent} does not exist",
                         subject=str(sim_state))

    from nodeagent.simulator import abi

    if abi.abi_mode_requested():  # the real pynvml over the stand-in libnvidia-ml.so.1 (docs/simulator.md: ABI mode)
        adapter = NvmlAdapter(abi.open_pynvml(simulate, sim_state), paths)
        if sim_state is not None:  # one simulated machine: the same fault domain as the Python path
            adapter.fault_domain = f"sim:{sim_state.absolute()}"
        return adapter
    from nodeagent.simulator.open import open_sim

    return adapter_for_sim(open_sim(simulate, sim_state), paths)


def adapter_for_sim(sim: SimulatedNvml, paths: HostPaths | None = None) -> NvmlAdapter:
    """The NVML adapter over a simulator, resetting GPUs the simulator's way."""
    from nodeagent.gpu.nvml import NvmlAdapter
    from nodeagent.simulator.reset import SimGpuResetter

    adapter = NvmlAdapter(sim, paths, SimGpuResetter(sim))
    path = sim.store.path
    adapter.fault_domain = None if path is None else f"sim:{path.absolute()}"
    return adapter


def mps_manager(paths: HostPaths, driver_root: str, simulate: str | None, sim_state: Path | None,
                gpu: object = None, owner: str = "device-plugin") -> MpsManager:
    """The MPS daemons' manager: ``nvidia-cuda-mps-control`` under the driver root, executed only when the
    root is the node's own ``/`` (the host's, or the DaemonSet's ``--root /host --root-on-host /``): nothing
    is ever executed from a sandbox root. On the simulator the stand-in is this interpreter running
    ``nodeagent.simulator.mps_control`` (nothing of the root is executed), told which simulated state to use
    (only a state file is shared with it; an in-memory machine shows no MPS server process). ``gpu``: the
    NVML adapter, which switches the daemons' GPUs to EXCLUSIVE_PROCESS (anything else: compute modes
    untouched); ``owner``: whose daemons these are (``device-plugin``, ``dra``), which names the record of
    those GPUs."""
    import sys

    from nodeagent.gpu.mps import COMPUTE_MODE_RECORD, CONTROL_BINARY, ComputeModes, MpsManager

    binary = paths(driver_root.rstrip("/") + CONTROL_BINARY)
    modes: ComputeModes | None = gpu if isinstance(gpu, ComputeModes) else None
    record = paths(COMPUTE_MODE_RECORD.format(owner=owner))
    if simulate is None and sim_state is None:
        if not paths.is_node_root:
            # a sandbox root with the real driver: its binary is the sandbox's file, never run
            return MpsManager(binary, compute_modes=modes, record=record, root=paths,
                              command=None, install=None, runnable=False)
        return MpsManager(binary, compute_modes=modes, record=record, root=paths)
    if paths.root == Path("/"):
        raise InputError("the NVML simulator never acts on the real host: give it a sandbox root (--root DIR), not /")
    env: dict[str, str] = {}
    if sim_state is not None:
        env["NODEAGENT_SIM_STATE"] = str(sim_state.absolute())
        if simulate:
            env["NODEAGENT_SIM_MACHINE"] = simulate
    return MpsManager(binary, extra_env=env, compute_modes=modes, record=record, root=paths,
                      command=(sys.executable, "-m", "nodeagent.simulator.mps_control"))


def pci_kernel(paths: HostPaths, simulate: str | None, sim_state: Path | None) -> Callable[[], None] | None:
    """What reacts to writes into the root's PCI tree in sysfs: the kernel itself on a host (None); on the
    simulator the simulated kernel of the machine's tree, laid out under the sandbox root on first use."""
    if simulate is None and sim_state is None:
        return None
    if paths.root == Path("/"):
        raise InputError("the NVML simulator never acts on the real host: give it a sandbox root (--root DIR), not /")
    from nodeagent.simulator.machine import load_machine
    from nodeagent.simulator.pcisysfs import SimPciTree
    from nodeagent.simulator.state import read_state_machine_name

    name = simulate or (read_state_machine_name(sim_state) if sim_state is not None else None)
    if name is None:
        raise InputError(f"sim-state file {sim_state} does not exist yet; name the machine with --simulate MACHINE")
    tree = SimPciTree(paths, load_machine(name))
    if not tree.materialised:
        tree.materialise()
    return tree.settle


CC_TOOL = "nvidia_gpu_tools.py"  # NVIDIA gpu-admin-tools
CC_TOOL_DIRS = ("/usr/local/bin", "/usr/bin", "/opt/nvidia/gpu-admin-tools")


def cc_tool(paths: HostPaths, simulate: str | None, sim_state: Path | None,
            configured: str | None = None) -> tuple[list[str] | None, dict[str, str]]:
    """(argv prefix, environment) of the CC-mode tool: ``configured`` or NVIDIA's ``nvidia_gpu_tools.py``
    where installed, run only when the root is the node's own ``/`` (nothing of a sandbox root is ever
    executed: None there); on the simulator this interpreter running ``nodeagent.simulator.ccadmin``
    against the shared state file (an in-memory machine cannot be shared: None)."""
    import os
    import sys

    base = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LANG": "C", "LC_ALL": "C"}
    if simulate is None and sim_state is None:
        if not paths.is_node_root:
            return None, base
        if configured:
            return [configured], base
        for d in CC_TOOL_DIRS:
            candidate = paths(f"{d}/{CC_TOOL}")
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return [str(candidate)], base
        return None, base
    if sim_state is None:
        return None, base
    env = dict(base, NODEAGENT_SIM_STATE=str(sim_state.absolute()))
    if simulate:
        env["NODEAGENT_SIM_MACHINE"] = simulate
    return [sys.executable, "-m", "nodeagent.simulator.ccadmin"], env
