"""Benchmark: how kind nodeagent's publishing is to the API server (real kube-apiserver + etcd).

A simulated agent here is what the daemon runs against the API for its node: the ``NodePublisher`` (labels,
unserved extended resources, one GPU object per GPU) with its status values staged into the
``ConditionWriter``, which writes them together with the four GPU Node conditions, on an 8-GPU simulated
machine (``--machine``, default dgx-h100). Each agent has its own API client, Node watch and state; the
agents share nothing but the apiserver.

1. One agent: the writes of its first publish (target: at most 10), then steady state: publish passes every
   RESYNC seconds (much more often than the default 60 s) with the Node watch open over WINDOW seconds,
   extrapolated to 10 minutes (target: 0 writes).
2. A fleet of AGENTS (default 1000) against the one apiserver: the start-up burst (every agent's first
   publish, at most CONCURRENCY at a time), its wall time, the writes the apiserver served (its own
   ``apiserver_request_total``) and per agent, apiserver CPU seconds and peak RSS (VmHWM) — then an idle
   window where every agent keeps resyncing and nothing changes (target: 0 writes).

Every agent starts as the daemon does: beside its first publish it ensures the ``nvidia`` RuntimeClass
(reads it; if missing, reads again after a random moment within 3 s, then creates it). The fleet starts on a
cluster without it: the figures show how many creates the apiserver answered (201 once; a 409 for each
agent that lost a race), and those are in the per-agent writes.

Prints figures and one JSON line. No timing asserts. Usage:
    .venv/bin/python tests/bench/bench_kube.py [--agents 1000] [--concurrency 32] [--window 20] [--resync 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil

from nodeagent.config import PublishSettings
from nodeagent.daemon.components.runtime import RUNTIME_CLASS_SPREAD_S
from nodeagent.gpu.inventory import Inventory
from nodeagent.kube.client import KubeClient, connect
from nodeagent.kube.conditions import (
    ConditionSnapshot,
    ConditionWriter,
    GpuHealthInput,
    RuntimeInput,
    StatusStage,
)
from nodeagent.kube.gpuobjects import install_crd
from nodeagent.kube.labels import NetFacts
from nodeagent.kube.publisher import NodePublisher
from nodeagent.kube.runtimeclass import desired_classes, ensure_runtime_classes
from nodeagent.nvmlsource import open_nvml
from tests._metrics import apiserver_request_counts
from tests.peers.apiserver import KubeApiServer, start_apiserver

SERVED = ("nvidia.com/gpu",)
WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE", "APPLY", "DELETECOLLECTION"}
AGENT_RESOURCES = {"nodes", "gpus", "events", "runtimeclasses"}
# the figures for the publisher before the writes were cut (100 agents, publisher only, no conditions)
BASELINE_100 = {"writes_per_agent": 18, "burst_writes": 1800, "burst_wall_s": 5.2}


def sim_inventory(machine: str) -> Inventory:
    nvml = open_nvml(machine)
    try:
        return nvml.discover()
    finally:
        nvml.close()


def create_node(kube: KubeClient, name: str, gpus: int) -> None:
    """The Node as the kubelet registers it (with the device plugin's resource in its capacity)."""
    kube.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    kube.request(
        "PATCH", f"/api/v1/nodes/{name}/status", content_type="application/json-patch+json",
        body=[{"op": "add", "path": "/status/capacity", "value": {"cpu": "64", "nvidia.com/gpu": str(gpus)}}],
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


def peak_rss_mib(proc: psutil.Process | None) -> float:
    """The process's peak resident set so far (VmHWM), MiB."""
    if proc is None:
        return -1.0
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return round(proc.memory_info().rss / 2**20, 1)


def cpu_s(proc: psutil.Process | None) -> float:
    if proc is None:
        return -1.0
    t = proc.cpu_times()
    return float(t.user + t.system)


def served_writes(server: KubeApiServer) -> float:
    """Write requests on the agents' resources the apiserver has served (its apiserver_request_total)."""
    return sum(v for lab, v in apiserver_request_counts(server)
               if lab.get("verb") in WRITE_VERBS and lab.get("resource") in AGENT_RESOURCES)


def runtimeclass_creates(server: KubeApiServer) -> dict[str, float]:
    """RuntimeClass creates the apiserver has answered, by HTTP code (201 made it, 409 found it made)."""
    out: dict[str, float] = {}
    for lab, v in apiserver_request_counts(server):
        if lab.get("verb") == "POST" and lab.get("resource") == "runtimeclasses":
            out[lab.get("code", "")] = out.get(lab.get("code", ""), 0.0) + v
    return out


class SimAgent:
    """The API side of one daemon: publisher + conditions writer sharing one status patch."""

    def __init__(self, server: KubeApiServer, name: str, inv: Inventory) -> None:
        self.name = name
        self.inv = inv
        self.kube = KubeClient(connect(server.kubeconfig))
        self.stage = StatusStage()
        self.pub = NodePublisher(self.kube, name, PublishSettings(), net=NetFacts(100000, 2),
                                 status_stage=self.stage)
        self.writer = ConditionWriter(self.pub.node, stage=self.stage)
        self.health = {g.index: True for g in inv.gpus}
        # a healthy node: health monitored, containerd wired, CDI spec current, no MIG config asked for
        self.snapshot = ConditionSnapshot(GpuHealthInput(len(inv.gpus)),
                                          runtime=RuntimeInput(containerd_wired=True, cdi_current=True))

    def start(self) -> tuple[int, int]:
        """The daemon's start: the first pass, and beside it (a task of its own in the daemon) the RuntimeClass
        ensured as the daemon does it (read; if missing, read again after a random moment, then create).
        The writes of each."""
        rc: list[int] = []

        def runtime_class() -> None:
            done = ensure_runtime_classes(self.kube, desired_classes(), spread=RUNTIME_CLASS_SPREAD_S)
            rc.append(sum(v != "unchanged" for v in done.values()))

        t = threading.Thread(target=runtime_class)
        t.start()
        writes = self.resync()
        t.join()
        return rc[0] if rc else 0, writes

    def resync(self) -> int:
        """One pass as the daemon makes it (publish, then the conditions writer); the writes it sent."""
        res = self.pub.publish(self.inv, SERVED, health=self.health)
        before = self.writer.writes
        self.writer.sync(self.snapshot)
        return res.writes + self.writer.writes - before

    def close(self) -> None:
        self.pub.close()
        self.kube.close()


def one_agent(server: KubeApiServer, inv: Inventory, window: float, resync: float) -> dict[str, Any]:
    admin = KubeClient(connect(server.kubeconfig))
    create_node(admin, "bench-solo", len(inv.gpus))
    admin.close()
    agent = SimAgent(server, "bench-solo", inv)
    rc, first = agent.start()  # a fresh cluster: this agent creates the RuntimeClass
    agent.pub.start_watch()
    time.sleep(0.5)  # the watch's initial list + open
    start = agent.kube.stats.snapshot()
    t0 = time.monotonic()
    passes = 0
    while time.monotonic() - t0 < window:
        agent.resync()
        passes += 1
        time.sleep(resync)
    elapsed = time.monotonic() - t0
    end = agent.kube.stats.snapshot()
    agent.close()
    total = end["total"] - start["total"]
    writes = end["writes"] - start["writes"]
    scale = 600.0 / elapsed
    return {
        "first_publish_writes": first,
        "runtimeclass_writes_fresh_cluster": rc,
        "steady_window_s": round(elapsed, 1),
        "steady_publish_passes": passes,
        "steady_requests": total,
        "steady_writes": writes,
        "requests_per_10min": round(total * scale, 1),
        "writes_per_10min": round(writes * scale, 1),
        # the one open watch is renewed by the server every watch_timeout_s (300 s): 2 GETs in 10 min
        "watch_renewals_per_10min": 2,
    }


def run_all(fn: Callable[[SimAgent], Any], agents: list[SimAgent], workers: int) -> list[Any]:
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(fn, agents))


def many_agents(server: KubeApiServer, inv: Inventory, n: int, concurrency: int, window: float,
                resync: float) -> dict[str, Any]:
    admin = KubeClient(connect(server.kubeconfig))
    names = [f"bench-{i:04d}" for i in range(n)]
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(lambda nm: create_node(admin, nm, len(inv.gpus)), names))
    # a fresh cluster again: the fleet's agents race to create the RuntimeClass (read first, create if missing)
    admin.request("DELETE", "/apis/node.k8s.io/v1/runtimeclasses/nvidia")
    agents = [SimAgent(server, nm, inv) for nm in names]
    proc = apiserver_proc(server)
    rss_before = round(proc.memory_info().rss / 2**20, 1) if proc else -1.0

    latencies: list[float] = []
    lock = threading.Lock()

    def first(a: SimAgent) -> int:
        t = time.monotonic()
        rc, w = a.start()
        with lock:
            latencies.append(time.monotonic() - t)
        return rc + w

    served0 = served_writes(server)
    rc0 = runtimeclass_creates(server)
    cpu0 = cpu_s(proc)
    t0 = time.monotonic()
    writes = run_all(first, agents, concurrency)
    burst_s = time.monotonic() - t0
    cpu1 = cpu_s(proc)
    served1 = served_writes(server)
    rc1 = runtimeclass_creates(server)
    burst_requests = sum(a.kube.stats.total for a in agents)

    run_all(lambda a: a.pub.start_watch(), agents, concurrency)
    time.sleep(3.0)
    base = [a.kube.stats.snapshot() for a in agents]
    served2 = served_writes(server)
    cpu2 = cpu_s(proc)
    t1 = time.monotonic()
    passes = 0
    while time.monotonic() - t1 < window:
        t = time.monotonic()
        run_all(SimAgent.resync, agents, concurrency)
        passes += 1
        time.sleep(max(0.0, resync - (time.monotonic() - t)))
    elapsed = time.monotonic() - t1
    time.sleep(1.0)
    cpu3 = cpu_s(proc)
    served3 = served_writes(server)
    after = [a.kube.stats.snapshot() for a in agents]
    steady_req = sum(x["total"] - b["total"] for x, b in zip(after, base, strict=True))
    steady_writes = sum(x["writes"] - b["writes"] for x, b in zip(after, base, strict=True))
    peak = peak_rss_mib(proc)
    run_all(SimAgent.close, agents, concurrency)
    admin.close()

    latencies.sort()
    return {
        "agents": n,
        "concurrency": concurrency,
        "gpus_per_agent": len(inv.gpus),
        "burst_wall_s": round(burst_s, 2),
        "burst_requests": burst_requests,
        "burst_writes": sum(writes),
        "burst_writes_per_agent": round(sum(writes) / n, 2),
        "burst_writes_max_agent": max(writes),
        "burst_writes_served": int(served1 - served0),
        "burst_runtimeclass_creates": {code: int(n - rc0.get(code, 0)) for code, n in sorted(rc1.items())
                                       if n != rc0.get(code, 0)},
        "burst_publish_p50_s": round(statistics.median(latencies), 3),
        "burst_publish_p99_s": round(latencies[int(0.99 * (len(latencies) - 1))], 3),
        "burst_apiserver_cpu_s": round(cpu1 - cpu0, 2),
        "steady_window_s": round(elapsed, 1),
        "steady_rounds": passes,
        "steady_publish_passes": passes * n,
        "steady_requests": steady_req,
        "steady_writes": steady_writes,
        "steady_writes_served": int(served3 - served2),
        "steady_apiserver_cpu_s": round(cpu3 - cpu2, 2),
        "apiserver_rss_before_mib": rss_before,
        "apiserver_peak_rss_mib": peak,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32, help="agents publishing at the same moment")
    ap.add_argument("--window", type=float, default=20.0, help="idle window, s")
    ap.add_argument("--resync", type=float, default=1.0, help="resync period in the idle window, s")
    ap.add_argument("--machine", default="dgx-h100")
    args = ap.parse_args()
    inv = sim_inventory(args.machine)
    server = start_apiserver()
    try:
        admin = KubeClient(connect(server.kubeconfig))
        install_crd(admin)
        admin.close()
        solo = one_agent(server, inv, min(args.window, 10.0), args.resync)
        print(f"one agent ({args.machine}, {len(inv.gpus)} GPUs): first publish {solo['first_publish_writes']} "
              f"writes (+{solo['runtimeclass_writes_fresh_cluster']} RuntimeClass create on a fresh cluster); "
              f"steady {solo['steady_requests']} requests / {solo['steady_writes']} writes in "
              f"{solo['steady_window_s']} s ({solo['steady_publish_passes']} passes) -> "
              f"{solo['requests_per_10min']} requests, {solo['writes_per_10min']} writes per 10 min "
              f"(+{solo['watch_renewals_per_10min']} watch renewals)")
        fleet = many_agents(server, inv, args.agents, args.concurrency, args.window, args.resync)
        print(f"{fleet['agents']} agents start-up burst ({fleet['concurrency']} at a time): "
              f"{fleet['burst_wall_s']} s wall, {fleet['burst_requests']} requests, {fleet['burst_writes']} writes "
              f"({fleet['burst_writes_per_agent']} per agent, max {fleet['burst_writes_max_agent']}; apiserver "
              f"served {fleet['burst_writes_served']}), publish p50 {fleet['burst_publish_p50_s']} s "
              f"p99 {fleet['burst_publish_p99_s']} s; RuntimeClass creates by answer (fresh cluster, every agent "
              f"reads it first): {fleet['burst_runtimeclass_creates']}")
        print(f"apiserver: {fleet['burst_apiserver_cpu_s']} CPU s in the burst, {fleet['steady_apiserver_cpu_s']} "
              f"CPU s in the idle window, RSS {fleet['apiserver_rss_before_mib']} MiB before, peak "
              f"{fleet['apiserver_peak_rss_mib']} MiB")
        print(f"{fleet['agents']} agents idle window: {fleet['steady_writes']} writes "
              f"(apiserver served {fleet['steady_writes_served']}), {fleet['steady_requests']} requests over "
              f"{fleet['steady_window_s']} s ({fleet['steady_publish_passes']} resync passes)")
        if args.agents == 100:
            b = BASELINE_100
            print(f"100 agents, before (publisher only, issue #15): {b['writes_per_agent']} writes/agent, "
                  f"{b['burst_writes']} writes, {b['burst_wall_s']} s; now (with GPU objects and conditions): "
                  f"{fleet['burst_writes_per_agent']} writes/agent, {fleet['burst_writes']} writes, "
                  f"{fleet['burst_wall_s']} s")
        print(json.dumps({"bench": "kube", "machine": args.machine, "one_agent": solo, "fleet": fleet}))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
