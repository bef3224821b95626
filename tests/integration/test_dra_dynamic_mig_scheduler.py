"""Dynamic MIG with the REAL kube-scheduler (its DynamicResources plugin, DRAPartitionableDevices on), in
releases 1.34.4 and 1.37.2 (tests/integration/_releases.py): the
pool of a simulated A100-40GB in MIG mode is published by nodeagent; claims for overlapping placements are
never both allocated (the second pod stays unschedulable), a non-overlapping one is; the allocations the
scheduler wrote are then prepared by nodeagent, which creates exactly those GPU instances."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.dra.cdi import ClaimSpecs
from nodeagent.dra.checkpoint import Checkpoint
from nodeagent.dra.devices import build_counter_sets, build_devices
from nodeagent.dra.publisher import SlicePublisher
from nodeagent.dra.service import ClaimPreparer, ClaimRef
from nodeagent.dra.slices import pool_content
from nodeagent.gpu.inventory import Gpu
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.kube.client import KubeClient
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator.open import open_sim
from tests.integration._kube import wait_for
from tests.integration._releases import release_apiserver, release_binary
from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers

kube_apiserver = release_apiserver  # every test once per Kubernetes release

NS = "default"
CLAIMS = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims"
PODS = f"/api/v1/namespaces/{NS}/pods"
CLASS = "mig-dyn.gpu.nodeagent.io"


@pytest.fixture(scope="module")
def scheduler(kube_apiserver: KubeApiServer) -> Iterator[subprocess.Popen[bytes]]:
    binary = release_binary(kube_apiserver.version, "kube-scheduler")
    log = (kube_apiserver.workdir / "kube-scheduler.log").open("wb")
    gates = ["--feature-gates=DRAPartitionableDevices=true"] if kube_apiserver.version < "v1.36" else []
    proc = subprocess.Popen(
        [str(binary), f"--kubeconfig={kube_apiserver.kubeconfig}", "--leader-elect=false", "--secure-port=0",
         *gates, "--v=2"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        time.sleep(1.0)
        assert proc.poll() is None, (kube_apiserver.workdir / "kube-scheduler.log").read_text()[-2000:]
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def node(kube: KubeClient) -> Iterator[str]:
    name = f"dynmig-{uuid.uuid4().hex[:8]}"
    kube.request("POST", "/api/v1/nodes", body={
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
    })
    status = {"capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
              "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
              "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                              "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                              "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    kube.request("PATCH", f"/api/v1/nodes/{name}/status", body={"status": status},
                 content_type="application/merge-patch+json")
    try:
        yield name
    finally:
        kube.request("DELETE", f"/api/v1/nodes/{name}")


def only_gpu0(gpu: Gpu) -> bool:
    return gpu.index == 0


def dynamic(gpu: Gpu) -> bool:
    return True


def a100_in_mig_mode(tmp_path: Path) -> NvmlAdapter:
    adapter = adapter_for_sim(open_sim("dgx-a100-40gb", tmp_path / "sim.json"))
    if adapter.set_mig_mode(0, True):
        adapter.reset_gpu(0)
    return adapter


def claim_for(kube: KubeClient, name: str, profile: str, start: int, node: str) -> None:
    expr = (f'device.attributes["gpu.nodeagent.io"].profile == "{profile}" && '
            f'device.attributes["gpu.nodeagent.io"].placementStart == {start}')
    kube.request("POST", CLAIMS, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": {
            "deviceClassName": CLASS, "selectors": [{"cel": {"expression": expr}}]}}]}},
    })
    kube.request("POST", PODS, body={
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        # the API server taints a new Node not-ready until a kubelet reports; none runs here
        "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "tolerations": [{"operator": "Exists"}],
                 "resourceClaims": [{"name": "mig", "resourceClaimName": name}],
                 "containers": [{"name": "main", "image": "pause", "resources": {"claims": [{"name": "mig"}]}}]},
    })


def allocated_device(kube: KubeClient, name: str) -> str | None:
    c = kube.request("GET", f"{CLAIMS}/{name}")
    results = (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return str(results[0]["device"]) if results else None


def pod_scheduled(kube: KubeClient, name: str) -> dict[str, Any] | None:
    pod = kube.request("GET", f"{PODS}/{name}")
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled":
            return dict(c)
    return None


async def test_the_scheduler_never_allocates_overlapping_placements(
        kube: KubeClient, kube_apiserver: KubeApiServer, scheduler: subprocess.Popen[bytes], node: str,
        tmp_path: Path) -> None:
    kube.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", body={
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": CLASS},
        "spec": {"selectors": [{"cel": {"expression": 'device.driver == "gpu.nodeagent.io" && '
                                                      'device.attributes["gpu.nodeagent.io"].type == "mig"'}}]},
    }) if not _class_exists(kube) else None
    adapter = a100_in_mig_mode(tmp_path)
    inv = adapter.discover()
    devs = build_devices(inv, gpu_filter=only_gpu0, dynamic_mig=dynamic)
    pub = SlicePublisher(kube, node)
    pub.sync(pool_content(devs, None, build_counter_sets(devs, inv)))
    names: list[str] = []
    try:
        # 4g.20gb at 0 holds memory slices 0-3
        names.append(a := f"a-{uuid.uuid4().hex[:6]}")
        claim_for(kube, a, "4g.20gb", 0, node)
        assert wait_for(lambda: allocated_device(kube, a), 30) == "gpu-0-mig-4g-20gb-at-0"
        wait_for(lambda: (pod_scheduled(kube, a) or {}).get("status") == "True", 30)

        # overlapping placements: 3g.20gb at 0 (slices 0-3), 2g.10gb at 2 (2-3), 1g.5gb at 3, 7g.40gb at 0
        overlapping = [("3g.20gb", 0), ("2g.10gb", 2), ("1g.5gb", 3), ("7g.40gb", 0)]
        refused = []
        for profile, start in overlapping:
            names.append(n := f"o-{uuid.uuid4().hex[:6]}")
            refused.append(n)
            claim_for(kube, n, profile, start, node)
        # a placement that does not overlap is allocated beside it
        names.append(c := f"c-{uuid.uuid4().hex[:6]}")
        claim_for(kube, c, "3g.20gb", 4, node)
        assert wait_for(lambda: allocated_device(kube, c), 30) == "gpu-0-mig-3g-20gb-at-4"
        for n in refused:
            def unschedulable(n: str = n) -> bool:
                cond = pod_scheduled(kube, n) or {}
                return cond.get("reason") == "Unschedulable" and cond.get("status") == "False"

            wait_for(unschedulable, 30)
            assert allocated_device(kube, n) is None

        # nodeagent prepares what the scheduler allocated: exactly those GPU instances
        preparer = ClaimPreparer(Checkpoint.load(tmp_path / "dra-claims.json"), ClaimSpecs(tmp_path / "cdi"),
                                 kube.get_resource_claim, node, mig=adapter)
        preparer.set_devices(devs)
        uids = {n: str(kube.request("GET", f"{CLAIMS}/{n}")["metadata"]["uid"]) for n in (a, c)}
        out = await preparer.prepare([ClaimRef(NS, uids[n], n) for n in (a, c)])
        assert all(r.error == "" for r in out.values()), out
        gpu = adapter.discover().gpu(0)
        assert sorted((m.profile, m.placement_start) for m in gpu.mig_devices) == [("3g.20gb", 4), ("4g.20gb", 0)]
        spec = json.loads(preparer.specs.path(uids[a]).read_text())
        assert spec["devices"][0]["name"] == f"{uids[a]}-gpu-0-mig-4g-20gb-at-0"
        assert await preparer.unprepare([ClaimRef(NS, uids[n], n) for n in (a, c)]) == {uids[a]: "", uids[c]: ""}
        assert adapter.discover().gpu(0).mig_devices == ()
    finally:
        for n in names:
            kube.request("DELETE", f"{PODS}/{n}", query={"gracePeriodSeconds": 0})
            kube.request("DELETE", f"{CLAIMS}/{n}")
        pub.remove()


def _class_exists(kube: KubeClient) -> bool:
    items = kube.request("GET", "/apis/resource.k8s.io/v1/deviceclasses").get("items") or []
    return any(i["metadata"]["name"] == CLASS for i in items)
