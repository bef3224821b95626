"""Benchmark: nodeagent's DRA driver with the kubelet's own DRA manager (tests/testbin/dra-harness) and a
real kube-apiserver.

1. Claim allocated → NodePrepareResources answered: for N claims (one whole GPU each, allocation written
   by the benchmark as the scheduler would), the driver's NodePrepareResources over its socket (our own
   gRPC client; includes the driver's ResourceClaim GET, CDI spec and checkpoint writes), and the kubelet
   code's whole PrepareResources (its own claim GET + the driver call + its checkpoint). p50/p99.
2. Dynamic MIG: allocated claim for one MIG placement → NodePrepareResources answered, including the GPU-
   and compute-instance creation on the NVML simulator (an 8-GPU H100 machine in MIG mode, ``dynamic_mig``),
   then NodeUnprepareResources (instance destroyed). p50/p99 of both.
3. Slice writes while idle: both pools (whole GPUs, and the dynamic MIG pool with its shared counters) are
   re-verified every VERIFY seconds for WINDOW seconds; writes are counted and extrapolated to one hour
   (target 0).

Prints figures and one JSON line. No timing asserts. Usage:
    .venv/bin/python tests/bench/bench_dra.py [--claims 100] [--mig-claims 40] [--window 20] [--verify 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc

from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.api import v1_pb2, v1_pb2_grpc
from nodeagent.dra.component import DraComponent
from nodeagent.dra.service import ClaimRef
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient, connect
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator.open import open_sim
from tests.integration.test_dra_kubelet import create_allocated_claim
from tests.peers.apiserver import start_apiserver
from tests.peers.draharness import Pod, start_dra_harness
from tests.unit._dp_inventories import nvswitch_box

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


def timed(call: Any, request: Any) -> tuple[Any, float]:
    """One blocking gRPC call from a worker thread (as the kubelet, a separate client, would make it)."""
    t0 = time.perf_counter()
    resp = call(request)
    return resp, (time.perf_counter() - t0) * 1000


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    server = start_apiserver()
    root = Path(tempfile.mkdtemp(prefix="drab-", dir="/tmp"))
    kube = KubeClient(connect(server.kubeconfig))
    node = "bench-dra"
    inv = nvswitch_box(8)
    dra = DraComponent(paths=HostPaths(root), kube=kube, node_name=node, verify_interval_s=args.verify)
    harness = None
    try:
        await dra.start(inv)
        harness = start_dra_harness(root, server.kubeconfig, root / "var/lib/kubelet/plugins_registry", node)
        await asyncio.to_thread(harness.wait_registered, DRIVER_NAME, 30.0)
        driver_ms: list[float] = []
        service_ms: list[float] = []
        kubelet_ms: list[float] = []
        with grpc.insecure_channel(f"unix://{dra.server.dra_path if dra.server else ''}") as ch:
            stub = v1_pb2_grpc.DRAPluginStub(ch)
            for i in range(args.claims):
                device = f"gpu-{i % 8}"
                # driver alone: allocated claim → NodePrepareResources answered
                pod = Pod("default", f"direct-{i}", str(uuid.uuid4()), {}, {"main": ["gpu"]})
                uid = await asyncio.to_thread(create_allocated_claim, kube, node, [("gpu", device)], pod)
                req = v1_pb2.NodePrepareResourcesRequest(
                    claims=[v1_pb2.Claim(namespace="default", uid=uid, name=next(iter(pod.claims)))])
                resp, ms = await asyncio.to_thread(timed, stub.NodePrepareResources, req)
                driver_ms.append(ms)
                # the same work without gRPC: the driver's own share (claim GET, CDI spec, checkpoint)
                pod = Pod("default", f"svc-{i}", str(uuid.uuid4()), {}, {"main": ["gpu"]})
                svc_uid = await asyncio.to_thread(create_allocated_claim, kube, node, [("gpu", device)], pod)
                ref = ClaimRef("default", svc_uid, next(iter(pod.claims)))
                assert dra.preparer is not None
                t0 = time.perf_counter()
                svc = await dra.preparer.prepare([ref])
                service_ms.append((time.perf_counter() - t0) * 1000)
                assert svc[svc_uid].error == "", svc[svc_uid].error
                await dra.preparer.unprepare([ref])
                assert resp.claims[uid].error == "", resp.claims[uid].error
                await asyncio.to_thread(stub.NodeUnprepareResources,
                                        v1_pb2.NodeUnprepareResourcesRequest(claims=req.claims))
                # the kubelet's whole PrepareResources for a pod
                pod = Pod("default", f"pod-{i}", str(uuid.uuid4()), {}, {"main": ["gpu"]})
                await asyncio.to_thread(create_allocated_claim, kube, node, [("gpu", device)], pod)
                _, seconds = await asyncio.to_thread(harness.prepare_timed, pod)
                kubelet_ms.append(seconds * 1000)
                await asyncio.to_thread(harness.unprepare, pod)
        mig_prepare_ms, mig_unprepare_ms = await bench_dynamic_mig(args, kube, root)
        await dra.wait_published()
        writes0, reads0 = kube.stats.writes, kube.stats.total
        await asyncio.sleep(args.window)
        idle_writes = kube.stats.writes - writes0
        idle_requests = kube.stats.total - reads0
        per_hour = 3600.0 / args.window
        return {
            "bench": "dra", "claims": args.claims,
            "prepare_driver_ms_p50": round(statistics.median(driver_ms), 2),
            "prepare_driver_ms_p99": round(pct(driver_ms, 0.99), 2),
            "prepare_service_ms_p50": round(statistics.median(service_ms), 2),
            "prepare_service_ms_p99": round(pct(service_ms, 0.99), 2),
            "prepare_kubelet_ms_p50": round(statistics.median(kubelet_ms), 2),
            "prepare_kubelet_ms_p99": round(pct(kubelet_ms, 0.99), 2),
            "mig_claims": len(mig_prepare_ms),
            "prepare_mig_ms_p50": round(statistics.median(mig_prepare_ms), 2),
            "prepare_mig_ms_p99": round(pct(mig_prepare_ms, 0.99), 2),
            "unprepare_mig_ms_p50": round(statistics.median(mig_unprepare_ms), 2),
            "unprepare_mig_ms_p99": round(pct(mig_unprepare_ms, 0.99), 2),
            "idle_window_s": args.window, "verify_interval_s": args.verify,
            "idle_slice_writes": idle_writes, "idle_slice_writes_per_hour": round(idle_writes * per_hour, 1),
            "idle_requests_per_hour": round(idle_requests * per_hour, 1),
        }
    finally:
        if harness is not None:
            harness.stop()
        for c in _MIG_COMPONENTS:
            await c.stop()
        await dra.stop()
        kube.close()
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


MIG_NODE = "bench-dra-mig"


async def bench_dynamic_mig(args: argparse.Namespace, kube: KubeClient, root: Path) -> tuple[list[float], list[float]]:
    """Prepare/unprepare of dynamic MIG claims; the component stays up (its pool counts in the idle window)."""
    adapter = adapter_for_sim(open_sim("dgx-h100", root / "sim-state.json"))
    for i in range(8):
        if adapter.set_mig_mode(i, True):
            adapter.reset_gpu(i)
    mroot = root / "mig"
    dra = DraComponent(paths=HostPaths(mroot), kube=kube, node_name=MIG_NODE, verify_interval_s=args.verify,
                       mig=adapter, dynamic_mig=True)
    await dra.start(adapter.discover())
    _MIG_COMPONENTS.append(dra)
    await dra.wait_published()
    placements = [d.name for d in dra.devices if d.placement is not None and d.placement.profile == "1g.10gb"]
    prepare_ms: list[float] = []
    unprepare_ms: list[float] = []
    with grpc.insecure_channel(f"unix://{dra.server.dra_path if dra.server else ''}") as ch:
        stub = v1_pb2_grpc.DRAPluginStub(ch)
        for i in range(args.mig_claims):
            pod = Pod("default", f"mig-{i}", str(uuid.uuid4()), {}, {"main": ["gpu"]})
            uid = await asyncio.to_thread(create_allocated_claim, kube, MIG_NODE,
                                          [("gpu", placements[i % len(placements)])], pod)
            claims = [v1_pb2.Claim(namespace="default", uid=uid, name=next(iter(pod.claims)))]
            resp, ms = await asyncio.to_thread(timed, stub.NodePrepareResources,
                                               v1_pb2.NodePrepareResourcesRequest(claims=claims))
            prepare_ms.append(ms)
            assert resp.claims[uid].error == "", resp.claims[uid].error
            un, ms = await asyncio.to_thread(timed, stub.NodeUnprepareResources,
                                             v1_pb2.NodeUnprepareResourcesRequest(claims=claims))
            unprepare_ms.append(ms)
            assert un.claims[uid].error == "", un.claims[uid].error
    return prepare_ms, unprepare_ms


_MIG_COMPONENTS: list[DraComponent] = []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--claims", type=int, default=100)
    ap.add_argument("--mig-claims", type=int, default=40)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--verify", type=float, default=1.0)
    res = asyncio.run(run(ap.parse_args()))
    print(f"NodePrepareResources (driver, whole GPU): p50 {res['prepare_driver_ms_p50']} ms, "
          f"p99 {res['prepare_driver_ms_p99']} ms over {res['claims']} claims")
    print(f"  of which the driver's own work (no gRPC): p50 {res['prepare_service_ms_p50']} ms, "
          f"p99 {res['prepare_service_ms_p99']} ms")
    print(f"kubelet PrepareResources (claim GET + driver + checkpoint): p50 {res['prepare_kubelet_ms_p50']} ms, "
          f"p99 {res['prepare_kubelet_ms_p99']} ms")
    print(f"NodePrepareResources (driver, dynamic MIG 1g.10gb incl. GPU/compute instance creation): "
          f"p50 {res['prepare_mig_ms_p50']} ms, p99 {res['prepare_mig_ms_p99']} ms over {res['mig_claims']} claims; "
          f"NodeUnprepareResources (instance destroyed): p50 {res['unprepare_mig_ms_p50']} ms, "
          f"p99 {res['unprepare_mig_ms_p99']} ms")
    print(f"idle: {res['idle_slice_writes']} slice writes in {res['idle_window_s']} s "
          f"(verify every {res['verify_interval_s']} s) -> {res['idle_slice_writes_per_hour']} per hour; "
          f"{res['idle_requests_per_hour']} requests per hour")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
