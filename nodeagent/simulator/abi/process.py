"""The simulated machine the stand-in library serves in this process: chosen by ``configure()``, the
environment, or the file ``nodeagent-sim.conf`` beside the library (``DRIVER_CONF``: a host's driver seen
from a container that inherits none of the host's environment); opened at the first nvmlInit."""

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


# The stand-in installed as a host's driver library: ``machine = NAME`` and ``state = PATH`` lines in this file
# of the directory the library was loaded from (symlinks resolved); a relative PATH is taken from that
# directory, so a container that mounts the host's library directory and state directory under one prefix
# (a DaemonSet's /host) finds the same state file as the host does.
DRIVER_CONF = "nodeagent-sim.conf"
_LIBRARY_NAME = "libnvidia-ml.so.1"


def _library_dir() -> Path | None:
    """The directory of the stand-in as this process mapped it (/proc/self/maps names the resolved file)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[5:]
                if path and path[0].rsplit("/", 1)[-1] == _LIBRARY_NAME:
                    return Path(path[0]).parent
    except OSError:
        return None
    return None


def _driver_conf() -> tuple[str | None, str | None]:
    """(machine, state) from ``DRIVER_CONF`` beside the library; (None, None) without one; InputError for a
    line that is not ``machine = NAME`` or ``state = PATH``."""
    libdir = _library_dir()
    if libdir is None:
        return None, None
    conf = libdir / DRIVER_CONF
    try:
        text = conf.read_text(encoding="utf-8")
    except OSError:
        return None, None
    values: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep or key.strip() not in ("machine", "state"):
            raise InputError(f"{conf}: cannot read the line {raw[:60]!r} (expected 'machine = NAME' or 'state = PATH')",
                             subject=str(conf))
        values[key.strip()] = value.strip()
    state = values.get("state") or None
    if state is not None:
        state = os.path.normpath(libdir / state)
    return values.get("machine") or None, state


def configure(machine: str | None, state: Path | None) -> None:
    """Serve ``machine`` / ``state`` from the next nvmlInit on (instead of the environment)."""
    with _M.lock:
        _M.configured = (machine, None if state is None else str(state))


def _wanted() -> tuple[str | None, str | None]:
    if _M.configured is not None:
        return _M.configured
    state = os.environ.get("NODEAGENT_SIM_STATE") or os.environ.get(DRIVER_STATE_ENV) or None
    machine = os.environ.get("NODEAGENT_SIM_MACHINE") or None
    if machine is None and state is None:
        return _driver_conf()
    return machine, state


def _sim() -> SimulatedNvml:
    sim = _M.sim
    if sim is None or _M.inits <= 0:
        raise _Error(UNINITIALIZED)
    return sim


def _init() -> int:
    with _M.lock:
        try:
            key = _wanted()
        except InputError as e:
            print(f"libnvidia-ml (nodeagent stand-in): {e}", file=sys.stderr)
            return DRIVER_NOT_LOADED
        if _M.sim is None or (_M.inits == 0 and key != _M.key):
            machine, state = key
            if machine is None and state is None:
                print(
                    "libnvidia-ml (nodeagent stand-in): no simulated machine: set NODEAGENT_SIM_MACHINE "
                    f"and/or NODEAGENT_SIM_STATE (NODEAGENT_NVML_STATE), or write {DRIVER_CONF} beside the library",
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
