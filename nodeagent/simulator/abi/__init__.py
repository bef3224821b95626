"""ABI mode: the real ``pynvml`` over a stand-in ``libnvidia-ml.so.1`` that serves the simulator.

``open_pynvml(machine, state)`` loads the stand-in library (``NODEAGENT_NVML_LIBRARY``, built by
``python -m nodeagent.simulator.abi.build``) into this process under its soname, so pynvml's own
``CDLL("libnvidia-ml.so.1")`` binds to it, and returns the unmodified ``pynvml`` module. Every NVML call
nodeagent makes then goes through ctypes, the C ABI and back into the simulator (``bridge.py``), exactly
the path a GPU node runs. The machine and state are also exported as ``NODEAGENT_SIM_MACHINE`` /
``NODEAGENT_SIM_STATE`` so child processes (NVIDIA's tools, the ``nvidia-smi`` stand-in used for GPU
resets) see the same machine; without a state file one is made in a private temporary directory.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

from nodeagent.errors import InputError

LIBRARY_ENV = "NODEAGENT_NVML_LIBRARY"
MACHINE_ENV = "NODEAGENT_SIM_MACHINE"
STATE_ENV = "NODEAGENT_SIM_STATE"
MODE_ENV = "NODEAGENT_SIM_ABI"  # "1": --simulate/--sim-state use the real pynvml over the stand-in

_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None


def abi_mode_requested() -> bool:
    """True when ``NODEAGENT_SIM_ABI`` asks simulated runs to go through the C ABI."""
    return os.environ.get(MODE_ENV, "") not in ("", "0")


def library_path() -> Path:
    """The stand-in library named by ``NODEAGENT_NVML_LIBRARY`` (InputError when unset or missing)."""
    value = os.environ.get(LIBRARY_ENV, "")
    if not value:
        raise InputError(
            f"ABI mode needs the stand-in NVML library: set {LIBRARY_ENV} to the libnvidia-ml.so.1 built by "
            "`python -m nodeagent.simulator.abi.build` (tests/testbin/setup.sh builds and exports it)",
            subject=LIBRARY_ENV,
        )
    path = Path(value)
    if not path.is_file():
        raise InputError(f"{LIBRARY_ENV}={value}: no such file", subject=value)
    return path


def _smi_dir() -> Path:
    """A directory holding an ``nvidia-smi`` stand-in (GPU reset) that runs on this interpreter."""
    d = Path(tempfile.mkdtemp(prefix="nodeagent-nvml-abi-"))
    atexit.register(shutil.rmtree, d, True)
    script = d / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nexec '{sys.executable}' -m nodeagent.simulator.abi.smi \"$@\"\n")
    script.chmod(0o755)
    return d


def _private_state() -> Path:
    d = Path(tempfile.mkdtemp(prefix="nodeagent-sim-state-"))
    atexit.register(shutil.rmtree, d, True)
    return d / "state.json"


def open_pynvml(machine: str | None, state: Path | None) -> ModuleType:
    """The real pynvml, bound to the stand-in library serving ``machine`` / ``state``."""
    global _loaded
    path = library_path()
    if state is None:
        state = _private_state()
    from nodeagent.simulator.state import SimStore

    store = SimStore.open(machine, state)  # a bad machine name or state file fails here, in one line
    if not state.exists():
        with store.transaction():
            pass  # the file exists from now on, naming its machine, for processes that only get the path
    with _lock:
        if _loaded is None:
            try:
                _loaded = ctypes.CDLL(str(path.absolute()), mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                raise InputError(
                    f"cannot load the stand-in NVML library {path}: {e}", subject=str(path)
                ) from e
            os.environ["PATH"] = f"{_smi_dir()}{os.pathsep}{os.environ.get('PATH', '')}"
        if machine is not None:
            os.environ[MACHINE_ENV] = machine
        else:
            os.environ.pop(MACHINE_ENV, None)
        os.environ[STATE_ENV] = str(state.absolute())
    from nodeagent.simulator.abi import process

    process.configure(machine, state.absolute())
    import pynvml

    module: ModuleType = pynvml
    return module
