"""Benchmark: a fleet-wide MIG relabel under a disruption budget (real kube-apiserver + etcd, simulated agents).

NODES Nodes (default 1000) in one pool are "relabelled at once": every simulated agent (tests/integration/
_fleet.py: the real FleetGate, Leases, condition and Event; the GPU change is a pause of CHANGE seconds) starts
together. A watch on the pool's Leases samples the slots held for the whole run. Figures per run:

- wall time from the relabel to the last node done, against the budget (``--budgets``, default 5%);
- the most nodes changing at once, by the agents' own count and by the watch (must be <= the budget's slots);
- API writes per node: the fleet's Lease writes (request, take, leave the line, release, lost races) as each
  agent counted them, and every write the apiserver served during the run (its ``apiserver_request_total``:
  with the state label, the GpuChangeSlot condition and the Event) by resource;
- apiserver CPU seconds (its process) and reads per node;
- the same rollout WITHOUT a budget (the nodes are in no pool: every agent changes at once, no Lease at all).

Prints figures and one JSON line. No timing asserts. Usage:
    .venv/bin/python tests/bench/bench_fleet.py [--nodes 1000] [--budgets 5%,10%] [--change 1.0] [--poll 2.0]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import statistics
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil

from nodeagent.fleet.budget import parse_budget
from tests._metrics import apiserver_request_counts
from tests.integration._fleet import Fleet, LeaseWatch, agent, make_namespace, make_nodes, pooled_client
from tests.peers.apiserver import KubeApiServer, start_apiserver

NS = "nodeagent"
WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE"}


def apiserver_proc(server: KubeApiServer) -> psutil.Process | None:
    for p in server._procs:
        if "kube-apiserver" in " ".join(p.args if isinstance(p.args, list) else [str(p.args)]):
            return psutil.Process(p.pid)
    return None


def cpu_s(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    t = proc.cpu_times()
    return float(t.user + t.system)


def requests_by(server: KubeApiServer) -> Counter[tuple[str, str]]:
    out: Counter[tuple[str, str]] = Counter()
    for lab, v in apiserver_request_counts(server):
        out[(lab.get("verb", ""), lab.get("resource", "") + ("/" + lab["subresource"] if lab.get("subresource") else ""))] += int(v)
    return out


async def rollout(server: KubeApiServer, nodes: int, budget_text: str | None, change_s: float, poll_s: float,
                  threads: int) -> dict[str, Any]:
    kube = pooled_client(server.kubeconfig, threads)
    make_namespace(kube, NS)
    pool = f"b{uuid.uuid4().hex[:6]}"
    names = [f"{pool}-{i:04d}" for i in range(nodes)]
    make_nodes(kube, names, {"fleet-pool": pool})
    budget = parse_budget(budget_text.replace("POOL", pool)) if budget_text else parse_budget("pools: []")
    watch = LeaseWatch(server.kubeconfig, NS, pool)
    fleet = Fleet()
    proc = apiserver_proc(server)
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(threads))
    before, cpu0 = requests_by(server), cpu_s(proc)
    started = time.monotonic()
    async def progress() -> None:
        while True:
            await asyncio.sleep(30)
            print(f"  {time.monotonic() - started:.0f} s: {len(fleet.results)} done, {fleet.inside} changing, "
                  f"most {fleet.most_inside}", flush=True)

    ticker = asyncio.create_task(progress())
    results = await asyncio.gather(*(agent(kube, NS, n, {"fleet-pool": pool}, fleet, budget=budget,
                                           change_s=change_s, poll_s=poll_s) for n in names))
    ticker.cancel()
    wall = time.monotonic() - started
    cpu1, after = cpu_s(proc), requests_by(server)
    watch.stop()
    kube.close()
    delta = after - before
    writes = {k: v for k, v in delta.items() if k[0] in WRITE_VERBS}
    reads = sum(v for k, v in delta.items() if k[0] not in WRITE_VERBS and k[0] != "WATCH")
    lease_writes = sorted(fleet.writes.values())
    slots = budget.pools[0].max_unavailable.slots(nodes) if budget.pools else nodes
    return {
        "budget": (budget_text and budget.pools[0].max_unavailable.__str__()) or "none",
        "slots": slots,
        "nodes": nodes,
        "done": results.count("done"),
        "wall_s": round(wall, 1),
        "most_changing_agents": fleet.most_inside,
        "most_changing_watch": watch.most if budget.pools else None,
        "watch_samples": watch.samples,
        "lease_writes_per_node_median": statistics.median(lease_writes) if lease_writes else 0,
        "lease_writes_per_node_max": lease_writes[-1] if lease_writes else 0,
        "api_writes_per_node": round(sum(writes.values()) / nodes, 2),
        "api_writes_by_resource": {f"{v} {r}": n for (v, r), n in sorted(writes.items())},
        "api_reads_per_node": round(reads / nodes, 1),
        "apiserver_cpu_s": round(cpu1 - cpu0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--budgets", default="5%")
    ap.add_argument("--change", type=float, default=1.0, help="seconds one node's change takes")
    ap.add_argument("--poll", type=float, default=2.0, help="seconds between a waiting agent's looks")
    ap.add_argument("--threads", type=int, default=64)
    args = ap.parse_args()
    server = start_apiserver()
    runs: list[dict[str, Any]] = []
    try:
        for b in [x.strip() for x in args.budgets.split(",") if x.strip()] + ["none"]:
            text = None if b == "none" else (f"pools: [{{name: POOL, nodeSelector: 'fleet-pool=POOL', "
                                             f"maxUnavailable: {b if b.endswith('%') else int(b)}, maxFailures: 3}}]")
            run = asyncio.run(rollout(server, args.nodes, text, args.change, args.poll, args.threads))
            runs.append(run)
            print(f"budget {run['budget']:>5} ({run['slots']} slots): {run['done']}/{run['nodes']} done in "
                  f"{run['wall_s']} s; most changing {run['most_changing_agents']} (agents), "
                  f"{run['most_changing_watch']} (watch, {run['watch_samples']} samples); lease writes/node "
                  f"median {run['lease_writes_per_node_median']} max {run['lease_writes_per_node_max']}; "
                  f"all API writes/node {run['api_writes_per_node']}, reads/node {run['api_reads_per_node']}; "
                  f"apiserver CPU {run['apiserver_cpu_s']} s", flush=True)
            print(f"  writes: {run['api_writes_by_resource']}", flush=True)
    finally:
        server.stop()
    print(json.dumps({"bench": "fleet", "change_s": args.change, "poll_s": args.poll, "runs": runs}))


if __name__ == "__main__":
    main()
