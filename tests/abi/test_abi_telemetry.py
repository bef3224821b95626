"""Telemetry through the C ABI: nodeagent's adapter on the real pynvml over the stand-in reads the same
clocks, temperatures, memory, energy and GPM (per GPU, and per GPU instance through nvmlGpmMigSampleGet) as
on the simulator directly; GPM absent before Hopper, memory temperature absent on GDDR boards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from nodeagent.simulator.inject import inject_process
from nodeagent.simulator.machine import load_machine
from nodeagent.simulator.state import SimStore
from tests.abi._abi import abi_env, discover, nodeagent, plain_env

READER = """
import dataclasses, json, sys, time
from pathlib import Path
from nodeagent.nvmlsource import open_nvml
adapter = open_nvml(None, Path(sys.argv[1]))
n = adapter.device_count()
for i in range(n):
    adapter.metrics(i)
time.sleep(0.2)
print(json.dumps([dataclasses.asdict(adapter.metrics(i)) for i in range(n)]), flush=True)
print(type(adapter.nvml).__name__, flush=True)
adapter.close()
"""


def _read(state: Path, abi: bool) -> tuple[list[dict[str, Any]], str]:
    env = abi_env(state) if abi else plain_env()
    r = subprocess.run([sys.executable, "-c", READER, str(state)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    readings, kind = r.stdout.strip().splitlines()
    return json.loads(readings), kind


def _steady(m: dict[str, Any]) -> dict[str, Any]:
    """A reading without what moves with time (energy, and the load wave of a busy GPU)."""
    out = {k: v for k, v in m.items() if k != "energy_mj"}
    if m["utilisation_pct"]:
        for k in ("utilisation_pct", "temperature_c", "power_w", "sm_clock_mhz", "memory_temperature_c", "gpm"):
            out.pop(k)
    return out


def test_telemetry_is_the_same_on_the_real_pynvml_over_the_stand_in(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    discover(state, "dgx-h100", abi=False)
    nodeagent("sim", "mig", "--sim-state", str(state), "--gpu", "3", "3g.40gb", "1g.10gb", env=plain_env())
    inject_process(SimStore(load_machine("dgx-h100"), state), 1, 777, "train", 2048)
    abi, abi_kind = _read(state, abi=True)
    sim, sim_kind = _read(state, abi=False)
    assert abi_kind == "module" and sim_kind == "SimulatedNvml"
    assert [_steady(m) for m in abi] == [_steady(m) for m in sim]
    idle, busy, mig = abi[0], abi[1], abi[3]
    assert (idle["sm_clock_mhz"], idle["mem_clock_mhz"], idle["memory_temperature_c"]) == (345, 2619, 36)
    assert idle["gpm"]["graphics_util"] == 0.0 and idle["mig"] == []
    assert 1800 <= busy["sm_clock_mhz"] <= 1980 and busy["memory_used_mib"] == 2053
    assert 40.0 <= busy["gpm"]["graphics_util"] <= 95.0 and busy["gpm"]["pcie_rx_mibs"] > 0
    assert busy["energy_mj"] > idle["energy_mj"]
    # MIG mode: no whole-GPU utilisation or GPM; one reading per GPU instance, GPM through the parent
    assert mig["utilisation_pct"] is None and mig["gpm"] == {}
    assert [(g["memory_free_mib"], sorted(g["gpm"])) for g in mig["mig"]] == [
        (40576, sorted(idle["gpm"])), (9984, sorted(idle["gpm"]))]
    for a, s in zip(abi, sim, strict=True):  # both count the idle draw over the host's uptime
        assert abs(a["energy_mj"] - s["energy_mj"]) < 72 * 1000 * 30


def test_gpm_and_memory_temperature_follow_the_boards(tmp_path: Path) -> None:
    for machine, gpm, memory_temp in (("dgx-a100-80gb", False, True), ("l4x2", False, False),
                                      ("dgx-b200", True, True)):
        state = tmp_path / machine / "state.json"
        state.parent.mkdir()
        discover(state, machine, abi=False)
        readings, kind = _read(state, abi=True)
        assert kind == "module"
        assert all(bool(m["gpm"]) == gpm for m in readings), machine
        assert all((m["memory_temperature_c"] is not None) == memory_temp for m in readings), machine
        assert all(m["sm_clock_mhz"] and m["mem_clock_mhz"] and m["energy_mj"] for m in readings), machine
