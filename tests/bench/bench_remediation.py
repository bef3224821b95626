"""Remediation figures: fault → GPU offered again, and pods disturbed per fault.

Run: .venv/bin/python tests/bench/bench_remediation.py [--rounds N]
Prints readable figures and one JSON line.

On the simulated 8x H100 (dgx-h100), eight pods, one per GPU (a simulated process each). Each round injects
XID 48 with the driver's recovery action "GPU reset" on one GPU (round-robin) and runs nodeagent's
remediation pipeline: withdraw, evict (the pod ends at once: the eviction grace period is excluded, as the
goal says), stop users, persistence off, reset, verify, restore, offer. The clock stops when the offer hook
runs (the GPU is back in both planes). Two resetters: the in-process simulator call, and the ``nvidia-smi -r
-i <UUID>`` stand-in run as a subprocess, as on a node. The Kubernetes side is in-process (no apiserver
round trips); tests/integration/test_remediation_eviction.py runs the same pipeline on a real apiserver.

The same fault on the whole-node cluster (real kubelet, containerd, scheduler, the agent's DaemonSet, the
packaged remediation controller evicting, the node's ``nvidia-smi`` stand-in resetting) is measured by
tests/cluster/test_whole_node.py (``TestRemediation``), which prints its JSON line: fault → the Node's
allocatable back (``remediation_xid48_fault_to_allocatable_s``, the PodDisruptionBudget's refusal included) and
budget relaxed → allocatable back (``remediation_budget_relaxed_to_allocatable_s``: controller pass, eviction
grace, pod deletion, reset, the kubelet's node status update).

For comparison (not measured here): NVIDIA NVSentinel's path for the same fault, from its design docs —
a syslog health monitor reports the XID, the fault-quarantine module cordons the node, the node-drainer
evicts every pod of the node, the fault-remediation module creates a GPUReset CR, the janitor sets four GPU
Operator deploy labels to false, runs a Job with nvidia-smi --gpu-reset, restores the labels; its fallback is
a node reboot (users report about 30 minutes for bare metal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nodeagent.hostpaths import HostPaths
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.remediation.commands import CommandResetter
from nodeagent.remediation.pipeline import Fault, PipelineSettings, Remediator
from nodeagent.remediation.planner import facts_from_inventory
from nodeagent.remediation.policy import load_catalog
from nodeagent.simulator import inject
from nodeagent.simulator.open import open_sim
from nodeagent.simulator.reset import SimGroupResetter


class Pods:
    def __init__(self, store: object, placement: dict[str, tuple[int, int]]) -> None:
        self.store, self.placement, self.evicted = store, placement, []  # type: ignore[var-annotated]

    async def evict(self, pod: str, grace_s: float) -> str:
        gpu, pid = self.placement.pop(pod)
        inject.kill_process(self.store, gpu, pid)  # type: ignore[arg-type]
        self.evicted.append(pod)
        return "evicted"

    async def gone(self, pod: str) -> bool:
        return pod not in self.placement


class Node:
    async def event(self, reason: str, message: str, warning: bool = False) -> None:
        return None

    async def condition(self, type: str, status: bool, reason: str, message: str) -> None:
        return None

    async def cordon(self, reason: str) -> None:
        return None


class Hooks:
    def __init__(self) -> None:
        self.offered_at: dict[str, float] = {}

    async def withdraw(self, uuid: str, reason: str) -> None:
        return None

    async def offer(self, uuid: str) -> None:
        self.offered_at[uuid] = time.perf_counter()

    async def stop_users(self, uuid: str) -> None:
        return None

    async def restore(self, uuid: str) -> None:
        return None


def smi_dir(tmp: Path) -> Path:
    """A directory with an ``nvidia-smi`` that runs the stand-in on this interpreter."""
    d = tmp / "bin"
    d.mkdir()
    exe = d / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m nodeagent.simulator.abi.smi \"$@\"\n")
    exe.chmod(0o755)
    return d


def run(rounds: int, resetter_kind: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        state = tmp / "sim.json"
        sim = open_sim("dgx-h100", state)
        nvml = adapter_for_sim(sim, HostPaths(tmp / "root"))
        inv = nvml.discover()
        gpus = facts_from_inventory(inv)
        uuid_of = {g.index: g.uuid for g in inv.gpus}
        if resetter_kind == "smi":
            os.environ["NODEAGENT_SIM_STATE"] = str(state)
            os.environ["PATH"] = f"{smi_dir(tmp)}:{os.environ['PATH']}"
            resetter: object = CommandResetter(smi=str(tmp / "bin/nvidia-smi"), timeout_s=30)
        else:
            resetter = SimGroupResetter(sim)
        times, disturbed = [], []
        for r in range(rounds):
            gpu = r % 8
            placement = {}
            for i in range(8):
                if not sim.store.read()["gpus"][i]["processes"]:
                    inject.inject_process(sim.store, i, 1000 + i, "python")
                placement[f"bench/pod-{i}"] = (i, 1000 + i)
            pods, hooks = Pods(sim.store, placement), Hooks()
            rem = Remediator(PipelineSettings(poll_s=0.01), load_catalog(), nvml, resetter, pods, Node(),  # type: ignore[arg-type]
                             hooks)
            holders = {uuid_of[i]: [p] for p, (i, _) in placement.items()}
            start = time.perf_counter()
            inject.inject_xid(sim.store, gpu, 48, recovery_action=1)
            out = asyncio.run(rem.handle(Fault(uuid_of[gpu], 48, 1), gpus, holders))
            assert out.result == "done", out.detail
            times.append(hooks.offered_at[uuid_of[gpu]] - start)
            disturbed.append(len(pods.evicted))
        return {"fault_to_offered_ms_median": round(statistics.median(times) * 1000, 1),
                "fault_to_offered_ms_max": round(max(times) * 1000, 1),
                "pods_disturbed_per_fault_max": max(disturbed)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args()
    figures = {}
    for kind in ("sim", "smi"):
        f = run(args.rounds, kind)
        print(f"resetter {kind:3}: fault → offered median {f['fault_to_offered_ms_median']} ms, "
              f"max {f['fault_to_offered_ms_max']} ms; pods disturbed per fault: {f['pods_disturbed_per_fault_max']} "
              f"(of 8 on the node)")
        figures.update({f"{kind}_{k}": v for k, v in f.items()})
    print("on the whole-node cluster (kubelet, controller, eviction, nvidia-smi stand-in): tests/cluster/"
          "test_whole_node.py -k TestRemediation prints remediation_xid48_fault_to_allocatable_s")
    print(json.dumps({"bench": "remediation", "rounds": args.rounds, **figures}))


if __name__ == "__main__":
    main()
