"""Confidential computing through the C ABI: the real pynvml's CC calls on the stand-in libnvidia-ml.so.1
answer as the Python simulator does (structs, the settings' version check, NOT_SUPPORTED before Hopper),
before and after the ccadmin stand-in sets CC on and a GPU reset applies it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.abi._abi import abi_env, run

# A child on the real pynvml: every CC answer as JSON (NVML error codes as {"error": code}).
READER = """
import ctypes, json
import pynvml
pynvml.nvmlInit()
def ask(f):
    try:
        return f()
    except pynvml.NVMLError as e:
        return {"error": e.value}
out = {}
s = ask(pynvml.nvmlSystemGetConfComputeState)
out["state"] = s if isinstance(s, dict) else [s.environment, s.ccFeature, s.devToolsMode]
c = ask(pynvml.nvmlSystemGetConfComputeCapabilities)
out["caps"] = c if isinstance(c, dict) else [c.cpuCaps, c.gpusCaps]
settings = pynvml.c_nvmlSystemConfComputeSettings_v1_t()
code = pynvml.nvmlSystemGetConfComputeSettings(ctypes.byref(settings))
out["settings"] = [code, settings.multiGpuMode, settings.ccFeature]
bad = pynvml.c_nvmlSystemConfComputeSettings_v1_t()
bad.version = 7
out["bad_version"] = pynvml.nvmlSystemGetConfComputeSettings(ctypes.byref(bad))
m = ask(lambda: pynvml.nvmlDeviceGetConfComputeMemSizeInfo(pynvml.nvmlDeviceGetHandleByIndex(0)))
out["mem"] = m if isinstance(m, dict) else [m.protectedMemSizeKib, m.unprotectedMemSizeKib]
out["ready"] = ask(pynvml.nvmlSystemGetConfComputeGpusReadyState)
pynvml.nvmlShutdown()
print(json.dumps(out))
"""


def _read(state: Path, machine: str) -> dict[str, object]:
    doc: dict[str, object] = json.loads(run([sys.executable, "-c", READER], abi_env(state, machine)).stdout)
    return doc


def _python_sim(state: Path, machine: str) -> dict[str, object]:
    env = {"NODEAGENT_SIM_STATE": str(state), "NODEAGENT_SIM_MACHINE": machine}
    code = ("import ctypes, json, pynvml\n"
            "from nodeagent.simulator.open import open_sim\n"
            f"p = open_sim({machine!r}, __import__('pathlib').Path({str(state)!r})); p.nvmlInit()\n"
            + READER.split("pynvml.nvmlInit()\n", 1)[1].replace("pynvml.nvmlSystem", "p.nvmlSystem")
            .replace("pynvml.nvmlDevice", "p.nvmlDevice").replace("pynvml.nvmlShutdown()", "p.nvmlShutdown()"))
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PATH": "/usr/bin:/bin"}, capture_output=True,
                         text=True, check=True, timeout=120)
    doc: dict[str, object] = json.loads(out.stdout)
    return doc


def test_cc_calls_through_the_c_abi(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    off = _read(state, "h100-nvl")
    assert off == _python_sim(state, "h100-nvl")
    assert off["state"] == [2, 0, 0] and off["caps"] == [3, 1]  # production (SEV-SNP), capable, CC off
    assert off["settings"] == [0, 0, 0] and off["bad_version"] == 25  # ARGUMENT_VERSION_MISMATCH
    mem = off["mem"]
    assert isinstance(mem, list) and mem[0] == 0 and mem[1] > 0
    env = {"NODEAGENT_SIM_STATE": str(state), "PATH": "/usr/bin:/bin"}
    from nodeagent.simulator.machine import load_machine

    for g in load_machine("h100-nvl").gpus:
        bdf = f"{int(g.bus_id.split(':')[0], 16):04x}:{g.bus_id.lower().split(':', 1)[1]}"
        subprocess.run([sys.executable, "-m", "nodeagent.simulator.ccadmin", "--set-cc-mode=on", f"--gpu-bdf={bdf}"],
                       env=env, check=True, timeout=60)
    assert _read(state, "h100-nvl")["state"] == [2, 0, 0]  # pending until the reset
    from nodeagent.simulator.open import open_sim

    sim = open_sim("h100-nvl", state)
    sim.nvmlInit()
    for i in range(sim.nvmlDeviceGetCount()):
        sim.simResetGpu(sim.nvmlDeviceGetHandleByIndex(i))
    on = _read(state, "h100-nvl")
    assert on == _python_sim(state, "h100-nvl")
    assert on["state"] == [2, 1, 0] and on["settings"] == [0, 0, 1]
    mem = on["mem"]
    assert isinstance(mem, list) and mem[0] > 0 and mem[1] == 0
    assert on["ready"] == 0


def test_cc_not_supported_before_hopper(tmp_path: Path) -> None:
    doc = _read(tmp_path / "sim.json", "l40s-x4")
    assert doc["state"] == {"error": 3} and doc["caps"] == {"error": 3} and doc["mem"] == {"error": 3}
