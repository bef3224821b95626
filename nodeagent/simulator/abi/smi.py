"""``nvidia-smi`` stand-in for ABI mode: only ``--gpu-reset -i N``, on the machine of the environment.

nodeagent resets a GPU (to apply a pending MIG mode on Ampere) by running ``nvidia-smi --gpu-reset -i N``;
in ABI mode that command is this module, which resets the simulated GPU in the shared state file named
by ``NODEAGENT_SIM_STATE`` (and ``NODEAGENT_SIM_MACHINE``), with nvidia-smi's exit codes and messages.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pynvml

from nodeagent.errors import InputError
from nodeagent.simulator.open import open_sim


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nvidia-smi", description="nvidia-smi stand-in (GPU reset only)")
    ap.add_argument("--gpu-reset", action="store_true", required=True, help="reset the GPU given with -i")
    ap.add_argument("-i", "--id", type=int, required=True, help="GPU index")
    args = ap.parse_args(argv)
    state = os.environ.get("NODEAGENT_SIM_STATE") or None
    try:
        sim = open_sim(os.environ.get("NODEAGENT_SIM_MACHINE") or None, Path(state) if state else None)
    except InputError as e:
        print(f"nvidia-smi: {e}", file=sys.stderr)
        return 9
    sim.nvmlInit()
    try:
        handle = sim.nvmlDeviceGetHandleByIndex(args.id)
        bus = sim.nvmlDeviceGetPciInfo(handle).busId
        bus_id = bus.decode() if isinstance(bus, bytes) else str(bus)
        sim.simResetGpu(handle)
    except pynvml.NVMLError as e:
        if int(e.value) == pynvml.NVML_ERROR_IN_USE:
            print(
                f"The following GPUs could not be reset:\n  GPU {args.id}: In use by another client",
                file=sys.stderr,
            )
            return 255
        print(f"Unable to reset GPU {args.id}: {e}", file=sys.stderr)
        return 3 if int(e.value) == pynvml.NVML_ERROR_INVALID_ARGUMENT else 255
    finally:
        sim.nvmlShutdown()
    print(f"GPU {bus_id} was successfully reset.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
