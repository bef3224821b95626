"""dcgm-exporter-style metrics: what one sample and one scrape cost on a big node.

Run: .venv/bin/python tests/bench/bench_metrics.py [--rounds 20] [--abi]
(--abi: the adapter on the real pynvml over the stand-in libnvidia-ml.so.1, as on a GPU node; needs
NODEAGENT_NVML_LIBRARY from `source tests/testbin/setup.sh`.)
Machine: dgx-h100 with 7x 1g.10gb on each of its 8 GPUs (56 MIG devices, GPM per GPU instance) and a process
in every GPU instance. Measures, on the Python-level simulator:
  * one sample: ``NvmlAdapter.metrics`` for the 8 GPUs (one reading of each GPU and its GPU instances, GPM
    included) and ``Metrics.update_gpus`` with it; the agent takes it on its ``[metrics] interval`` schedule,
    never per scrape;
  * one scrape: the registry rendered (``generate_latest``) and a real HTTP GET of /metrics;
  * the series and bytes of one scrape.
Prints figures and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prometheus_client import generate_latest

from nodeagent.metrics import Metrics
from nodeagent.nvmlsource import open_nvml
from nodeagent.simulator.inject import inject_process, write_mig_layout
from nodeagent.simulator.state import SimStore


def ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values) * 1000, 2), "max_ms": round(max(values) * 1000, 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--abi", action="store_true")
    opts = ap.parse_args()
    rounds = opts.rounds
    if opts.abi:
        if not os.environ.get("NODEAGENT_NVML_LIBRARY"):
            print("--abi needs NODEAGENT_NVML_LIBRARY (source tests/testbin/setup.sh)", file=sys.stderr)
            return 2
        os.environ["NODEAGENT_SIM_ABI"] = "1"
    state = Path(tempfile.mkdtemp(prefix="bench-metrics-")) / "sim.json"
    store = SimStore.open("dgx-h100", state)
    for index in range(8):
        write_mig_layout(store, index, ["1g.10gb"] * 7)
    adapter = open_nvml("dgx-h100", state)
    inv = adapter.discover()
    for g in inv.gpus:
        for n, d in enumerate(g.mig_devices):
            inject_process(store, g.index, 10000 + g.index * 10 + n, "work", 1000, gi_id=d.gi_id)
    assert sum(len(g.mig_devices) for g in inv.gpus) == 56
    metrics = Metrics("bench-node")
    server = metrics.serve("127.0.0.1:0")
    sample_s: list[float] = []
    render_s: list[float] = []
    http_s: list[float] = []
    body = b""
    try:
        for _ in range(rounds):
            t = time.perf_counter()
            readings = {g.index: adapter.metrics(g.index) for g in inv.gpus}
            metrics.update_gpus(inv, readings)
            sample_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            generate_latest(metrics.registry)
            render_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
                body = r.read()
            http_s.append(time.perf_counter() - t)
            time.sleep(0.05)
    finally:
        server.stop()
        adapter.close()
        shutil.rmtree(state.parent, ignore_errors=True)
    lines = [ln for ln in body.decode().splitlines() if ln and not ln.startswith("#")]
    dcgm = [ln for ln in lines if ln.startswith("DCGM_")]
    gpm = [ln for ln in dcgm if ln.startswith("DCGM_FI_PROF_GR_ENGINE_ACTIVE")]
    figures = {
        "nvml": "real pynvml over the stand-in" if opts.abi else "simulator", "nvml_module": type(adapter.nvml).__name__,
        "gpus": 8, "mig_devices": 56, "rounds": rounds,
        "sample_8_gpus": ms(sample_s[1:] or sample_s),  # the first sample has no GPM pair yet
        "scrape_render": ms(render_s), "scrape_http": ms(http_s),
        "series": len(lines), "dcgm_series": len(dcgm), "gr_engine_active_series": len(gpm), "bytes": len(body),
    }
    print("dcgm-exporter metrics, dgx-h100 with 56 MIG devices")
    for k, v in figures.items():
        print(f"{k:28s} {v}")
    print(json.dumps({"bench": "metrics", **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
