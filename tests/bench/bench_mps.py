"""MPS control daemon figures on the simulator's stand-in: what the agent's supervision costs.

Run: .venv/bin/python tests/bench/bench_mps.py
Measures, ROUNDS times each, with one daemon over the two GPUs of a10-x2 (a shared state file):
  * start → ready: spawn, first answer on the control channel, the defaults sent (what delays advertising);
  * kill → ready again: SIGKILL of the daemon until the supervisor's restart answers (replicas Unhealthy);
  * stop: quit sent until the process is gone.
The stand-in is a Python process, so these bound the agent's side; the real binary starts faster.
Prints figures and one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nodeagent.gpu.mps import MpsDaemonSpec
from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import mps_manager
from nodeagent.simulator.state import SimStore

ROUNDS = 5


async def main() -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="mpsb", dir="/tmp") as d:
        root = Path(d)
        state = root / "sim.json"
        store = SimStore.open("a10-x2", state)
        uuids = tuple(g.uuid for g in store.machine.gpus)
        paths = HostPaths(root / "root")
        spec = MpsDaemonSpec("nvidia.com/gpu", paths("/run/nodeagent/mps/g/pipe"), paths("/run/nodeagent/mps/g/log"),
                             uuids, 25, ((0, "5757M"), (1, "5757M")))
        start, restart, stop = [], [], []
        for _ in range(ROUNDS):
            m = mps_manager(paths, "/", "a10-x2", state)
            t0 = time.perf_counter()
            await m.apply({spec.name: spec})
            start.append(time.perf_counter() - t0)
            assert m.ready(spec.name)
            pid = m.states()[0].pid
            assert pid is not None
            t0 = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            while not (m.ready(spec.name) and m.states()[0].pid not in (None, pid)):
                await asyncio.sleep(0.005)
            restart.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await m.stop()
            stop.append(time.perf_counter() - t0)
    out = {"start_to_ready_ms_p50": statistics.median(start) * 1000,
           "kill_to_ready_ms_p50": statistics.median(restart) * 1000,
           "stop_ms_p50": statistics.median(stop) * 1000}
    for k, v in out.items():
        print(f"{k:28s} {v:8.1f}")
    return out


if __name__ == "__main__":
    figures = asyncio.run(main())
    print(json.dumps({"bench": "mps", "rounds": ROUNDS, **{k: round(v, 1) for k, v in figures.items()}}))
