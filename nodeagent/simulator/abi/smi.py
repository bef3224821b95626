"""``nvidia-smi`` stand-in for ABI mode: only ``-r/--gpu-reset [-i ID[,ID...]]``, on the machine of the
environment.

nodeagent resets a GPU (to apply a pending MIG mode on Ampere, or to remediate a fault) by running
``nvidia-smi --gpu-reset -i N`` or ``nvidia-smi -r -i <UUID>``; in ABI mode that command is this module,
which resets the simulated GPUs in the shared state file named by ``NODEAGENT_SIM_STATE`` (and
``NODEAGENT_SIM_MACHINE``), with nvidia-smi's exit codes and messages: refused while a process uses a GPU,
exit 15 for a GPU that fell off the bus. ``-i`` takes indices, UUIDs or PCI bus ids, comma-separated.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import pynvml

from nodeagent.errors import InputError
from nodeagent.simulator.open import open_sim

EXIT_FELL_OFF_BUS = 15


def _handle(sim: Any, ident: str) -> Any:
    if ident.isdigit():
        return sim.nvmlDeviceGetHandleByIndex(int(ident))
    if ident.upper().startswith(("GPU-", "MIG-")):
        return sim.nvmlDeviceGetHandleByUUID(ident)
    return sim.nvmlDeviceGetHandleByPciBusId(ident)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nvidia-smi", description="nvidia-smi stand-in (GPU reset only)")
    ap.add_argument("-r", "--gpu-reset", action="store_true", required=True, help="reset the GPUs given with -i")
    ap.add_argument("-i", "--id", required=True, help="GPU index, UUID or PCI bus id (comma-separated)")
    args = ap.parse_args(argv)
    state = os.environ.get("NODEAGENT_SIM_STATE") or None
    try:
        sim = open_sim(os.environ.get("NODEAGENT_SIM_MACHINE") or None, Path(state) if state else None)
    except InputError as e:
        print(f"nvidia-smi: {e}", file=sys.stderr)
        return 9
    sim.nvmlInit()
    done = []
    try:
        ids = [i.strip() for i in str(args.id).split(",") if i.strip()]
        handles = []
        for ident in ids:  # resolve all first: an unknown id resets nothing
            try:
                handles.append((ident, _handle(sim, ident)))
            except pynvml.NVMLError:
                print(f"No devices were found matching {ident}", file=sys.stderr)
                return 6
        for ident, handle in handles:
            try:
                bus = sim.nvmlDeviceGetPciInfo(handle).busId
                bus_id = bus.decode() if isinstance(bus, bytes) else str(bus)
                sim.simResetGpu(handle)
            except pynvml.NVMLError as e:
                code = int(e.value)
                if code == pynvml.NVML_ERROR_IN_USE:
                    print(f"The following GPUs could not be reset:\n  GPU {ident}: In use by another client",
                          file=sys.stderr)
                    return 255
                if code == pynvml.NVML_ERROR_GPU_IS_LOST:
                    print(f"Unable to reset GPU {ident}: GPU has fallen off the bus", file=sys.stderr)
                    return EXIT_FELL_OFF_BUS
                print(f"Unable to reset GPU {ident}: {e}", file=sys.stderr)
                return 3 if code == pynvml.NVML_ERROR_INVALID_ARGUMENT else 255
            done.append(bus_id)
    finally:
        sim.nvmlShutdown()
    for bus_id in done:
        print(f"GPU {bus_id} was successfully reset.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
