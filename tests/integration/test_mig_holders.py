"""What holds a GPU during the MIG release wait, on the real peers: ResourceClaims the DRA plane prepared
(a dynamic-MIG claim's GPU instance is never destroyed by a ``nvidia.com/mig.config`` change), and pods
holding device-plugin devices while no device plugin is attached (restoring an interrupted apply at start).

GPUs are the NVML simulator; the Node, its labels, Events and ResourceSlices live in a real kube-apiserver;
pods and their devices are the kubelet's own device manager in the harness, read over PodResources. The
last test's PodResources answer is hand-written (cases the real peers cannot produce together); claims
reported by the kubelet's own PodResources server are tested in test_podresources_dra.py.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nodeagent.daemon.components.mig import GpuHolderSources, plugin_device_ids
from nodeagent.daemon.shared import DevicePluginLink, Shared
from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.component import DraComponent
from nodeagent.dra.service import ClaimRef
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient
from nodeagent.kube.node import NodeClient
from nodeagent.kube.podresources import PodResourcesClient
from nodeagent.kube.podresources_api import podresources_pb2 as pb
from nodeagent.kube.podresources_api import podresources_pb2_grpc as pb_grpc
from nodeagent.mig.apply import GpuCheckpoint, InFlight, MigStateFile
from nodeagent.mig.reconciler import (
    CONFIG_LABEL,
    GENERATION_ANNOTATION,
    ClaimHolder,
    MigReconciler,
    MigReconcilerOptions,
)
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator.open import open_sim
from tests.integration.test_dra_withdraw import Plane
from tests.integration.test_mig_reconciler import events, layout, run_until_terminal
from tests.peers import KubeletHarness

pytestmark = pytest.mark.peers


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory: the kubelet socket paths below it must fit a Unix socket name."""
    d = Path(tempfile.mkdtemp(prefix="mhold-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_mig_config_never_destroys_a_dynamic_mig_claims_instance(
        kube: KubeClient, node_name: str, short_tmp: Path) -> None:
    """GPU 0 serves dynamic MIG; a claim prepared on it created a 2g.10gb instance. A mig.config that would
    re-partition GPU 0 changes the free GPUs, waits for the claim, ends ``failed`` naming it, and the
    instance is still there; once the claim is unprepared the same config applies."""
    adapter = adapter_for_sim(open_sim("dgx-a100-40gb", short_tmp / "sim.json"))
    if adapter.set_mig_mode(0, True):
        adapter.reset_gpu(0)
    dra = DraComponent(paths=HostPaths(short_tmp / "root"), kube=kube, node_name=node_name, mig=adapter,
                       dynamic_mig=True, gpu_filter=lambda g: g.index == 0)

    shared = Shared()
    plane = Plane(dra)
    await dra.start(adapter.discover())
    shared.dra.attach(plane)
    node = NodeClient(kube, node_name)
    try:
        uid = str(uuid.uuid4())
        claim = {"metadata": {"namespace": "ml", "name": "c1", "uid": uid}, "status": {"allocation": {
            "devices": {"results": [{"request": "r", "driver": DRIVER_NAME, "pool": node_name,
                                     "device": "gpu-0-mig-2g-10gb-at-2"}]}}}}
        assert dra.preparer is not None
        dra.preparer.read_claim = lambda ns, name: claim
        assert (await dra.preparer.prepare([ClaimRef("ml", uid, "c1")]))[uid].error == ""
        await dra.on_inventory(adapter.discover())
        before = layout(adapter)
        assert before[0] == [("2g.10gb", 2)]

        # no kubelet socket: the DRA plane's own record is what holds the GPU
        holders = GpuHolderSources(PodResourcesClient(short_tmp / "none.sock"), lambda g: {}, shared.dra,
                                   pool=node_name, driver=DRIVER_NAME)
        node.patch_labels({CONFIG_LABEL: "all-balanced"})
        options = MigReconcilerOptions(release_timeout_s=0.5, release_poll_s=0.05)
        rec = MigReconciler(node, adapter, short_tmp / "state", publisher=shared.advertiser, holders=holders,
                            options=options)
        assert await run_until_terminal(rec, node) == "failed"
        after = layout(adapter)
        assert after[0] == before[0]  # the claim's instance survived
        assert all(after[i] and after[i] != before[i] for i in range(1, 8))  # the free GPUs were changed
        [failed] = [e for e in events(node) if e[0] == "MigConfigFailed"]
        assert failed[1] == "Warning"
        assert "GPU 0 is held by claim ml/c1 after waiting 0.5s" in failed[2], failed
        assert "GPU(s) 1, 2, 3, 4, 5, 6, 7 were changed, GPU(s) 0 were not" in failed[2]
        [waiting] = [e[2] for e in events(node) if e[0] == "MigWaitingForPods"]
        assert waiting == "MIG config all-balanced waits up to 0.5s: GPU 0 is held by claim ml/c1"
        assert {d.name for d in dra.devices} >= {"gpu-0-mig-2g-10gb-at-2"}  # re-advertised as it was

        # the claim goes: the same config (re-requested by generation) applies
        assert await dra.preparer.unprepare([ClaimRef("ml", uid, "c1")]) == {uid: ""}
        assert await holders(frozenset(range(8))) == {}
        node.patch_metadata(annotations={GENERATION_ANNOTATION: "1"})
        rec = MigReconciler(node, adapter, short_tmp / "state", publisher=shared.advertiser, holders=holders,
                            options=options)
        assert await run_until_terminal(rec, node) == "success"
        assert layout(adapter)[0] != before[0] and layout(adapter)[0]
    finally:
        shared.dra.detach(plane)
        await dra.stop()


async def test_restoring_an_interrupted_apply_waits_for_pods_before_the_plugin_attaches(
        kube: KubeClient, node_name: str, short_tmp: Path, kubelet_harness: KubeletHarness) -> None:
    """A pod holds GPU 2 (allocated by the kubelet through the device plugin); the agent restarts with an
    interrupted apply naming GPU 2 and no device plugin attached yet: the restore still finds the pod by
    the device IDs the plugin would advertise, waits, ends ``failed`` naming it, and touches nothing; once
    the pod is gone the restore and the apply go through."""
    from nodeagent.deviceplugin.service import DevicePluginService

    adapter = adapter_for_sim(open_sim("dgx-h100", short_tmp / "sim.json"))
    inv = adapter.discover()
    svc = DevicePluginService(plugin_dir=kubelet_harness.plugin_dir)
    await svc.start(inv)
    try:
        await asyncio.to_thread(kubelet_harness.wait, "nvidia.com/gpu", total=8, registered=True)
        pod = await asyncio.to_thread(kubelet_harness.allocate, "nvidia.com/gpu", 1, pod="hold", namespace="ml",
                                      pod_uid=str(uuid.uuid4()))
    finally:
        await svc.stop()  # the agent is gone; the pod keeps its device
    try:
        [held] = [g.index for g in inv.gpus if g.uuid == pod.device_ids[0]]
        state = short_tmp / "state"
        MigStateFile(state).update(config="all-1g.10gb", phase="applying", inflight={
            "config": "all-1g.10gb", "gpus": [InFlight(GpuCheckpoint.of(inv.gpu(held)), None).to_dict()]})

        link = DevicePluginLink()  # nothing attached: the device plugin has not started yet
        assert link.device_gpus(frozenset({held})) == {}

        def device_ids(gpus: frozenset[int]) -> dict[tuple[str, str], int]:
            return plugin_device_ids(link, adapter.discover(), None, gpus)

        assert device_ids(frozenset({held})) == {("nvidia.com/gpu", inv.gpu(held).uuid): held}
        holders = GpuHolderSources(PodResourcesClient(kubelet_harness.pod_resources_socket), device_ids,
                                   Shared().dra, pool=node_name, driver=DRIVER_NAME)
        node = NodeClient(kube, node_name)
        node.patch_labels({CONFIG_LABEL: "all-1g.10gb"})
        options = MigReconcilerOptions(release_timeout_s=0.5, release_poll_s=0.05)
        before = layout(adapter)
        rec = MigReconciler(node, adapter, state, holders=holders, options=options)
        assert await run_until_terminal(rec, node) == "failed"
        assert layout(adapter) == before
        assert MigStateFile(state).inflight() != []  # the record stays for the next attempt
        [failed] = [e[2] for e in events(node) if e[0] == "MigConfigFailed"]
        assert f"GPU {held} is held by pod ml/hold after waiting 0.5s" in failed, failed
        # once at start, once more before the reconcile of the label: each time the pod was found
        waiting = [e[2] for e in events(node) if e[0] == "MigWaitingForPods"]
        assert waiting and all(w == "restoring the GPUs of an interrupted MIG apply waits up to 0.5s: "
                               f"GPU {held} is held by pod ml/hold" for w in waiting), waiting
    finally:
        await asyncio.to_thread(kubelet_harness.release, pod.pod_uid)
    node.patch_metadata(annotations={GENERATION_ANNOTATION: "1"})
    rec = MigReconciler(node, adapter, state, holders=holders, options=options)
    assert await run_until_terminal(rec, node) == "success"
    assert MigStateFile(state).inflight() == []
    assert all(v == [("1g.10gb", s) for s in range(7)] for v in layout(adapter).values())


class ClaimReportingKubelet(pb_grpc.PodResourcesListerServicer):
    """A PodResources v1 server answering List with a fixed response. The kubelet's own server with real
    claims is tested in test_podresources_dra.py; this one answers what those peers cannot produce together:
    device-plugin devices beside claims, another driver's and another pool's devices, one claim used by
    two pods."""

    def __init__(self, response: pb.ListPodResourcesResponse) -> None:
        self.response = response

    def List(self, request: pb.ListPodResourcesRequest, context: object) -> pb.ListPodResourcesResponse:
        return self.response


async def test_holders_merge_pods_the_dra_record_and_claims_podresources_reports(short_tmp: Path) -> None:
    """The merge in ``GpuHolderSources`` over a hand-written List answer: a device-plugin pod, a claim the
    DRA record knows (PodResources adds its pod), a claim only PodResources reports (shared by two pods),
    and a claim whose devices belong to another driver or another pool (not a holder)."""
    import grpc

    def claim(ns: str, pod: str, name: str, *devices: tuple[str, str, str]) -> pb.PodResources:
        return pb.PodResources(name=pod, namespace=ns, containers=[pb.ContainerResources(name="c", dynamic_resources=[
            pb.DynamicResource(claim_name=name, claim_namespace=ns, claim_resources=[
                pb.ClaimResource(driver_name=d, pool_name=p, device_name=n) for d, p, n in devices])])])

    response = pb.ListPodResourcesResponse(pod_resources=[
        pb.PodResources(name="train", namespace="ml", containers=[pb.ContainerResources(name="c", devices=[
            pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-1"])])]),
        claim("ml", "infer", "recorded"),  # the DRA record knows where: PodResources adds the pod
        claim("ab", "eval", "reported", (DRIVER_NAME, "n1", "gpu-2-mig-1-0")),  # not in the record
        claim("ab", "eval2", "reported", (DRIVER_NAME, "n1", "gpu-2-mig-1-0")),
        claim("x", "other", "foreign", ("other.example.com", "n1", "gpu-3"), (DRIVER_NAME, "n2", "gpu-3")),
    ])
    sock = short_tmp / "pr.sock"
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PodResourcesListerServicer_to_server(ClaimReportingKubelet(response), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"unix://{sock}")
    server.start()

    class Record:
        def claims_on(self, gpu_indices: frozenset[int]) -> dict[int, tuple[ClaimRef, ...]]:
            return {g: (ClaimRef("ml", "u1", "recorded"),) for g in (0, 5) if g in gpu_indices}

    client = PodResourcesClient(sock)
    try:
        holders = GpuHolderSources(client, lambda g: {("nvidia.com/gpu", "GPU-1"): 1} if 1 in g else {},
                                   Record(), pool="n1", driver=DRIVER_NAME)
        got = await holders(frozenset(range(4)))
        assert got == {
            0: (ClaimHolder("ml/recorded", ("ml/infer",)),),
            1: ("ml/train",),
            2: (ClaimHolder("ab/reported", ("ab/eval", "ab/eval2")),),
        }
        assert await holders(frozenset({3, 4})) == {}
    finally:
        client.close()
        server.stop(None)
