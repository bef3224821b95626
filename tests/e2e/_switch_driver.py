"""Runs both label-driven switches once each way on the simulator under a sandbox root (for the sandbox
trace): ``python _switch_driver.py ROOT SIM_STATE``. Prints what each step said."""

from __future__ import annotations

import sys
from pathlib import Path

from nodeagent.ccmode.switch import CcSwitch
from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import adapter_for_sim, cc_tool, pci_kernel
from nodeagent.simulator.open import open_sim
from nodeagent.vfio.switch import VfioSwitch
from nodeagent.vfio.sysfs import PciSysfs


def main(root: str, state: str) -> int:
    paths = HostPaths(Path(root).absolute())
    machine, sim_state = "h100-nvl", Path(state).absolute()
    adapter = adapter_for_sim(open_sim(machine, sim_state), paths)
    vfio = VfioSwitch(paths, adapter, PciSysfs(paths, after_write=pci_kernel(paths, machine, sim_state)))
    print(vfio.apply("vm-passthrough"))
    print(sorted(vfio.resources()))
    print(vfio.apply("container"))
    tool, env = cc_tool(paths, machine, sim_state)
    cc = CcSwitch(paths, adapter, tool, env)
    print(cc.apply("on"))
    print(cc.apply("off"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
