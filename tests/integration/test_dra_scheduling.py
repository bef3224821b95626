"""Pods with DRA claims go through the REAL control plane and the kubelet's DRA code, on four Kubernetes
releases (v1.34.4, the v1 API floor, v1.35.4, v1.36.3 and v1.37.2; tests/peers/controlplane.py):

kube-controller-manager creates each pod's ResourceClaim from its ResourceClaimTemplate, kube-scheduler
allocates a device from the ResourceSlices nodeagent's DRA component publishes for a simulated node and
binds the pod there, then the kubelet's DRA manager (tests/testbin/dra-harness; the driver registered
through its plugin watcher) prepares the claim. The CDI IDs it returns must resolve, with the CDI
reference library (cdi-check), in the per-claim spec nodeagent wrote; unprepare removes the spec.
An XID on the allocated GPU shows in allocatedResourcesStatus and as a device taint until recovery.
A driver process killed (-9) inside NodePrepareResources is cleaned up by its restart and the kubelet's
retry prepares the claim.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import yaml

from nodeagent.cdi import simhost
from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.component import DraComponent
from nodeagent.dra.slices import UNHEALTHY_TAINT_KEY
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient, connect
from tests.e2e._agent import eventually
from tests.integration.test_dra_kubelet import resource_health
from tests.peers.cdicheck import run_cdi_check
from tests.peers.controlplane import RELEASES, ControlPlane, KubeRelease, running_control_plane
from tests.peers.draharness import DraHarness, Pod, running_dra_harness
from tests.unit._dp_inventories import gpu, mig_box

pytestmark = pytest.mark.peers

MANIFESTS = Path(__file__).resolve().parents[2] / "packaging/kubernetes"
NODE = "dra-sched-node"
SHARED_GPU = 4
NS = "default"
T = TypeVar("T")

# One GPU in MIG mode with two 1g.10gb devices (gpu-0-mig-1-0, gpu-0-mig-2-0), whole GPUs gpu-1..gpu-3,
# and gpu-4, another product, for the productName selector, published as a shared GPU (consumable
# capacity where the release serves it: several claims each take part of its 81559 MiB).
INVENTORY = replace(mig_box(per_gpu=2, gpus_on=1, gpus_off=3),
                    gpus=(*mig_box(per_gpu=2, gpus_on=1, gpus_off=3).gpus,
                          gpu(4, numa=None, name="NVIDIA A100-SXM4-80GB")))


class LoopThread:
    """An asyncio loop in its own thread: the DRA component serves the kubelet's calls while the test
    blocks on the harness and the API."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dra-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Cluster:
    plane: ControlPlane
    kube: KubeClient
    harness: DraHarness
    dra: DraComponent
    root: Path
    loop: LoopThread

    @property
    def release(self) -> KubeRelease:
        return self.plane.release

    @property
    def cdi_dir(self) -> Path:
        return self.root / "var/run/cdi"

    def get(self, path: str) -> dict[str, Any]:
        out: dict[str, Any] = self.kube.request("GET", path)
        return out

    def diagnostics(self) -> str:
        return "\n".join(f"--- {c}:\n{self.plane.log_tail(c, 15)}" for c in ("kube-scheduler",
                                                                          "kube-controller-manager"))


def wait_for(cond: Callable[[], T | None], timeout: float, what: str, cluster: Cluster | None = None) -> T:
    """``eventually``, failing with the scheduler's and the controller manager's last log lines."""
    try:
        return cast(T, eventually(cond, timeout, what))
    except AssertionError as e:
        raise AssertionError(f"{e}\n{cluster.diagnostics() if cluster else ''}") from None


def apply_device_classes(kube: KubeClient) -> None:
    for f in ("deviceclass.yaml", "deviceclass-extended-resource.yaml"):
        for doc in yaml.safe_load_all((MANIFESTS / f).read_text()):
            if doc:
                kube.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", body=doc)


def make_node(kube: KubeClient) -> None:
    kube.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": NODE, "labels": {"kubernetes.io/hostname": NODE}}})
    node = kube.request("GET", f"/api/v1/nodes/{NODE}")
    resources = {"cpu": "32", "memory": "256Gi", "pods": "110"}  # no nvidia.com/gpu: DRA serves it
    node["status"] = {"capacity": resources, "allocatable": resources, "conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated node"}]}
    kube.request("PUT", f"/api/v1/nodes/{NODE}/status", body=node)
    # the TaintNodesByCondition admission plugin created the node with the not-ready taint; no node
    # lifecycle controller runs to lift it once Ready
    node = kube.request("GET", f"/api/v1/nodes/{NODE}")
    node["spec"].pop("taints", None)
    kube.request("PUT", f"/api/v1/nodes/{NODE}", body=node)


def slice_devices(kube: KubeClient) -> dict[str, dict[str, Any]]:
    items = kube.list_resource_slices(field_selector=f"spec.nodeName={NODE}")
    return {d["name"]: d for s in items for d in s["spec"]["devices"]}


# Every test names the releases it runs on: ``every`` one on all four (the device-taint eviction test on
# the releases whose controller manager runs that controller).
every = pytest.mark.parametrize("cluster", RELEASES, ids=[r.version for r in RELEASES], indirect=True)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    release: KubeRelease = request.param
    harness_bin = release.dra_harness()
    with running_control_plane(release) as plane:
        kube = KubeClient(connect(plane.apiserver.kubeconfig))
        agent_kube = KubeClient(connect(plane.apiserver.kubeconfig))
        root = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))  # socket paths must stay under 108 bytes
        loop = LoopThread()
        dra = DraComponent(paths=HostPaths(root), kube=agent_kube, node_name=NODE, verify_interval_s=0.5,
                           shared_gpus=(SHARED_GPU,))
        try:
            apply_device_classes(kube)
            make_node(kube)
            # the simulated host's /proc/devices, mig-minors and /dev stand-ins, as `nodeagent run --simulate`
            simhost.materialise(HostPaths(root), INVENTORY)
            loop.run(dra.start(INVENTORY))
            registry = root / "var/lib/kubelet/plugins_registry"
            with running_dra_harness(plane.apiserver.kubeconfig, registry, NODE, binary=harness_bin) as h:
                h.wait_registered(DRIVER_NAME)
                c = Cluster(plane, kube, h, dra, root, loop)
                # the kubelet wipes the node's slices when the driver registers; the driver writes them again
                wait_for(lambda: len(slice_devices(kube)) == 6, 30, "the node's ResourceSlices", c)
                yield c
        finally:
            loop.run(dra.stop())
            loop.close()
            agent_kube.close()
            kube.close()
            shutil.rmtree(root, ignore_errors=True)


def claim_template(kube: KubeClient, name: str, device_class: str, cel: str | None = None,
                   capacity: dict[str, str] | None = None, *, admin: bool = False, namespace: str = NS,
                   request: dict[str, Any] | None = None) -> None:
    """A template with one request ``gpu``: ``exactly`` from the arguments, or ``request`` as given (e.g. a
    prioritized list, ``{"firstAvailable": [...]}``)."""
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if cel:
        exactly["selectors"] = [{"cel": {"expression": cel}}]
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    if admin:
        exactly["adminAccess"] = True
    req = {"name": "gpu", **(request or {"exactly": exactly})}
    kube.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates", body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [req]}}}})


def make_claim(kube: KubeClient, name: str, request: dict[str, Any], namespace: str = NS) -> None:
    """A ResourceClaim with the one request ``gpu`` (``request`` holds ``exactly`` or ``firstAvailable``)."""
    kube.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims", body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", **request}]}}})


def exactly(device_class: str, cel: str | None = None, capacity: dict[str, str] | None = None,
            admin: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"deviceClassName": device_class}
    if cel:
        out["selectors"] = [{"cel": {"expression": cel}}]
    if capacity:
        out["capacity"] = {"requests": capacity}
    if admin:
        out["adminAccess"] = True
    return {"exactly": out}


def create_pod(kube: KubeClient, name: str, *, template: str | None = None, claim: str | None = None,
               extended: dict[str, str] | None = None, namespace: str = NS, pod_claim: str = "gpu") -> dict[str, Any]:
    """A pod whose container "main" uses one claim (named ``pod_claim`` in the pod) from ``template`` or the
    ResourceClaim ``claim``, or asks for the extended resources ``extended``."""
    container: dict[str, Any] = {"name": "main", "image": "registry.k8s.io/pause:3.10"}
    spec: dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": 0}
    if template:
        container["resources"] = {"claims": [{"name": pod_claim}]}
        spec["resourceClaims"] = [{"name": pod_claim, "resourceClaimTemplateName": template}]
    if claim:
        container["resources"] = {"claims": [{"name": pod_claim}]}
        spec["resourceClaims"] = [{"name": pod_claim, "resourceClaimName": claim}]
    if extended:
        container["resources"] = {"requests": extended, "limits": extended}
    out: dict[str, Any] = kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", body={
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})
    return out


@dataclass(frozen=True)
class Prepared:
    pod_status: dict[str, Any]
    claim: dict[str, Any]
    device: str  # the allocated device's name in the ResourceSlice
    cdi_ids: list[str]
    env: list[str]  # the container environment after the CDI reference library injected the IDs


def schedule_and_prepare(c: Cluster, pod: dict[str, Any], *, from_template: bool,
                         while_prepared: Callable[[Pod, str, str], None] | None = None) -> Prepared:
    """Wait for the real scheduler to bind the pod and allocate its claim, prepare it through the kubelet's
    DRA manager, resolve the CDI IDs with the CDI reference library, run ``while_prepared(pod, device,
    CDI ID)``, then unprepare and delete the pod."""
    name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
    path = f"/api/v1/namespaces/{NS}/pods/{name}"
    direct = [r["resourceClaimName"] for r in pod["spec"].get("resourceClaims") or [] if r.get("resourceClaimName")]
    claim_path = ""
    try:
        bound = wait_for(lambda: (p := c.get(path))["spec"].get("nodeName") and p, 60, f"pod {name} scheduled", c)
        assert bound["spec"]["nodeName"] == NODE
        status = bound.get("status") or {}
        hpod_claim, templates = "", {}
        if direct:
            [claim_name] = direct
            [hpod_claim] = [r["name"] for r in pod["spec"]["resourceClaims"]]
        elif from_template:
            [entry] = status["resourceClaimStatuses"]
            claim_name = entry["resourceClaimName"]
            hpod_claim = entry["name"]
            templates = {hpod_claim: next(r["resourceClaimTemplateName"] for r in pod["spec"]["resourceClaims"]
                                          if r["name"] == hpod_claim)}
        else:
            claim_name = status["extendedResourceClaimStatus"]["resourceClaimName"]
        claim_path = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{claim_name}"
        claim = c.get(claim_path)
        if not direct:
            owner = claim["metadata"]["ownerReferences"]
            assert [(o["kind"], o["uid"]) for o in owner] == [("Pod", uid)], owner
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"]) == (DRIVER_NAME, NODE), result
        assert [r["uid"] for r in claim["status"]["reservedFor"]] == [uid]

        # the kubelet gets the pod as the API has it: its claim under the pod's name for it, from a template
        # (the generated claim's name in the status) or by the claim's name; an extended resource's claim
        # under the claim's name
        hpod_claim = hpod_claim or claim_name
        hpod = Pod(NS, name, uid, {hpod_claim: claim_name}, {"main": [hpod_claim]}, templates)
        cdi = c.harness.prepare(hpod)
        claim_uid = claim["metadata"]["uid"]
        share = f"-{result['shareID']}" if result.get("shareID") else ""  # an allocation of a shared GPU
        metadata = f"{DRIVER_NAME}/metadata={claim_uid}_{result['request'].split('/')[0]}"  # KEP-5304
        assert cdi == {"main": [f"{DRIVER_NAME}/claim={claim_uid}-{result['device']}{share}", metadata]}, cdi
        spec_file = c.cdi_dir / f"{DRIVER_NAME}-claim_{claim_uid}.json"
        assert spec_file.is_file()
        out = run_cdi_check([c.cdi_dir], [cdi["main"]])
        assert not any(out["errors"].values()), out["errors"]
        assert set(cdi["main"]) <= set(out["devices"])
        [inj] = out["injections"]
        assert inj["unresolved"] == [] and not inj.get("error"), inj
        env = list(inj["spec"]["process"].get("env") or [])
        # the driver wrote the claim's device status (KEP-4817): the device and its UUID
        entry = wait_for(lambda: next((d for d in (c.get(claim_path).get("status") or {}).get("devices") or []
                                       if (d["driver"], d["device"]) == (DRIVER_NAME, result["device"])), None),
                         20, f"device status of claim {claim_name}", c)
        assert entry["pool"] == NODE and entry.get("shareID") == result.get("shareID"), entry
        assert entry["data"]["uuid"] == uuid_of(c, str(result["device"])), entry
        if while_prepared is not None:
            while_prepared(hpod, str(result["device"]), cdi["main"][0])

        c.harness.unprepare(hpod)
        assert not spec_file.exists()
        gone = run_cdi_check([c.cdi_dir], [cdi["main"]])
        assert not set(cdi["main"]) & set(gone["devices"])
        assert gone["injections"][0]["unresolved"] == cdi["main"]
        return Prepared(status, claim, str(result["device"]), cdi["main"], env)
    finally:
        delete_pod_and_release(c, name, claim_path, extended=not direct and not from_template)


def delete_pod_and_release(c: Cluster, pod_name: str, claim_path: str, *, extended: bool = False,
                           namespace: str = NS) -> None:
    """Delete the pod; wait until its claim (at ``claim_path``, if any) is deallocated by the controller
    manager's resourceclaim controller, or gone."""
    c.plane.apiserver.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{pod_name}?gracePeriodSeconds=0")
    if not claim_path:
        return
    if extended and c.release.minor < 35:
        # The 1.34 resourceclaim controller does not look at pod.status.extendedResourceClaimStatus when
        # a pod goes: delete the claim the way the garbage collector (not run here) would; the
        # controller then drops the reservation, the allocation and its finalizer.
        c.kube.request("DELETE", claim_path)
        wait_for(lambda: c.plane.apiserver.get(claim_path)[0] == 404, 30, f"claim of {pod_name} gone", c)
    else:
        # the pod is gone: the resourceclaim controller drops the reservation and the allocation
        wait_for(lambda: c.plane.apiserver.get(claim_path)[0] == 404
                 or not (c.get(claim_path).get("status") or {}).get("allocation"), 30,
                 f"claim of {pod_name} deallocated", c)


def slice_device(c: Cluster, device: str) -> dict[str, Any]:
    """The device in the node's slices (waiting out a moment without them: the kubelet deletes a node's
    slices when a driver registers, the driver writes them again)."""
    return wait_for(lambda: slice_devices(c.kube).get(device), 20, f"{device} in the ResourceSlices", c)


def uuid_of(c: Cluster, device: str) -> str:
    return str(slice_device(c, device)["attributes"]["uuid"]["string"])


@every
def test_claim_template_for_one_whole_gpu(cluster: Cluster) -> None:
    claim_template(cluster.kube, "one-gpu", "gpu.nodeagent.io")
    pod = create_pod(cluster.kube, "one-gpu", template="one-gpu")
    got = schedule_and_prepare(cluster, pod, from_template=True)
    assert got.device in {"gpu-1", "gpu-2", "gpu-3", "gpu-4"}, got.device
    assert f"NVIDIA_VISIBLE_DEVICES={uuid_of(cluster, got.device)}" in got.env, got.env
    assert got.claim["metadata"]["annotations"]["resource.kubernetes.io/pod-claim-name"] == "gpu"


@every
def test_gpu_chosen_by_uuid_and_by_product_name(cluster: Cluster) -> None:
    by_uuid = uuid_of(cluster, "gpu-2")
    claim_template(cluster.kube, "by-uuid", "gpu.nodeagent.io",
                   f'device.attributes["{DRIVER_NAME}"].uuid == "{by_uuid}"')
    got = schedule_and_prepare(cluster, create_pod(cluster.kube, "by-uuid", template="by-uuid"), from_template=True)
    assert got.device == "gpu-2" and f"NVIDIA_VISIBLE_DEVICES={by_uuid}" in got.env, got

    claim_template(cluster.kube, "by-product", "gpu.nodeagent.io",
                   f'device.attributes["{DRIVER_NAME}"].productName == "NVIDIA A100-SXM4-80GB"')
    got = schedule_and_prepare(cluster, create_pod(cluster.kube, "by-product", template="by-product"),
                               from_template=True)
    assert got.device == "gpu-4", got


@every
def test_claim_template_for_a_mig_device(cluster: Cluster) -> None:
    claim_template(cluster.kube, "one-mig", "mig.gpu.nodeagent.io",
                   f'device.attributes["{DRIVER_NAME}"].profile == "1g.10gb"')
    got = schedule_and_prepare(cluster, create_pod(cluster.kube, "one-mig", template="one-mig"), from_template=True)
    assert got.device in {"gpu-0-mig-1-0", "gpu-0-mig-2-0"}, got.device
    assert f"NVIDIA_VISIBLE_DEVICES={uuid_of(cluster, got.device)}" in got.env, got.env


@every
def test_unchanged_nvidia_gpu_pod_is_served_through_the_extended_resource_class(cluster: Cluster) -> None:
    dc = cluster.get("/apis/resource.k8s.io/v1/deviceclasses/gpu-extended.nodeagent.io")
    assert dc["spec"]["extendedResourceName"] == "nvidia.com/gpu"  # kept: the gate is on (1.34) or GA (1.37)
    pod = create_pod(cluster.kube, "plain-gpu", extended={"nvidia.com/gpu": "1"})
    got = schedule_and_prepare(cluster, pod, from_template=False)
    assert got.device in {"gpu-1", "gpu-2", "gpu-3", "gpu-4"}, got.device
    assert f"NVIDIA_VISIBLE_DEVICES={uuid_of(cluster, got.device)}" in got.env, got.env
    mappings = got.pod_status["extendedResourceClaimStatus"]["requestMappings"]
    assert [(m["containerName"], m["resourceName"]) for m in mappings] == [("main", "nvidia.com/gpu")], mappings
    assert got.claim["metadata"]["name"] == got.pod_status["extendedResourceClaimStatus"]["resourceClaimName"]


@every
def test_xid_marks_the_prepared_device_unhealthy_and_taints_it_until_recovery(cluster: Cluster) -> None:
    """The kubelet sees the allocated device Unhealthy in allocatedResourcesStatus and the slice carries the
    device taint while the GPU has an XID; recovery clears both.

    How the pod names its claim follows what each release's kubelet reports allocatedResourcesStatus for
    (pkg/kubelet/cm/dra/manager.go, UpdateAllocatedResourcesStatus): 1.34.4 matches the container's pod
    claim name with the ResourceClaim's name, so only a claim referenced under its own name is reported
    (never one from a template); 1.35.4 finds the claim only in ``status.resourceClaimStatuses``, which
    the API holds for template claims alone, so only those are reported; 1.36 and later report both. The
    test uses a claim referenced under its own name on 1.34 and a template claim from 1.35 on."""

    def xid(pod: Pod, device: str, cdi_id: str) -> None:
        index = int(device.removeprefix("gpu-"))
        assert resource_health(cluster.harness, pod) == {cdi_id: "Healthy"}
        cluster.loop.run(cluster.dra.set_health({(index, None): "XID 79"}))
        wait_for(lambda: resource_health(cluster.harness, pod) == {cdi_id: "Unhealthy"}, 20, "Unhealthy", cluster)
        taints = wait_for(lambda: slice_device(cluster, device).get("taints"), 20, "device taint", cluster)
        assert [t["key"] for t in taints] == [UNHEALTHY_TAINT_KEY]
        cluster.loop.run(cluster.dra.set_health({}))
        wait_for(lambda: resource_health(cluster.harness, pod) == {cdi_id: "Healthy"}, 20, "Healthy again", cluster)
        wait_for(lambda: "taints" not in slice_device(cluster, device), 20, "taint removed", cluster)

    if cluster.release.minor == 34:
        make_claim(cluster.kube, "xid-gpu", exactly("gpu.nodeagent.io"))
        pod = create_pod(cluster.kube, "xid-gpu", claim="xid-gpu", pod_claim="xid-gpu")
    else:
        claim_template(cluster.kube, "xid-gpu", "gpu.nodeagent.io")
        pod = create_pod(cluster.kube, "xid-gpu", template="xid-gpu")
    got = schedule_and_prepare(cluster, pod, from_template=cluster.release.minor != 34, while_prepared=xid)
    assert got.device.startswith("gpu-") and "mig" not in got.device

@every
def test_prioritized_list_falls_back_to_a_whole_gpu_when_the_mig_choice_is_exhausted(cluster: Cluster) -> None:
    """A claim asking first for a MIG 3g device on NUMA node 0 (the standard attribute; there is none), else a
    whole GPU: allocated as the subrequest ``gpu/whole``, which prepare answers under that name; with a
    1g.10gb MIG device first (gpu-0 sits on NUMA node 0), the first choice is taken."""
    def first_available(profile: str) -> dict[str, Any]:
        numa0 = ('has(device.attributes["resource.kubernetes.io"].numaNode) && '
                 'device.attributes["resource.kubernetes.io"].numaNode == 0')
        return {"firstAvailable": [
            {"name": "mig", "deviceClassName": "mig.gpu.nodeagent.io", "selectors": [
                {"cel": {"expression": f'device.attributes["{DRIVER_NAME}"].profile == "{profile}" && {numa0}'}}]},
            {"name": "whole", "deviceClassName": "gpu.nodeagent.io"},
        ]}

    make_claim(cluster.kube, "mig3g-or-gpu", first_available("3g.40gb"))
    got = schedule_and_prepare(cluster, create_pod(cluster.kube, "mig3g-or-gpu", claim="mig3g-or-gpu"),
                               from_template=False)
    [result] = got.claim["status"]["allocation"]["devices"]["results"]
    assert result["request"] == "gpu/whole" and got.device in {"gpu-1", "gpu-2", "gpu-3", "gpu-4"}, result
    assert f"NVIDIA_VISIBLE_DEVICES={uuid_of(cluster, got.device)}" in got.env

    make_claim(cluster.kube, "mig1g-or-gpu", first_available("1g.10gb"))
    got = schedule_and_prepare(cluster, create_pod(cluster.kube, "mig1g-or-gpu", claim="mig1g-or-gpu"),
                               from_template=False)
    [result] = got.claim["status"]["allocation"]["devices"]["results"]
    assert result["request"] == "gpu/mig" and got.device in {"gpu-0-mig-1-0", "gpu-0-mig-2-0"}, result


@every
def test_an_admin_access_claim_reaches_a_gpu_in_use_without_holding_it(cluster: Cluster) -> None:
    """A monitoring pod's admin-access claim is allocated the GPU another pod holds, is prepared beside it,
    and is not a holder of that GPU (a MIG change waits for the user only)."""
    uuid = uuid_of(cluster, "gpu-3")
    cel = f'device.attributes["{DRIVER_NAME}"].uuid == "{uuid}"'
    mon = "dra-monitoring"
    cluster.kube.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": mon, "labels": {"resource.kubernetes.io/admin-access": "true"}}})
    make_claim(cluster.kube, "admin-gpu3", exactly("gpu.nodeagent.io", cel, admin=True), namespace=mon)
    make_claim(cluster.kube, "user-gpu3", exactly("gpu.nodeagent.io", cel))

    def user_holds(pod: Pod, device: str, cdi_id: str) -> None:
        assert device == "gpu-3"
        admin_pod = create_pod(cluster.kube, "monitor", claim="admin-gpu3", namespace=mon)
        path = f"/api/v1/namespaces/{mon}/pods/monitor"
        claim_path = f"/apis/resource.k8s.io/v1/namespaces/{mon}/resourceclaims/admin-gpu3"
        try:
            wait_for(lambda: cluster.get(path)["spec"].get("nodeName"), 60, "monitor scheduled", cluster)
            name = "admin-gpu3"
            claim = cluster.get(claim_path)
            [result] = claim["status"]["allocation"]["devices"]["results"]
            assert (result["device"], result.get("adminAccess")) == ("gpu-3", True), result
            hpod = Pod(mon, "monitor", admin_pod["metadata"]["uid"], {name: name}, {"main": [name]})
            cdi = cluster.harness.prepare(hpod)
            cuid = claim["metadata"]["uid"]
            assert cdi == {"main": [f"{DRIVER_NAME}/claim={cuid}-gpu-3",
                                    f"{DRIVER_NAME}/metadata={cuid}_{result['request']}"]}, cdi
            holders = cluster.dra.claims_on(frozenset({3}))
            assert [(r.namespace, r.name) for r in holders[3]] == [(NS, pod.claims[next(iter(pod.claims))])], holders
            cluster.harness.unprepare(hpod)
        finally:
            delete_pod_and_release(cluster, "monitor", claim_path, namespace=mon)

    schedule_and_prepare(cluster, create_pod(cluster.kube, "user-gpu3", claim="user-gpu3"), from_template=False,
                         while_prepared=user_holds)


@pytest.mark.parametrize("cluster", [r for r in RELEASES if r.minor >= 37], ids=lambda r: r.version, indirect=True)
def test_an_admins_noexecute_device_taint_rule_evicts_the_pod_using_the_device(cluster: Cluster) -> None:
    """Device taints (GA in 1.37): a DeviceTaintRule with NoExecute on a nodeagent device makes the
    controller manager's device-taint eviction controller delete the pod whose claim holds it."""
    uuid = uuid_of(cluster, "gpu-2")
    make_claim(cluster.kube, "tainted-gpu", exactly("gpu.nodeagent.io", f'device.attributes["{DRIVER_NAME}"].uuid == "{uuid}"'))
    pod = create_pod(cluster.kube, "tainted-gpu", claim="tainted-gpu")
    rules = "/apis/resource.k8s.io/v1/devicetaintrules"

    def taint_while_prepared(hpod: Pod, device: str, cdi_id: str) -> None:
        assert device == "gpu-2"
        cluster.kube.request("POST", rules, body={
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": "drain-gpu-2"},
            "spec": {"deviceSelector": {"driver": DRIVER_NAME, "pool": NODE, "device": "gpu-2"},
                     "taint": {"key": "example.com/maintenance", "value": "gpu-2", "effect": "NoExecute"}}})
        try:
            path = f"/api/v1/namespaces/{NS}/pods/tainted-gpu"
            # the eviction controller deletes the pod (no kubelet runs to finish a graceful deletion: it is gone
            # at once or marked deleted)
            def evicted() -> bool:  # one read: the pod may go between two
                status, body = cluster.plane.apiserver.get(path)
                return status == 404 or (status == 200 and bool(yaml.safe_load(body)["metadata"].get("deletionTimestamp")))

            wait_for(evicted, 60, "pod evicted", cluster)
        finally:
            cluster.kube.request("DELETE", f"{rules}/drain-gpu-2")

    got = schedule_and_prepare(cluster, pod, from_template=False, while_prepared=taint_while_prepared)
    assert got.device == "gpu-2"


@every
def test_rbac_dra_writes_device_status_and_from_1_36_only_for_claims_on_its_own_node(cluster: Cluster) -> None:
    """The agent's role (rbac-dra.yaml) alone, without the admission policy, writes a claim's status.devices;
    from 1.36 the API server checks the write per driver (resourceclaims/driver) and the role's associated-node
    verb refuses a token of another node. Earlier releases do not check per driver: there any token with the
    role may write it, which is why admission-policy.yaml confines these writes on every release
    (tests/e2e/test_kube_confinement.py)."""
    import json

    from nodeagent.dra.status import ClaimStatusWriter
    from tests.integration.test_dra_slices import SA_USER, apply

    for doc in yaml.safe_load_all((MANIFESTS / "rbac-dra.yaml").read_text()):
        status, body = apply(cluster.plane.apiserver, doc)
        assert status in (200, 201), body

    def as_agent_on(node: str) -> KubeClient:
        api = connect(cluster.plane.apiserver.kubeconfig)
        api.set_default_header("Impersonate-User", SA_USER)  # type: ignore[no-untyped-call]
        api.set_default_header(  # type: ignore[no-untyped-call]
            "Impersonate-Extra-authentication.kubernetes.io%2fnode-name", node)
        return KubeClient(api)

    name = "status-probe"
    make_claim(cluster.kube, name, exactly("gpu.nodeagent.io"))
    path = claim_path_of(name)
    claim = cluster.get(path)
    claim["status"] = {"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": DRIVER_NAME, "pool": NODE, "device": "gpu-1"}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}}}
    cluster.kube.request("PUT", f"{path}/status", body=claim)  # allocated as the scheduler would
    uid = claim["metadata"]["uid"]
    entry = {"driver": DRIVER_NAME, "pool": NODE, "device": "gpu-1", "data": {"uuid": uuid_of(cluster, "gpu-1")}}
    own, other = as_agent_on(NODE), as_agent_on("another-node")
    try:
        assert ClaimStatusWriter(own, DRIVER_NAME).write(NS, name, uid, [entry])
        def devices() -> list[dict[str, Any]]:
            return [{k: v for k, v in d.items() if v is not None} for d in cluster.get(path)["status"]["devices"]]

        assert devices() == [entry]
        changed = {**entry, "data": {"uuid": "GPU-from-another-node"}}
        wrote = ClaimStatusWriter(other, DRIVER_NAME).write(NS, name, uid, [changed])
        assert wrote is (cluster.release.minor < 36), cluster.release.version
        assert devices() == [changed if wrote else entry]
        # the role reads one claim and writes its status; it neither lists nor changes claims
        code, review = cluster.plane.apiserver.request(
            "POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", body={
                "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {
                    "user": SA_USER, "resourceAttributes": {
                        "group": "resource.k8s.io", "resource": "resourceclaims", "verb": "update",
                        "namespace": NS, "name": name}}})
        assert code == 201 and json.loads(review)["status"]["allowed"] is False, review
    finally:
        own.close()
        other.close()
        claim = cluster.get(path)
        claim["status"] = {}
        cluster.kube.request("PUT", f"{path}/status", body=claim)
        cluster.kube.request("DELETE", path)


def claim_path_of(name: str) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{name}"


def unschedulable(c: Cluster, pod_name: str) -> bool:
    pod = c.get(f"/api/v1/namespaces/{NS}/pods/{pod_name}")
    conds = {x["type"]: x for x in (pod.get("status") or {}).get("conditions") or []}
    sched = conds.get("PodScheduled", {})
    return not pod["spec"].get("nodeName") and sched.get("reason") == "Unschedulable"


@every
def test_a_shared_gpu_takes_claims_until_its_memory_is_used_up(cluster: Cluster) -> None:
    """Consumable capacity with the release's scheduler: three claims of 30 GiB on a GPU of 81559 MiB, two
    at a time; the third waits Unschedulable until one is released. Each prepared share gets its own CDI
    device and its memory limit. A release without the feature gets the GPU as an ordinary device."""
    from nodeagent.dra.slices import consumable_capacity_for

    dev = slice_device(cluster, f"gpu-{SHARED_GPU}")
    if not consumable_capacity_for(cluster.release.version):
        assert "allowMultipleAllocations" not in dev and dev["capacity"] == {"memory": {"value": "81559Mi"}}, dev
        return
    assert dev["allowMultipleAllocations"] is True and "requestPolicy" in dev["capacity"]["memory"], dev
    uuid = uuid_of(cluster, f"gpu-{SHARED_GPU}")
    names = ["share-a", "share-b", "share-c"]
    for n in names:
        make_claim(cluster.kube, n, exactly("gpu.nodeagent.io", f'device.attributes["{DRIVER_NAME}"].uuid == "{uuid}"',
                                            capacity={"memory": "30Gi"}))
    pods = {n: create_pod(cluster.kube, n, claim=n) for n in names}
    prepared: dict[str, Pod] = {}
    try:
        def two_bound() -> list[str] | None:
            bound = [n for n in names if cluster.get(f"/api/v1/namespaces/{NS}/pods/{n}")["spec"].get("nodeName")]
            return bound if len(bound) == 2 else None

        bound = wait_for(two_bound, 60, "two of three shared pods scheduled", cluster)
        [waiting] = [n for n in names if n not in bound]
        wait_for(lambda: unschedulable(cluster, waiting), 30, f"{waiting} Unschedulable", cluster)

        def prepare(name: str) -> tuple[str, list[str]]:
            claim = cluster.get(claim_path_of(name))  # each pod uses the claim of its own name
            [result] = claim["status"]["allocation"]["devices"]["results"]
            assert result["device"] == f"gpu-{SHARED_GPU}" and result["consumedCapacity"]["memory"] == "30Gi", result
            cname, cuid = claim["metadata"]["name"], claim["metadata"]["uid"]
            hpod = Pod(NS, name, pods[name]["metadata"]["uid"], {cname: cname}, {"main": [cname]})
            cdi = cluster.harness.prepare(hpod)
            prepared[name] = hpod
            assert cdi == {"main": [f"{DRIVER_NAME}/claim={cuid}-gpu-{SHARED_GPU}-{result['shareID']}",
                                    f"{DRIVER_NAME}/metadata={cuid}_{result['request']}"]}, cdi
            out = run_cdi_check([cluster.cdi_dir], [cdi["main"]])
            [inj] = out["injections"]
            assert inj["unresolved"] == [] and not inj.get("error"), inj
            return str(result["shareID"]), list(inj["spec"]["process"].get("env") or [])

        shares = [prepare(n) for n in bound]
        assert shares[0][0] != shares[1][0]  # two allocations of one device, told apart by their share IDs
        for _, env in shares:
            assert f"NVIDIA_VISIBLE_DEVICES={uuid}" in env and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=30720M" in env, env

        # release one: its claim is deallocated and the waiting pod is scheduled onto the same GPU
        cluster.harness.unprepare(prepared.pop(bound[0]))
        delete_pod_and_release(cluster, bound[0], claim_path_of(bound[0]))
        wait_for(lambda: cluster.get(f"/api/v1/namespaces/{NS}/pods/{waiting}")["spec"].get("nodeName"), 60,
                 f"{waiting} scheduled once a share is released", cluster)
        share_id, env = prepare(waiting)
        assert share_id not in {s for s, _ in shares} and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=30720M" in env
    finally:
        for hpod in prepared.values():
            cluster.harness.unprepare(hpod)
        for n in names:
            if cluster.plane.apiserver.get(f"/api/v1/namespaces/{NS}/pods/{n}")[0] != 404:
                delete_pod_and_release(cluster, n, claim_path_of(n))


AGENT_CHILD = """
import asyncio, os, signal, sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from nodeagent.dra.checkpoint import Checkpoint
from nodeagent.dra.component import DraComponent
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient, connect
from tests.integration.test_dra_scheduling import INVENTORY

if {kill!r}:
    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 after the claim's CDI spec, before its record
    Checkpoint.put = killed

async def main():
    dra = DraComponent(paths=HostPaths(Path({root!r})), kube=KubeClient(connect(Path({kubeconfig!r}))),
                       node_name={node!r}, verify_interval_s=0.5)
    await dra.start(INVENTORY)
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@every
def test_agent_killed_during_prepare_is_finished_by_the_restarted_agent(cluster: Cluster) -> None:
    """The DRA driver process dies (kill -9) inside NodePrepareResources of a scheduler-allocated claim;
    the restarted agent cleans up what was half done and the kubelet's retry prepares the claim."""
    import subprocess
    import sys

    from nodeagent.dra.component import CHECKPOINT_NAME
    from tests.peers._proc import stop_process
    from tests.peers.draharness import DraHarnessError

    node = "dra-sched-kill"
    repo = str(Path(__file__).resolve().parents[2])
    root = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    simhost.materialise(HostPaths(root), INVENTORY)
    kubeconfig = cluster.plane.apiserver.kubeconfig
    agents: list[subprocess.Popen[str]] = []

    def agent(kill: bool) -> subprocess.Popen[str]:
        code = AGENT_CHILD.format(repo=repo, kill=kill, root=str(root), kubeconfig=str(kubeconfig), node=node)
        log = root / f"agent-{len(agents)}.log"
        with log.open("w") as err:
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True,
                                    cwd=repo)
        agents.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n", log.read_text()
        return proc

    cluster.kube.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": node, "labels": {"kubernetes.io/hostname": node}}})
    try:
        n = cluster.get(f"/api/v1/nodes/{node}")
        n["status"] = cluster.get(f"/api/v1/nodes/{NODE}")["status"]
        cluster.kube.request("PUT", f"/api/v1/nodes/{node}/status", body=n)
        n = cluster.get(f"/api/v1/nodes/{node}")
        n["spec"].pop("taints", None)
        cluster.kube.request("PUT", f"/api/v1/nodes/{node}", body=n)
        first = agent(kill=True)
        registry = root / "var/lib/kubelet/plugins_registry"
        with running_dra_harness(kubeconfig, registry, node, binary=cluster.release.dra_harness()) as h:
            h.wait_registered(DRIVER_NAME)
            wait_for(lambda: len(cluster.kube.list_resource_slices(field_selector=f"spec.nodeName={node}")), 30,
                     "the second node's ResourceSlices", cluster)
            claim_template(cluster.kube, "kill-gpu", "gpu.nodeagent.io")
            body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kill-gpu"}, "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                "resources": {"claims": [{"name": "gpu"}]}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "kill-gpu"}]}}
            pod = cluster.kube.request("POST", f"/api/v1/namespaces/{NS}/pods", body=body)
            path = f"/api/v1/namespaces/{NS}/pods/kill-gpu"
            bound = wait_for(lambda: (p := cluster.get(path))["spec"].get("nodeName") and p, 60, "pod scheduled",
                             cluster)
            assert bound["spec"]["nodeName"] == node
            claim_name = bound["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
            claim = cluster.get(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{claim_name}")
            claim_uid = claim["metadata"]["uid"]
            [result] = claim["status"]["allocation"]["devices"]["results"]
            hpod = Pod(NS, "kill-gpu", pod["metadata"]["uid"], {claim_name: claim_name}, {"main": [claim_name]})
            spec_file = root / "var/run/cdi" / f"{DRIVER_NAME}-claim_{claim_uid}.json"

            with pytest.raises(DraHarnessError):
                h.prepare(hpod)
            assert first.wait(10) == -9
            assert spec_file.exists()  # half done: the spec was written, the record was not

            second = agent(kill=False)
            assert not spec_file.exists()  # the orphaned spec is gone before the driver registers again

            def prepared() -> dict[str, list[str]] | None:
                try:
                    return h.prepare(hpod)
                except DraHarnessError:  # the kubelet retries until the new registration is in use
                    return None

            cdi = wait_for(prepared, 30, "prepare after the restart", cluster)
            assert cdi == {"main": [f"{DRIVER_NAME}/claim={claim_uid}-{result['device']}",
                                    f"{DRIVER_NAME}/metadata={claim_uid}_{result['request']}"]}
            checkpoint = (root / "var/lib/nodeagent" / CHECKPOINT_NAME).read_text()
            assert claim_uid in checkpoint and spec_file.exists()
            out = run_cdi_check([root / "var/run/cdi"], [cdi["main"]])
            assert out["injections"][0]["unresolved"] == [] and not out["injections"][0].get("error")

            def unprepared() -> bool | None:
                try:
                    h.unprepare(hpod)
                    return True
                except DraHarnessError:  # a connection to the first registration closing under the call: again
                    return None

            wait_for(unprepared, 30, "unprepare after the restart", cluster)
            assert not spec_file.exists()
            stop_process(second)
    finally:
        for p in agents:
            stop_process(p)
            if p.stdout is not None:
                p.stdout.close()
        cluster.plane.apiserver.request("DELETE", f"/api/v1/namespaces/{NS}/pods/kill-gpu?gracePeriodSeconds=0")
        for s in cluster.kube.list_resource_slices(field_selector=f"spec.nodeName={node}"):
            cluster.kube.request("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{s['metadata']['name']}")
        cluster.kube.request("DELETE", f"/api/v1/nodes/{node}")
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("cluster", RELEASES[:1], ids=lambda r: r.version, indirect=True)
def test_compute_domain_pods_land_in_the_one_clique_of_its_template(cluster: Cluster) -> None:
    """The template ``nodeagent controller`` makes for a ComputeDomain, pinned to one clique, is honoured by the
    real scheduler: with two nodes in each of two cliques (each publishing the one channel device ``channel-0``
    as nodeagent's DRA plane does), the domain's pods take the channels of its clique's two nodes, and a third
    pod stays pending though the other clique has free channels."""
    from nodeagent.computedomain import reconcile as rc
    from nodeagent.dra import channels

    kube = cluster.kube
    cliques = {"cdsched-a1": "c0ffee00-0000-4000-8000-000000000001.1",
               "cdsched-a2": "c0ffee00-0000-4000-8000-000000000001.1",
               "cdsched-b1": "c0ffee00-0000-4000-8000-000000000001.2",
               "cdsched-b2": "c0ffee00-0000-4000-8000-000000000001.2"}
    pinned = cliques["cdsched-b1"]
    for doc in yaml.safe_load_all((MANIFESTS / "computedomain-controller.yaml").read_text()):
        if doc and doc["kind"] == "DeviceClass":
            kube.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", body=doc)
    resources = {"cpu": "8", "memory": "64Gi", "pods": "110"}
    pods = [f"cd-pod-{i}" for i in range(3)]
    try:
        for name, clique in cliques.items():
            kube.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": name, "labels": {"kubernetes.io/hostname": name, channels.CLIQUE_LABEL: clique}}})
            node = kube.request("GET", f"/api/v1/nodes/{name}")
            node["status"] = {"capacity": resources, "allocatable": resources, "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated node"}]}
            kube.request("PUT", f"/api/v1/nodes/{name}/status", body=node)
            node = kube.request("GET", f"/api/v1/nodes/{name}")
            node["spec"].pop("taints", None)
            kube.request("PUT", f"/api/v1/nodes/{name}", body=node)
            kube.create_resource_slice({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{name}-ch"},
                "spec": {"driver": DRIVER_NAME, "nodeName": name,
                         "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
                         "devices": [channels.channel_device(clique)]}})
        domain = rc.Domain(NS, "job", "00000000-0000-4000-8000-00000000cd01", "job-channel", "Single", 0)
        template = rc.desired_template(domain, pinned)
        del template["metadata"]["ownerReferences"]  # no ComputeDomain CRD on this API server
        kube.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates", body=template)
        for p in pods:
            create_pod(kube, p, template=domain.template, pod_claim="channel")

        def placed() -> dict[str, str] | None:
            got = {p: kube.request("GET", f"/api/v1/namespaces/{NS}/pods/{p}")["spec"].get("nodeName", "")
                   for p in pods}
            return got if sum(1 for n in got.values() if n) >= 2 else None

        got = wait_for(placed, 30, "two of the domain's pods scheduled", cluster)
        assert sorted(n for n in got.values() if n) == ["cdsched-b1", "cdsched-b2"], got
        pending = next(p for p, n in got.items() if not n)

        def unschedulable() -> bool:
            conds = kube.request("GET", f"/api/v1/namespaces/{NS}/pods/{pending}").get("status", {}).get(
                "conditions") or []
            return any(c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds)

        wait_for(unschedulable, 30, "the third pod found unschedulable", cluster)
        assert not kube.request("GET", f"/api/v1/namespaces/{NS}/pods/{pending}")["spec"].get("nodeName")
    finally:
        for p in pods:
            kube.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{p}", query={"gracePeriodSeconds": 0})
        kube.request("DELETE", f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates/job-channel")
        for name in cliques:
            kube.delete_resource_slice(f"{name}-ch")
            kube.request("DELETE", f"/api/v1/nodes/{name}")
