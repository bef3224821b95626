"""What a further node of the several-node cluster costs (tests/peers/multinode.py): the time to start the
further nodes (side by side) up to Ready, then with the agent's DaemonSet running on every node, each further
node's resident memory (its kubelet, containerd, shims and pods' containers) and its CPU over an idle window.

    source tests/testbin/setup.sh && .venv/bin/python tests/bench/bench_several_nodes.py [--nodes 4] [--idle 30]

Prints the figures and one JSON line. Needs root and the host paths the cluster owns (no other kubelet)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cluster.test_several_nodes import deploy_agents
from tests.peers.hostlock import host_owned
from tests.peers.multinode import MACHINES, running_nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4, choices=range(2, len(MACHINES) + 1))
    parser.add_argument("--idle", type=float, default=30.0, help="seconds of the idle window (CPU)")
    args = parser.parse_args()
    hz = os.sysconf("SC_CLK_TCK")
    with host_owned("bench_several_nodes"):
        began = time.monotonic()
        with running_nodes(args.nodes) as nodes:
            cluster_s = time.monotonic() - began
            deployed = time.monotonic()
            deploy_agents(nodes)
            agents_s = time.monotonic() - deployed
            before = {n.node_name: nodes.usage(n.node_name) for n in nodes.others}
            threading.Event().wait(args.idle)  # the idle window the CPU figure is taken over
            after = {n.node_name: nodes.usage(n.node_name) for n in nodes.others}
            figures = {name: {"machine": nodes.machines[name], "start_s": round(nodes.started[name], 1),
                              "rss_mib": after[name][0] // 1024,
                              "idle_cpu_pct": round(100 * (after[name][1] - before[name][1]) / hz / args.idle, 1)}
                       for name in after}
    for name, f in figures.items():
        print(f"{name} ({f['machine']}): started in {f['start_s']} s, {f['rss_mib']} MiB resident, "
              f"{f['idle_cpu_pct']} % of one core idle")
    print(f"cluster of {args.nodes} up in {cluster_s:.1f} s (the first node's start included), agents ready on "
          f"every node {agents_s:.1f} s after the README's lines")
    print(json.dumps({"bench": "several_nodes", "nodes": args.nodes, "cluster_s": round(cluster_s, 1),
                      "agents_s": round(agents_s, 1), "further": figures}))


if __name__ == "__main__":
    main()
