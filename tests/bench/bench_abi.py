"""ABI-mode figures: what the C ABI path (real pynvml -> stand-in libnvidia-ml.so.1 -> simulator) costs
over the Python-level simulator, and how long NVIDIA's Go tools take on the same machine.

Run (after `source tests/testbin/setup.sh`, which exports NODEAGENT_NVML_LIBRARY, NODEAGENT_NVML_VIEW
and NODEAGENT_NVIDIA_CTK): .venv/bin/python tests/bench/bench_abi.py
Measures, on dgx-h100 with 7x 1g.10gb on each of its 8 GPUs (56 MIG devices):
  * per NVML call (nvmlDeviceGetMemoryInfo, nvmlDeviceGetUUID) on both paths and the difference;
  * a full discovery (NvmlAdapter.discover) on both paths;
  * a cold nvml-view run (Go process start, embedded interpreter start, go-nvlib enumeration).
The ABI half runs in a child process: pynvml keeps the library it bound. Prints figures and one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CHILD = r"""
import json, statistics, sys, time
from pathlib import Path
from nodeagent.nvmlsource import open_nvml

def best(fn, n):
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n)
    return min(runs)

adapter = open_nvml(None, Path(sys.argv[1]))
nvml = adapter.nvml
h = nvml.nvmlDeviceGetHandleByIndex(3)
out = {"path": "abi" if type(nvml).__name__ == "module" else "python"}
adapter.discover()
times = []
for _ in range(7):
    t = time.perf_counter()
    inv = adapter.discover()
    times.append(time.perf_counter() - t)
out["discover_ms"] = statistics.median(times) * 1000
out["discover_min_ms"] = min(times) * 1000
out["mig_devices"] = sum(len(g.mig_devices) for g in inv.gpus)
out["memory_info_us"] = best(lambda: nvml.nvmlDeviceGetMemoryInfo(h), 300) * 1e6
out["uuid_us"] = best(lambda: nvml.nvmlDeviceGetUUID(h), 300) * 1e6
print(json.dumps(out))
"""


def _need(var: str) -> str:
    value = os.environ.get(var, "")
    if not value:
        sys.exit(f"bench_abi: {var} is not set; run `source tests/testbin/setup.sh` first")
    return value


def abi_environment() -> dict[str, str]:
    """What puts a nodeagent process (and every child it starts) on the real pynvml over the stand-in:
    the benchmarks' ``--abi`` switch sets these in their own environment."""
    return {"NODEAGENT_SIM_ABI": "1", "NODEAGENT_NVML_LIBRARY": _need("NODEAGENT_NVML_LIBRARY")}


def abi_figures(with_go: bool = True) -> dict[str, Any]:
    """ABI overhead per NVML call and discovery of dgx-h100 with 56 MIG devices on both paths (and a cold
    nvml-view run when ``with_go``)."""
    lib = _need("NODEAGENT_NVML_LIBRARY")
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state.json"
        base = {k: v for k, v in os.environ.items() if k != "NODEAGENT_SIM_ABI"}
        run = [sys.executable, "-m", "nodeagent", "sim", "mig", "--simulate", "dgx-h100", "--sim-state", str(state)]
        subprocess.run([*run, "--gpu", "all", *["1g.10gb"] * 7], env=base, check=True, capture_output=True)
        time.sleep(1.2)  # a state file changed within the last second is checked on every call
        results = {}
        for path, extra in (("python", {}), ("abi", {"NODEAGENT_SIM_ABI": "1", "NODEAGENT_NVML_LIBRARY": lib})):
            proc = subprocess.run([sys.executable, "-c", CHILD, str(state)], env={**base, **extra},
                                  capture_output=True, text=True, check=True)  # fmt: skip
            results[path] = json.loads(proc.stdout)
            assert results[path]["path"] == path, results[path]
        views = []
        if with_go:
            view = _need("NODEAGENT_NVML_VIEW")
            env = {**base, "LD_LIBRARY_PATH": str(Path(lib).parent), "NODEAGENT_SIM_STATE": str(state)}
            for _ in range(3):
                t = time.perf_counter()
                subprocess.run([view], env=env, check=True, capture_output=True)
                views.append(time.perf_counter() - t)
    py, abi = results["python"], results["abi"]
    figures: dict[str, Any] = {
        "mig_devices": abi["mig_devices"],
        "call_memory_info_python_us": round(py["memory_info_us"], 1),
        "call_memory_info_abi_us": round(abi["memory_info_us"], 1),
        "call_uuid_python_us": round(py["uuid_us"], 1),
        "call_uuid_abi_us": round(abi["uuid_us"], 1),
        "abi_overhead_per_call_us": round(
            statistics.mean([abi["memory_info_us"] - py["memory_info_us"], abi["uuid_us"] - py["uuid_us"]]), 1
        ),
        "discover_8xh100_56mig_python_ms": round(py["discover_ms"], 1),
        "discover_8xh100_56mig_abi_ms": round(abi["discover_ms"], 1),
        "discover_8xh100_56mig_abi_min_ms": round(abi["discover_min_ms"], 1),
    }
    if views:
        figures["nvml_view_cold_run_ms"] = round(min(views) * 1000)
    return figures


def print_abi_figures(figures: dict[str, Any]) -> None:
    print("ABI mode (real pynvml -> stand-in libnvidia-ml.so.1), dgx-h100 with 56 MIG devices; target: discovery < 50 ms")
    for k, v in figures.items():
        print(f"{k:45s} {v}")


def main() -> int:
    figures = abi_figures()
    print_abi_figures(figures)
    print(json.dumps({"bench": "abi", **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
