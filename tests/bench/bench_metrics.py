"""dcgm-exporter-style metrics: what one sample and one scrape cost on a big node.

Run: .venv/bin/python tests/bench/bench_metrics.py [--rounds 20] [--abi]
     .venv/bin/python tests/bench/bench_metrics.py --floods [--rounds 5]
(--abi: the adapter on the real pynvml over the stand-in libnvidia-ml.so.1, as on a GPU node; needs
NODEAGENT_NVML_LIBRARY from `source tests/testbin/setup.sh`.)

--floods: the real agent (``nodeagent run --simulate dgx-h100 --no-kube``) scraped 20 times in each of
``--rounds`` rounds of each load of tests/_metrics_load.py (a trickle of 100 half-sent requests a second
from the scraper's address, 3,000 idle connections from 100 addresses begun 1,500 a second and scraped from the first on, 40 clients sending one header line a
second) and without one: scrapes answered, latency p50/p99, the agent's threads and open files at the
end of each load's rounds; prints figures and one JSON line.
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
import contextlib
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prometheus_client import generate_latest

from nodeagent.metrics import Metrics
from nodeagent.nvmlsource import open_nvml
from nodeagent.simulator.inject import inject_process, write_mig_layout
from nodeagent.simulator.state import SimStore


def ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values) * 1000, 2), "max_ms": round(max(values) * 1000, 2)}


def floods(rounds: int) -> int:
    from tests._metrics_load import IdleFlood, Scrapes, SlowHeaders, Trickle, raise_fd_limit, scrape_many
    from tests.e2e._agent import eventually, node_root, running_agent

    metric = "DCGM_FI_DEV_GPU_TEMP"
    raise_fd_limit(3000 + 1024)
    work = Path(tempfile.mkdtemp(prefix="bench-metrics-floods-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cfg = work / "config.toml"
    cfg.write_text("resync_interval = 300.0\n[runtime]\nenabled = false\n[metrics]\ninterval = 60.0\n")
    args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", str(work / "sim.json"), "--no-kube"]

    def quiet(_: int) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    loads: dict[str, tuple[Callable[[int], contextlib.AbstractContextManager[Any]], float]] = {
        "quiet": (quiet, 0.0),
        "trickle_100_per_s": (lambda p: Trickle(p, rate=100), 0.5),
        "idle_3000": (lambda p: IdleFlood(p, count=3000, sources=100, rate=1500), 0.0),
        "slow_headers_40": (lambda p: SlowHeaders(p, clients=40), 1.0),
    }
    figures: dict[str, Any] = {"machine": "dgx-h100", "rounds": rounds, "scrapes_per_round": 20}
    try:
        with node_root() as root, running_agent(work, root, args, metrics=f"127.0.0.1:{port}") as agent:
            eventually(lambda: scrape_many(port, 1, metric, 0).answered, 30, f"{metric} scraped")
            for name, (make, warm) in loads.items():
                total = Scrapes()
                for _ in range(rounds):
                    with make(port):
                        time.sleep(warm)
                        total.results += scrape_many(port, 20, metric, interval=0.05).results
                figures[name] = {**total.summary(), "agent_threads": agent.threads(), "agent_fds": agent.fds()}
            agent.stop(timeout=30)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("metrics endpoint of the real agent (dgx-h100) under connection floods")
    for k, v in figures.items():
        print(f"{k:20s} {v}")
    print(json.dumps({"bench": "metrics_floods", **figures}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--abi", action="store_true")
    ap.add_argument("--floods", action="store_true")
    opts = ap.parse_args()
    if opts.floods:
        return floods(opts.rounds or 5)
    rounds = opts.rounds or 20
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
