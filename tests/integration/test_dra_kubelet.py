"""nodeagent's DRA driver against the kubelet's own DRA code (tests/testbin/dra-harness: the plugin watcher
and cm/dra.Manager of Kubernetes v1.34.4) and the REAL kube-apiserver.

No scheduler runs: the test creates the ResourceClaim and writes its allocation and reservation itself,
as the scheduler would. The kubelet code then reads the claim from the API server, calls
NodePrepareResources on the registered driver and hands the CDI device IDs to the container.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.component import CHECKPOINT_NAME, DraComponent
from nodeagent.dra.slices import UNHEALTHY_TAINT_KEY
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient
from tests.peers.apiserver import KubeApiServer
from tests.peers.draharness import DraHarness, DraHarnessError, Pod, running_dra_harness
from tests.unit._dp_inventories import mig_box

pytestmark = pytest.mark.peers

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


def create_allocated_claim(kube: KubeClient, node: str, devices: list[tuple[str, str]], pod: Pod) -> str:
    """A ResourceClaim with one request per (request, device), allocated on ``node`` and reserved for
    ``pod`` (what kube-scheduler would write); its UID."""
    name = f"claim-{uuid.uuid4().hex[:8]}"
    requests = [{"name": r, "exactly": {"deviceClassName": "gpu.nodeagent.io"}} for r, _ in devices]
    created = kube.request("POST", CLAIMS, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name}, "spec": {"devices": {"requests": requests}},
    })
    created["status"] = {
        "allocation": {"devices": {"results": [
            {"request": r, "driver": DRIVER_NAME, "pool": node, "device": d} for r, d in devices
        ]}},
        "reservedFor": [{"resource": "pods", "name": pod.name, "uid": pod.uid}],
    }
    kube.request("PUT", f"{CLAIMS}/{name}/status", body=created)
    # The pod's claim entry gets the ResourceClaim's own name: the v1.34 kubelet matches health to
    # containers by comparing the container's claim name with the ResourceClaim name.
    pod.claims[name] = name
    for claims in pod.containers.values():
        claims[:] = [name if c == "gpu" else c for c in claims]
    return str(created["metadata"]["uid"])


async def poll(cond: Callable[[], Any], what: str = "condition", timeout: float = 20.0) -> Any:
    """``cond()``'s first true value (run in a thread), polled every 0.1 s; AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        v = await asyncio.to_thread(cond)
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met in time")
        await asyncio.sleep(0.1)


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))  # socket paths must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def component(root: Path, kube: KubeClient, node: str) -> DraComponent:
    return DraComponent(paths=HostPaths(root), kube=kube, node_name=node, verify_interval_s=0.5)


def slice_devices(kube: KubeClient, node: str) -> dict[str, dict[str, Any]]:
    items = kube.list_resource_slices(field_selector=f"spec.nodeName={node}")
    return {d["name"]: d for s in items for d in s["spec"]["devices"]}


def resource_health(h: DraHarness, pod: Pod) -> dict[str, str]:
    """CDI device ID → health of the devices in the container "main"'s allocatedResourcesStatus."""
    return {r["resourceID"]: r["health"] for s in h.health(pod).get("main", []) for r in s.get("resources") or []}


async def test_kubelet_prepares_and_unprepares_a_claim_across_an_agent_restart(
    kube_apiserver: KubeApiServer, kube: KubeClient, node_name: str, root: Path
) -> None:
    inv = mig_box(per_gpu=2, gpus_on=1, gpus_off=2)
    dra = component(root, kube, node_name)
    await dra.start(inv)
    registry = root / "var/lib/kubelet/plugins_registry"
    cdi_dir = root / "var/run/cdi"
    started = [dra]
    try:
        await _prepare_scenario(kube_apiserver, kube, node_name, root, inv, registry, cdi_dir, started)
    finally:
        for d in started:  # stopping twice is harmless
            await d.stop()


async def _prepare_scenario(kube_apiserver: KubeApiServer, kube: KubeClient, node_name: str, root: Path,
                            inv: Any, registry: Path, cdi_dir: Path, started: list[DraComponent]) -> None:
    dra = started[0]
    with running_dra_harness(kube_apiserver.kubeconfig, registry, node_name) as h:
        await asyncio.to_thread(h.wait_registered, DRIVER_NAME)
        # the kubelet wipes the node's slices when it starts; the driver writes them again
        await poll(lambda: sorted(slice_devices(kube, node_name)) == ["gpu-0-mig-1-0", "gpu-0-mig-2-0",
                                                                        "gpu-1", "gpu-2"])

        pod = Pod("default", "trainer", str(uuid.uuid4()), {}, {"main": ["gpu"], "sidecar": []})
        uid = await asyncio.to_thread(create_allocated_claim, kube, node_name, [("gpu", "gpu-2")], pod)
        cdi = await asyncio.to_thread(h.prepare, pod)
        meta_id = f"gpu.nodeagent.io/metadata={uid}_gpu"  # the claim's device metadata (KEP-5304)
        assert cdi == {"main": [f"gpu.nodeagent.io/claim={uid}-gpu-2", meta_id], "sidecar": []}
        spec = json.loads((cdi_dir / f"gpu.nodeagent.io-claim_{uid}.json").read_text())
        assert spec["kind"] == "gpu.nodeagent.io/claim"
        assert [d["name"] for d in spec["devices"]] == [f"{uid}-gpu-2"]
        assert spec["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={inv.gpus[2].uuid}"]
        checkpoint = json.loads((root / "var/lib/nodeagent" / CHECKPOINT_NAME).read_text())
        assert checkpoint["claims"][uid]["state"] == "prepared"

        # XID on GPU 2: the kubelet sees the allocated device Unhealthy, the slice carries the taint
        await dra.set_health({(2, None): "XID 79"})
        cdi_id = f"gpu.nodeagent.io/claim={uid}-gpu-2"
        assert resource_health(h, pod) == {cdi_id: "Healthy"}
        await poll(lambda: resource_health(h, pod) == {cdi_id: "Unhealthy"})
        # (the kubelet may still be wiping the node's slices after the registration: gpu-2 can be missing
        # for a moment until the driver writes them again)
        taints = await poll(lambda: slice_devices(kube, node_name).get("gpu-2", {}).get("taints"))
        assert taints[0]["key"] == UNHEALTHY_TAINT_KEY
        await dra.set_health({})
        await poll(lambda: resource_health(h, pod) == {cdi_id: "Healthy"})
        await poll(lambda: "taints" not in slice_devices(kube, node_name).get("gpu-2", {"taints": []}))

        # the agent restarts (slices stay); the kubelet's unprepare reaches the new process
        await dra.stop(withdraw_slices=False)
        dra = component(root, kube, node_name)
        started.append(dra)
        await dra.start(inv)
        await asyncio.to_thread(h.wait_registered, DRIVER_NAME)

        def unprepare() -> bool:
            # Until the plugin watcher has processed the old socket's removal and the new one, the kubelet
            # may find the driver unregistered or its connection backing off; it retries unprepare on
            # every pod sync, so does the test.
            try:
                h.unprepare(pod)
            except DraHarnessError as e:
                assert "Unavailable" in str(e) or "is not registered" in str(e), e
                return False
            return True

        await poll(unprepare)
        assert not (cdi_dir / f"gpu.nodeagent.io-claim_{uid}.json").exists()
        checkpoint = json.loads((root / "var/lib/nodeagent" / CHECKPOINT_NAME).read_text())
        assert checkpoint["claims"] == {}

        # a claim for a device this node does not have fails with the driver's reason
        bad = Pod("default", "bad", str(uuid.uuid4()), {}, {"main": ["gpu"]})
        await asyncio.to_thread(create_allocated_claim, kube, node_name, [("gpu", "gpu-7")], bad)
        with pytest.raises(DraHarnessError, match="gpu-7 does not exist on this node"):
            await asyncio.to_thread(h.prepare, bad)

        await dra.stop()
        assert slice_devices(kube, node_name) == {}
        assert not (registry / "gpu.nodeagent.io-reg.sock").exists()


async def test_own_health_monitor_xid_taints_the_device_and_recovery_clears_it(
    kube: KubeClient, node_name: str, root: Path
) -> None:
    """Plane "dra" alone: the component runs the GPU health monitor on the (simulated) NVML itself."""
    from nodeagent.gpu.health import HealthMonitorSettings
    from nodeagent.nvmlsource import open_nvml
    from nodeagent.simulator import inject
    from nodeagent.simulator.machine import load_machine
    from nodeagent.simulator.state import SimStore

    state = root / "sim.json"
    nvml = open_nvml("dgx-h100", state, HostPaths(root))
    try:
        inv = nvml.discover()
        settings = HealthMonitorSettings.from_env({}, recovery_window_s=1.0, poll_interval_s=0.1)
        dra = DraComponent(paths=HostPaths(root), kube=kube, node_name=node_name, nvml=nvml,
                           health_settings=settings, verify_interval_s=60)
        await dra.start(inv)
        try:
            await dra.wait_published()
            assert all("taints" not in d for d in slice_devices(kube, node_name).values())
            inject.inject_xid(SimStore(load_machine("dgx-h100"), state), 3, 79)
            taints = await poll(lambda: slice_devices(kube, node_name)["gpu-3"].get("taints"))
            assert taints[0]["key"] == UNHEALTHY_TAINT_KEY and "79" in taints[0]["value"]
            assert [n for n, d in slice_devices(kube, node_name).items() if d.get("taints")] == ["gpu-3"]
            # no further XID for the recovery window: the taint goes away
            await poll(lambda: "taints" not in slice_devices(kube, node_name)["gpu-3"])
        finally:
            await dra.stop()
    finally:
        nvml.close()
