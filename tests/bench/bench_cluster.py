"""Figures of the whole node (tests/peers/cluster.py: the real kubelet, containerd 2.4, the agent from its own
image): time from `kubectl apply` of the README's manifests to the Node's allocatable showing the GPUs and to
the first GPU pod Running; pod start (create -> Running) with one GPU against the same pod without one.

    source tests/testbin/setup.sh && .venv/bin/python tests/bench/bench_cluster.py [--pods 5]

Prints the figures and one JSON line. Needs root and the host paths the cluster owns (no other kubelet)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cluster.test_whole_node import (
    RESOURCE,
    _gpu_pod,
    agent_pods,
    allocatable,
    imported_registry,
    readme_args,
    readme_manifest_commands,
)
from tests.peers.cluster import GPU_COUNT, Cluster, running_cluster
from tests.peers.hostlock import host_owned


def _epoch(stamp: str) -> float:
    """An RFC 3339 time of the API (whole seconds) or of the agent's JSON log (milliseconds)."""
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _phases(cluster: Cluster, applied_at: float, allocatable_at: float) -> dict[str, float]:
    """Where the time from `kubectl apply` to allocatable went (wall-clock seconds after the apply): the agent
    pod created and scheduled, its init container (bootstrap) started and ended, the agent started, its first
    registration with the kubelet (its log), the Node's allocatable seen. The API's times have whole seconds."""
    pod = next(p for p in agent_pods(cluster) if p["metadata"].get("deletionTimestamp") is None)
    status = pod["status"]
    out: dict[str, float] = {"pod_created": _epoch(pod["metadata"]["creationTimestamp"])}
    scheduled = next((c for c in status.get("conditions", []) if c["type"] == "PodScheduled"), None)
    if scheduled:
        out["pod_scheduled"] = _epoch(scheduled["lastTransitionTime"])
    init = status.get("initContainerStatuses", [{}])[0].get("state", {}).get("terminated", {})
    if init:
        out["bootstrap_started"] = _epoch(init["startedAt"])
        out["bootstrap_ended"] = _epoch(init["finishedAt"])
    running = status.get("containerStatuses", [{}])[0].get("state", {}).get("running", {})
    if running:
        out["agent_started"] = _epoch(running["startedAt"])
    log = cluster.kubectl("logs", "-n", "nodeagent", pod["metadata"]["name"], "-c", "nodeagent").stdout
    for line in log.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if "registered" in str(doc.get("msg", "")) and "with the kubelet" in str(doc.get("msg", "")):
            out["agent_registered"] = _epoch(doc["ts"])
            break
    out["allocatable_seen"] = allocatable_at
    return {k: round(v - applied_at, 2) for k, v in out.items()}


def _running_after(cluster: Cluster, pod: dict[str, Any]) -> float:
    name = pod["metadata"]["name"]
    start = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(pod))
    cluster.wait_for(f"{name} Running", lambda: cluster.get_json("pod", name)["status"].get("phase") == "Running",
                     timeout=120, poll=0.1)
    took = time.monotonic() - start
    cluster.kubectl("delete", "pod", name, "--grace-period=0", "--force", "--wait=true")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=5, help="pods per kind for the start-time comparison")
    args = ap.parse_args()
    figures: dict[str, Any] = {}
    with host_owned("the whole-node cluster (bench)"), running_cluster() as cluster:
        start = time.monotonic()
        applied_at = time.time()
        for command in readme_manifest_commands():
            cluster.kubectl(*readme_args(command, cluster, imported_registry(cluster)))
        first = _gpu_pod("first-gpu-pod", 1, "sleep 3600", {"terminationGracePeriodSeconds": 0})
        cluster.kubectl("apply", "-f", "-", input_text=json.dumps(first))
        cluster.wait_for("allocatable", lambda: allocatable(cluster) == GPU_COUNT, timeout=300, poll=0.1)
        figures["apply_to_allocatable_s"] = round(time.monotonic() - start, 2)
        figures["phases_s"] = _phases(cluster, applied_at, time.time())
        cluster.wait_for("first GPU pod Running", lambda: cluster.get_json("pod", "first-gpu-pod")["status"].get(
            "phase") == "Running", timeout=120, poll=0.1)
        figures["apply_to_first_gpu_pod_running_s"] = round(time.monotonic() - start, 2)
        cluster.kubectl("delete", "pod", "first-gpu-pod", "--grace-period=0", "--force", "--wait=true")
        with_gpu, without = [], []
        for i in range(args.pods):
            sleep = {"terminationGracePeriodSeconds": 0}
            without.append(_running_after(cluster, _gpu_pod(f"plain-{i}", 0, "sleep 3600", sleep)))
            with_gpu.append(_running_after(cluster, _gpu_pod(f"gpu-{i}", 1, "sleep 3600", sleep)))
        figures["pod_start_without_gpu_s"] = [round(x, 2) for x in without]
        figures["pod_start_with_gpu_s"] = [round(x, 2) for x in with_gpu]
        figures["pod_start_median_without_gpu_s"] = round(statistics.median(without), 2)
        figures["pod_start_median_with_gpu_s"] = round(statistics.median(with_gpu), 2)
        figures["resource"] = RESOURCE
    for k, v in figures.items():
        print(f"{k:34} {v}")
    print(json.dumps({"bench": "cluster", **figures}))


if __name__ == "__main__":
    main()
