"""The simulated machine the stand-in library serves in this process: chosen by ``configure()`` or the
environment, opened at the first nvmlInit."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from nodeagent.errors import InputError
from nodeagent.simulator.abi.cmem import DRIVER_NOT_LOADED, SUCCESS, UNINITIALIZED, _Error
from nodeagent.simulator.nvml import SimulatedNvml
from nodeagent.simulator.open import open_sim


# --- the simulator of this process ------------------------------------------------------------------
class _Machine:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sim: SimulatedNvml | None = None
        self.key: tuple[str | None, str | None] | None = None
        self.configured: tuple[str | None, str | None] | None = None
        self.inits = 0


_M = _Machine()

# The state file when the stand-in plays the driver of a host: nodeagent's own commands read
# NODEAGENT_SIM_STATE as --sim-state (the sandboxed simulator, never on "/"), so a nodeagent that runs as on
# a GPU node (the real pynvml, no --simulate) gets its simulated machine's state through this name instead.
DRIVER_STATE_ENV = "NODEAGENT_NVML_STATE"


def configure(machine: str | None, state: Path | None) -> None:
    """Serve ``machine`` / ``state`` from the next nvmlInit on (instead of the environment)."""
    with _M.lock:
        _M.configured = (machine, None if state is None else str(state))


def _wanted() -> tuple[str | None, str | None]:
    if _M.configured is not None:
        return _M.configured
    state = os.environ.get("NODEAGENT_SIM_STATE") or os.environ.get(DRIVER_STATE_ENV) or None
    return os.environ.get("NODEAGENT_SIM_MACHINE") or None, state


def _sim() -> SimulatedNvml:
    sim = _M.sim
    if sim is None or _M.inits <= 0:
        raise _Error(UNINITIALIZED)
    return sim


def _init() -> int:
    with _M.lock:
        key = _wanted()
        if _M.sim is None or (_M.inits == 0 and key != _M.key):
            machine, state = key
            if machine is None and state is None:
                print(
                    "libnvidia-ml (nodeagent stand-in): no simulated machine: set NODEAGENT_SIM_MACHINE "
                    "and/or NODEAGENT_SIM_STATE (NODEAGENT_NVML_STATE)",
                    file=sys.stderr,
                )
                return DRIVER_NOT_LOADED
            try:
                _M.sim = open_sim(machine, None if state is None else Path(state))
            except InputError as e:
                print(f"libnvidia-ml (nodeagent stand-in): {e}", file=sys.stderr)
                return DRIVER_NOT_LOADED
            _M.key = key
        assert _M.sim is not None
        _M.sim.nvmlInit()
        _M.inits += 1
    _note_init(key)
    return SUCCESS


def _note_init(key: tuple[str | None, str | None]) -> None:
    """With ``NODEAGENT_NVML_INIT_LOG`` set, append "pid machine state" for each nvmlInit (tests use it
    to prove that a process really went through the C library)."""
    path = os.environ.get("NODEAGENT_NVML_INIT_LOG")
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {key[0] or '-'} {key[1] or '-'}\n")
    except OSError as e:
        print(f"libnvidia-ml (nodeagent stand-in): cannot append to {path}: {e}", file=sys.stderr)
