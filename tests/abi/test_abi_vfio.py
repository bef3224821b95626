"""GPUs on vfio-pci through the C ABI: after the simulated kernel moves one L40S GPU to vfio-pci, the real
pynvml on the stand-in libnvidia-ml.so.1 no longer sees it (device count, handles by index closing up, by
UUID and by PCI bus id NOT_FOUND), as the real driver's library; after the return it is listed again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import pci_kernel
from nodeagent.simulator.machine import load_machine
from nodeagent.vfio.plan import SysfsWrite
from nodeagent.vfio.sysfs import PciSysfs
from tests.abi._abi import abi_env, run

MACHINE = "l40s-x4"

# A child on the real pynvml: the bus ids by index, and what a lookup of GPU 1 by UUID and bus id gives.
READER = """
import json, sys
import pynvml
pynvml.nvmlInit()
uuid, bus = sys.argv[1], sys.argv[2]
def ask(f):
    try:
        h = f()
        return pynvml.nvmlDeviceGetIndex(h)
    except pynvml.NVMLError as e:
        return {"error": e.value}
out = {"buses": [pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).busId
                 for i in range(pynvml.nvmlDeviceGetCount())],
       "by_uuid": ask(lambda: pynvml.nvmlDeviceGetHandleByUUID(uuid)),
       "by_bus": ask(lambda: pynvml.nvmlDeviceGetHandleByPciBusId(bus))}
pynvml.nvmlShutdown()
print(json.dumps(out))
"""


def test_real_pynvml_does_not_see_a_gpu_on_vfio(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    root = tmp_path / "root"
    root.mkdir()
    paths = HostPaths(root)
    sysfs = PciSysfs(paths, after_write=pci_kernel(paths, MACHINE, state))
    gpus = load_machine(MACHINE).gpus
    uuid, bus = gpus[1].uuid, gpus[1].bus_id
    bdf = f"{int(bus.split(':')[0], 16):04x}:{bus.split(':', 1)[1]}".lower()

    def read() -> dict[str, object]:
        doc: dict[str, object] = json.loads(run([sys.executable, "-c", READER, uuid, bus],
                                                abi_env(state, MACHINE)).stdout)
        return doc

    all_buses = [g.bus_id for g in gpus]
    assert read() == {"buses": all_buses, "by_uuid": 1, "by_bus": 1}
    for w in (SysfsWrite(f"/sys/bus/pci/devices/{bdf}/driver_override", "vfio-pci"),
              SysfsWrite("/sys/bus/pci/drivers/nvidia/unbind", bdf), SysfsWrite("/sys/bus/pci/drivers/vfio-pci/bind", bdf)):
        sysfs.write(w)
    not_found = {"error": 6}  # NVML_ERROR_NOT_FOUND
    assert read() == {"buses": [b for b in all_buses if b != bus], "by_uuid": not_found, "by_bus": not_found}
    for w in (SysfsWrite(f"/sys/bus/pci/devices/{bdf}/driver_override", "\n"),
              SysfsWrite("/sys/bus/pci/drivers/vfio-pci/unbind", bdf), SysfsWrite("/sys/bus/pci/drivers_probe", bdf)):
        sysfs.write(w)
    assert read() == {"buses": all_buses, "by_uuid": 1, "by_bus": 1}
