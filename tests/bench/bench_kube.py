"""Benchmark: how kind nodeagent's publishing is to the API server (real kube-apiserver + etcd).

1. One agent in steady state: after the first publish, the daemon's resync keeps calling publish (here
   every RESYNC seconds, much more often than the default 60 s) while the Node watch is open. Requests
   are counted over WINDOW seconds and extrapolated to 10 minutes; the target is 0 writes.
2. 100 agents (in-process simulated nodes, each with its own client, watch and GPU objects) against the
   one apiserver: the start-up burst (every agent's first publish at once) and the steady load.

Prints figures and one JSON line. No timing asserts. Usage:
    .venv/bin/python tests/bench/bench_kube.py [--agents 100] [--window 20] [--resync 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil

from nodeagent.gpu import open_nvml
from nodeagent.gpu.inventory import Inventory
from nodeagent.kube.client import KubeClient, connect
from nodeagent.kube.gpuobjects import install_crd
from nodeagent.kube.labels import NetFacts
from nodeagent.kube.publisher import NodePublisher, PublisherConfig
from tests.peers.apiserver import KubeApiServer, start_apiserver

SERVED = ("nvidia.com/gpu",)


def sim_inventory(machine: str) -> Inventory:
    nvml = open_nvml(machine)
    try:
        return nvml.discover()
    finally:
        nvml.close()


def create_node(kube: KubeClient, name: str) -> None:
    kube.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    kube.request(
        "PATCH", f"/api/v1/nodes/{name}/status", content_type="application/json-patch+json",
        body=[{"op": "add", "path": "/status/capacity", "value": {"cpu": "64", "nvidia.com/gpu": "8"}}],
    )


def apiserver_proc(server: KubeApiServer) -> psutil.Process | None:
    for p in server._procs:
        try:
            proc = psutil.Process(p.pid)
            if Path(proc.cmdline()[0]).name.startswith("kube-apiserver"):
                return proc
        except psutil.Error:
            continue
    return None


def one_agent(server: KubeApiServer, inv: Inventory, window: float, resync: float) -> dict[str, Any]:
    kube = KubeClient(connect(server.kubeconfig))
    create_node(kube, "bench-solo")
    pub = NodePublisher(kube, "bench-solo", PublisherConfig(), net=NetFacts(100000, 2))
    first = pub.publish(inv, SERVED)
    pub.start_watch()
    time.sleep(0.5)  # the watch's initial list + open
    start = kube.stats.snapshot()
    t0 = time.monotonic()
    passes = 0
    while time.monotonic() - t0 < window:
        pub.publish(inv, SERVED)
        passes += 1
        time.sleep(resync)
    elapsed = time.monotonic() - t0
    end = kube.stats.snapshot()
    pub.close()
    kube.close()
    total = end["total"] - start["total"]
    writes = end["writes"] - start["writes"]
    scale = 600.0 / elapsed
    return {
        "first_publish_writes": first.writes,
        "steady_window_s": round(elapsed, 1),
        "steady_publish_passes": passes,
        "steady_requests": total,
        "steady_writes": writes,
        "requests_per_10min": round(total * scale, 1),
        "writes_per_10min": round(writes * scale, 1),
        # the one open watch is renewed by the server every watch_timeout_s (300 s): 2 GETs in 10 min
        "watch_renewals_per_10min": 2,
    }


def many_agents(server: KubeApiServer, inv: Inventory, n: int, window: float, resync: float) -> dict[str, Any]:
    admin = KubeClient(connect(server.kubeconfig))
    names = [f"bench-{i:03d}" for i in range(n)]
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda nm: create_node(admin, nm), names))
    clients = [KubeClient(connect(server.kubeconfig)) for _ in names]
    pubs = [NodePublisher(c, nm, PublisherConfig(), net=NetFacts(100000, 2)) for c, nm in zip(clients, names, strict=True)]
    proc = apiserver_proc(server)
    cpu0 = proc.cpu_times() if proc else None

    latencies: list[float] = []
    lock = threading.Lock()

    def first(p: NodePublisher) -> int:
        t = time.monotonic()
        r = p.publish(inv, SERVED)
        with lock:
            latencies.append(time.monotonic() - t)
        return r.writes

    t0 = time.monotonic()
    with ThreadPoolExecutor(n) as ex:
        writes = list(ex.map(first, pubs))
    burst_s = time.monotonic() - t0
    burst_requests = sum(c.stats.total for c in clients)
    cpu1 = proc.cpu_times() if proc else None

    for p in pubs:
        p.start_watch()
    time.sleep(2.0)
    base = [c.stats.snapshot() for c in clients]
    t1 = time.monotonic()
    steady_lat: list[float] = []

    def loop(p: NodePublisher) -> None:
        while time.monotonic() - t1 < window:
            t = time.monotonic()
            p.publish(inv, SERVED)
            with lock:
                steady_lat.append(time.monotonic() - t)
            time.sleep(resync)

    cpu2 = proc.cpu_times() if proc else None
    with ThreadPoolExecutor(n) as ex:
        list(ex.map(loop, pubs))
    elapsed = time.monotonic() - t1
    cpu3 = proc.cpu_times() if proc else None
    after = [c.stats.snapshot() for c in clients]
    steady_req = sum(a["total"] - b["total"] for a, b in zip(after, base, strict=True))
    steady_writes = sum(a["writes"] - b["writes"] for a, b in zip(after, base, strict=True))
    rss = proc.memory_info().rss if proc else 0
    for p in pubs:
        p.close()
    for c in clients:
        c.close()
    admin.close()

    def cpu(a: Any, b: Any) -> float:
        return round((b.user + b.system) - (a.user + a.system), 2) if a and b else -1.0

    latencies.sort()
    return {
        "agents": n,
        "burst_wall_s": round(burst_s, 2),
        "burst_requests": burst_requests,
        "burst_writes": sum(writes),
        "burst_writes_per_agent": round(sum(writes) / n, 1),
        "burst_publish_p50_s": round(statistics.median(latencies), 3),
        "burst_publish_p99_s": round(latencies[int(0.99 * (len(latencies) - 1))], 3),
        "burst_apiserver_cpu_s": cpu(cpu0, cpu1),
        "steady_window_s": round(elapsed, 1),
        "steady_publish_passes": len(steady_lat),
        "steady_requests": steady_req,
        "steady_writes": steady_writes,
        "steady_publish_p50_ms": round(1000 * statistics.median(steady_lat), 3) if steady_lat else None,
        "steady_apiserver_cpu_s": cpu(cpu2, cpu3),
        "apiserver_rss_mib": round(rss / 2**20, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=100)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--resync", type=float, default=1.0)
    ap.add_argument("--machine", default="dgx-h100")
    args = ap.parse_args()
    inv = sim_inventory(args.machine)
    server = start_apiserver()
    try:
        admin = KubeClient(connect(server.kubeconfig))
        install_crd(admin)
        admin.close()
        solo = one_agent(server, inv, args.window, args.resync)
        print(f"one agent: first publish {solo['first_publish_writes']} writes; steady "
              f"{solo['steady_requests']} requests / {solo['steady_writes']} writes in {solo['steady_window_s']} s "
              f"({solo['steady_publish_passes']} publish passes) -> {solo['requests_per_10min']} requests, "
              f"{solo['writes_per_10min']} writes per 10 min (+{solo['watch_renewals_per_10min']} watch renewals)")
        fleet = many_agents(server, inv, args.agents, args.window, args.resync)
        print(f"{fleet['agents']} agents start-up burst: {fleet['burst_requests']} requests "
              f"({fleet['burst_writes_per_agent']} writes/agent) in {fleet['burst_wall_s']} s, publish p50 "
              f"{fleet['burst_publish_p50_s']} s p99 {fleet['burst_publish_p99_s']} s, apiserver CPU "
              f"{fleet['burst_apiserver_cpu_s']} s")
        print(f"{fleet['agents']} agents steady: {fleet['steady_requests']} requests / {fleet['steady_writes']} writes "
              f"over {fleet['steady_window_s']} s ({fleet['steady_publish_passes']} passes, p50 "
              f"{fleet['steady_publish_p50_ms']} ms), apiserver CPU {fleet['steady_apiserver_cpu_s']} s, "
              f"RSS {fleet['apiserver_rss_mib']} MiB")
        print(json.dumps({"bench": "kube", "machine": args.machine, "one_agent": solo, "fleet": fleet}))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
