"""The simulator's stand-in for NVIDIA gpu-admin-tools' ``nvidia_gpu_tools.py`` CC-mode options, run as
``python -m nodeagent.simulator.ccadmin`` against a shared simulator state (``NODEAGENT_SIM_STATE``, with
``NODEAGENT_SIM_MACHINE`` when the file does not exist yet).

    --gpu-bdf=DDDD:BB:DD.F   the GPU (required)
    --set-cc-mode=on|off|devtools
    --set-ppcie-mode=on|off
    --query-cc-mode          prints ``CC mode is <mode>`` (the current one)

A set writes the mode as pending; it takes effect at the GPU's next reset, as the register write of the
real tool does. Refused (exit 1, one line on stderr): a GPU that is not CC-capable, CC on while protected
PCIe is on and the reverse, an unknown bus id or value. Exit 2 for a usage error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CC_VALUES = ("on", "off", "devtools")
PPCIE_VALUES = ("on", "off")


def _fail(message: str, code: int = 1) -> int:
    print(f"ccadmin: {message}", file=sys.stderr)
    return code


def main(argv: list[str]) -> int:
    opts: dict[str, str] = {}
    query = False
    for arg in argv:
        if arg == "--query-cc-mode":
            query = True
            continue
        key, sep, value = arg.partition("=")
        if not sep or key not in ("--gpu-bdf", "--set-cc-mode", "--set-ppcie-mode"):
            return _fail(f"unknown argument {arg!r}", 2)
        opts[key] = value
    if "--gpu-bdf" not in opts:
        return _fail("--gpu-bdf is required", 2)
    cc, ppcie = opts.get("--set-cc-mode"), opts.get("--set-ppcie-mode")
    if cc is not None and cc not in CC_VALUES:
        return _fail(f"--set-cc-mode={cc}: use one of {', '.join(CC_VALUES)}", 2)
    if ppcie is not None and ppcie not in PPCIE_VALUES:
        return _fail(f"--set-ppcie-mode={ppcie}: use on or off", 2)
    path = os.environ.get("NODEAGENT_SIM_STATE")
    if not path:
        return _fail("NODEAGENT_SIM_STATE is not set: the stand-in needs the shared simulator state", 2)

    from nodeagent.errors import NodeAgentError
    from nodeagent.simulator.state import SimStore

    try:
        store = SimStore.open(os.environ.get("NODEAGENT_SIM_MACHINE") or None, Path(path))
    except NodeAgentError as e:
        return _fail(str(e), 2)
    bdf = opts["--gpu-bdf"].lower()
    index = next((g.index for g in store.machine.gpus
                  if f"{int(g.bus_id.split(':')[0], 16):04x}:{g.bus_id.lower().split(':', 1)[1]}" == bdf), None)
    if index is None:
        return _fail(f"no GPU at {bdf}")
    spec = store.machine.gpus[index]
    if not spec.cc_capable:
        return _fail(f"GPU {bdf} ({spec.name}) does not support confidential computing")
    with store.transaction() as st:
        gs = st["gpus"][index]
        ppcie_now = bool(gs.get("ppcie_pending", gs.get("ppcie", False)))
        cc_now = str(gs.get("cc_pending", gs.get("cc_mode", "off")))
        if query:
            print(f"CC mode is {gs.get('cc_mode', 'off')}")
        if cc is not None:
            if cc != "off" and ppcie_now:
                return _fail(f"GPU {bdf}: PPCIe mode is on; turn it off before setting CC mode {cc}")
            gs["cc_pending"] = cc
        if ppcie is not None:
            if ppcie == "on" and cc_now != "off" and cc is None:
                return _fail(f"GPU {bdf}: CC mode is {cc_now}; turn it off before setting PPCIe mode on")
            gs["ppcie_pending"] = ppcie == "on"
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
