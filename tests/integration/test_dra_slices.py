"""ResourceSlices of the DRA pool on the REAL kube-apiserver (resource.k8s.io/v1): the server accepts what
we build, writes happen only on change, the pool generation moves, large pools split, slices go away on
shutdown; the DRA RBAC manifest is enough (and no more) for all of it; the DeviceClass manifests apply."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent.dra.devices import build_devices
from nodeagent.dra.publisher import SlicePublisher
from nodeagent.dra.slices import UNHEALTHY_TAINT_KEY, pool_content
from nodeagent.errors import KubeError
from nodeagent.kube.client import KubeClient, connect
from tests.peers.apiserver import KubeApiServer
from tests.unit._dp_inventories import mig_box, nvswitch_box

pytestmark = pytest.mark.peers

MANIFESTS = Path(__file__).resolve().parents[2] / "packaging/kubernetes"
SA_USER = "system:serviceaccount:nodeagent:nodeagent"


def slices_of(kube: KubeClient, node: str) -> list[dict[str, Any]]:
    items = kube.list_resource_slices(field_selector=f"spec.nodeName={node},spec.driver=gpu.nodeagent.io")
    return sorted(items, key=lambda s: str(s["metadata"]["name"]))


def apply(server: KubeApiServer, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    plural = {"ClusterRole": "clusterroles", "ClusterRoleBinding": "clusterrolebindings",
              "DeviceClass": "deviceclasses"}[doc["kind"]]
    path = f"/apis/{doc['apiVersion']}/{plural}/{doc['metadata']['name']}"
    status, body = server.request(
        "PATCH", path + "?fieldManager=nodeagent-test&fieldValidation=Strict&force=true",
        json.dumps(doc).encode(), content_type="application/apply-patch+yaml")
    return status, json.loads(body or b"{}")


def test_the_api_server_serves_resource_v1(kube_apiserver: KubeApiServer) -> None:
    status, body = kube_apiserver.get("/apis/resource.k8s.io/v1")
    assert status == 200, body
    kinds = {r["kind"] for r in json.loads(body)["resources"]}
    assert {"ResourceSlice", "ResourceClaim", "DeviceClass"} <= kinds


def test_publish_writes_only_on_change_and_bumps_the_generation(kube: KubeClient, node_name: str) -> None:
    inv = nvswitch_box(2)
    pub = SlicePublisher(kube, node_name)
    first = pub.sync(pool_content(build_devices(inv)))
    assert (first.generation, first.writes, first.slices) == (1, 1, 1)
    [s] = slices_of(kube, node_name)
    assert s["spec"]["pool"] == {"name": node_name, "generation": 1, "resourceSliceCount": 1}
    devs = {d["name"]: d for d in s["spec"]["devices"]}
    assert sorted(devs) == ["gpu-0", "gpu-1"]
    attrs = devs["gpu-0"]["attributes"]
    assert attrs["resource.kubernetes.io/pciBusID"] == {"string": "0000:10:00.0"}
    assert attrs["cudaComputeCapability"] == {"version": "9.0.0"}
    assert devs["gpu-0"]["capacity"] == {"memory": {"value": "81559Mi"}}

    writes = kube.stats.writes
    assert pub.sync(pool_content(build_devices(inv))).writes == 0
    # a restarted agent adopts the identical slices without writing
    again = SlicePublisher(kube, node_name).sync(pool_content(build_devices(inv)))
    assert (again.generation, again.writes) == (1, 0)
    assert kube.stats.writes == writes

    # a GPU falls off the bus: one replace, generation 2
    lost = replace(inv, gpus=(inv.gpus[0], replace(inv.gpus[1], lost=True)))
    second = pub.sync(pool_content(build_devices(lost)))
    assert (second.generation, second.writes) == (2, 1)
    [s] = slices_of(kube, node_name)
    assert s["spec"]["pool"]["generation"] == 2
    assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0"]

    assert pub.remove() == 1
    assert slices_of(kube, node_name) == []


def test_large_pools_split_and_shrink(kube: KubeClient, node_name: str) -> None:
    pub = SlicePublisher(kube, node_name, max_devices=4)
    many = build_devices(mig_box(per_gpu=7, gpus_on=2, gpus_off=1))  # 15 devices
    r = pub.sync(pool_content(many))
    assert (r.slices, r.writes) == (4, 4)
    got = slices_of(kube, node_name)
    assert [len(s["spec"]["devices"]) for s in got] == [4, 4, 4, 3]
    assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in got} == {(1, 4)}
    names = [d["name"] for s in got for d in s["spec"]["devices"]]
    assert sorted(names) == sorted(d.name for d in many)

    r = pub.sync(pool_content(many[:5]))
    assert (r.generation, r.slices, r.writes) == (2, 2, 4)  # two replaced, two deleted
    got = slices_of(kube, node_name)
    assert [len(s["spec"]["devices"]) for s in got] == [4, 1]
    assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in got} == {(2, 2)}
    pub.remove()


def test_the_full_128_device_limit_is_accepted(kube: KubeClient, node_name: str) -> None:
    inv = mig_box(per_gpu=7, gpus_on=19, gpus_off=0)  # 133 MIG devices
    pub = SlicePublisher(kube, node_name)
    r = pub.sync(pool_content(build_devices(inv)))
    assert r.slices == 2
    assert [len(s["spec"]["devices"]) for s in slices_of(kube, node_name)] == [128, 5]
    pub.remove()


def test_unhealthy_device_taint_round_trip(kube: KubeClient, node_name: str) -> None:
    devs = build_devices(nvswitch_box(2))
    pub = SlicePublisher(kube, node_name)
    pub.sync(pool_content(devs))
    r = pub.sync(pool_content(devs, {"gpu-1": "XID 79"}))
    assert r.generation == 2
    [s] = slices_of(kube, node_name)
    by_name = {d["name"]: d for d in s["spec"]["devices"]}
    taints = by_name["gpu-1"].get("taints")
    if taints is None:
        pytest.fail("the API server dropped the device taint (DRADeviceTaints is off on this server)")
    assert [(t["key"], t["value"], t["effect"]) for t in taints] == [(UNHEALTHY_TAINT_KEY, "XID-79", "NoSchedule")]
    assert "taints" not in by_name["gpu-0"]
    r = pub.sync(pool_content(devs))
    assert r.generation == 3
    [s] = slices_of(kube, node_name)
    assert all("taints" not in d for d in s["spec"]["devices"])
    pub.remove()


@pytest.fixture
def sa_kube(kube_apiserver: KubeApiServer, node_name: str) -> Iterator[KubeClient]:
    """A client acting as the agent's ServiceAccount on ``node_name`` (the node-name claim of the token the
    kubelet projects, which admission-policy.yaml compares with), bound only by rbac-dra.yaml's ClusterRole."""
    for doc in yaml.safe_load_all((MANIFESTS / "rbac-dra.yaml").read_text()):
        status, body = apply(kube_apiserver, doc)
        assert status in (200, 201), body
    api = connect(kube_apiserver.kubeconfig)
    api.set_default_header("Impersonate-User", SA_USER)  # type: ignore[no-untyped-call]
    api.set_default_header(  # type: ignore[no-untyped-call]
        "Impersonate-Extra-authentication.kubernetes.io%2fnode-name", node_name)
    k = KubeClient(api)
    yield k
    k.close()


def test_rbac_dra_is_enough_for_publishing_and_preparing(sa_kube: KubeClient, kube: KubeClient,
                                                         node_name: str) -> None:
    pub = SlicePublisher(sa_kube, node_name, max_devices=1)
    devs = build_devices(nvswitch_box(3))
    assert pub.sync(pool_content(devs)).writes == 3  # list + create
    assert pub.sync(pool_content(devs[:2])).writes == 3  # update + delete
    kube.request("POST", "/api/v1/namespaces/default/configmaps",
                 body={"metadata": {"name": f"{node_name}-probe"}})  # admin works; the SA must not
    with pytest.raises(KubeError) as denied:
        sa_kube.request("GET", f"/api/v1/namespaces/default/configmaps/{node_name}-probe")
    assert denied.value.status == 403
    with pytest.raises(KubeError) as denied:
        sa_kube.request("GET", "/apis/resource.k8s.io/v1/resourceclaims")  # get one claim only, no listing
    assert denied.value.status == 403
    with pytest.raises(KubeError) as missing:
        sa_kube.get_resource_claim("default", "no-such-claim")
    assert missing.value.status == 404  # allowed to read claims; this one just does not exist
    assert pub.remove() == 2
    kube.request("DELETE", f"/api/v1/namespaces/default/configmaps/{node_name}-probe")


def test_device_classes_apply(kube_apiserver: KubeApiServer) -> None:
    docs = [d for d in yaml.safe_load_all((MANIFESTS / "deviceclass.yaml").read_text()) if d]
    assert {d["metadata"]["name"] for d in docs} == {"gpu.nodeagent.io", "mig.gpu.nodeagent.io",
                                                 "vfio.gpu.nodeagent.io"}
    for doc in docs:
        status, body = apply(kube_apiserver, doc)
        assert status in (200, 201), body
        assert body["spec"]["selectors"] == doc["spec"]["selectors"]


def test_extended_resource_class_applies_and_needs_the_gate_before_1_36(kube_apiserver: KubeApiServer) -> None:
    [doc] = [d for d in yaml.safe_load_all((MANIFESTS / "deviceclass-extended-resource.yaml").read_text()) if d]
    assert doc["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    status, body = apply(kube_apiserver, doc)
    assert status in (200, 201), body
    minor = int(kube_apiserver.version.split(".")[1]) if kube_apiserver.version.startswith("v1.") else 0
    if minor >= 36:
        assert body["spec"].get("extendedResourceName") == "nvidia.com/gpu"
    else:
        # the test API server runs without DRAExtendedResource: the field is dropped, as the file says
        assert minor in (34, 35), kube_apiserver.version
        assert "extendedResourceName" not in body["spec"]
    assert body["spec"]["selectors"] == doc["spec"]["selectors"]
