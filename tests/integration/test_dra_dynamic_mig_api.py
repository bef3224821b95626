"""Dynamic MIG pools on the REAL kube-apiserver: the placement devices and shared counters of every
simulated MIG machine (all GPUs in MIG mode) pass the server's ResourceSlice validation in the layout its
version requires, come back with counters intact (the DRAPartitionableDevices fields are not dropped),
and the server rejects the other layout (and, on 1.34, a device consuming an unknown counter), on both
releases of tests/integration/_releases.py; the component publishes
placements only on GPUs without a static layout and writes nothing when a prepared instance shows up."""

from __future__ import annotations

import copy
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.dra.component import DraComponent
from nodeagent.dra.devices import build_counter_sets, build_devices
from nodeagent.dra.publisher import SlicePublisher
from nodeagent.dra.service import ClaimRef
from nodeagent.dra.slices import LAYOUT_INLINE, LAYOUT_SEPARATE, build_slices, layout_for, pool_content
from nodeagent.errors import KubeError
from nodeagent.gpu.inventory import Gpu, Inventory
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator.machine import load_machine
from nodeagent.simulator.open import open_sim
from tests.integration._releases import shared_release_apiserver
from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers

kube_apiserver = shared_release_apiserver  # every test once per Kubernetes release, on servers shared with other modules

MACHINES = ["dgx-a100-40gb", "dgx-h100", "a30x4", "rtx-pro-6000", "dgx-b200", "hgx-h200"]


def mig_inventory(machine: str) -> Inventory:
    adapter = adapter_for_sim(open_sim(machine))
    for i in range(len(load_machine(machine).gpus)):
        if adapter.set_mig_mode(i, True):
            adapter.reset_gpu(i)
    return adapter.discover()


def dynamic(gpu: Gpu) -> bool:
    return True


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory: the kubelet socket paths below it must fit a Unix socket name."""
    d = Path(tempfile.mkdtemp(prefix="dmig-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def slices_of(kube: KubeClient, node: str) -> list[dict[str, Any]]:
    items = kube.list_resource_slices(field_selector=f"spec.nodeName={node},spec.driver=gpu.nodeagent.io")
    return sorted(items, key=lambda s: str(s["metadata"]["name"]))


@pytest.mark.parametrize("machine", MACHINES)
def test_the_server_accepts_every_models_dynamic_pool(kube: KubeClient, kube_apiserver: KubeApiServer,
                                                      node_name: str, machine: str) -> None:
    inv = mig_inventory(machine)
    devs = build_devices(inv, dynamic_mig=dynamic)
    content = pool_content(devs, None, build_counter_sets(devs, inv))
    pub = SlicePublisher(kube, node_name)
    r = pub.sync(content)
    assert pub.layout == layout_for(kube_apiserver.version)
    assert r.writes == r.slices >= 1
    got = slices_of(kube, node_name)
    published = [d for s in got for d in s["spec"].get("devices", [])]
    assert sorted(d["name"] for d in published) == sorted(d.name for d in devs)
    sets = {cs["name"]: cs for s in got for cs in s["spec"].get("sharedCounters", [])}
    assert sorted(sets) == sorted(f"gpu-{g.index}-counters" for g in inv.gpus)
    # the server kept the counters and consumptions as written
    assert sets["gpu-0-counters"]["counters"]["memory-slice-0"] == {"value": "1"}
    by_name = {d["name"]: d for d in published}
    some = next(d for d in devs if d.placement is not None and d.placement.size > 1)
    assert by_name[some.name]["consumesCounters"][0]["counterSet"] == f"gpu-{some.gpu_index}-counters"
    assert len(by_name[some.name]["consumesCounters"][0]["counters"]) == len(
        next(iter(some.consumes.values())))
    # nothing to write again, and a restarted agent adopts what is there
    assert pub.sync(content).writes == 0
    assert SlicePublisher(kube, node_name).sync(content).writes == 0
    pub.remove()


def test_the_server_refuses_the_wrong_layout_and_unknown_counters(kube: KubeClient, kube_apiserver: KubeApiServer,
                                                                  node_name: str) -> None:
    inv = mig_inventory("dgx-h100")
    devs = build_devices(inv, dynamic_mig=dynamic)
    content = pool_content(devs, None, build_counter_sets(devs, inv))
    right = layout_for(kube_apiserver.version)
    wrong = LAYOUT_SEPARATE if right == LAYOUT_INLINE else LAYOUT_INLINE
    bodies = build_slices(node_name, content, 1, layout=wrong)
    with pytest.raises(KubeError) as err:
        for body in bodies:
            kube.create_resource_slice(body)
    assert err.value.status == 422, err.value
    for s in slices_of(kube, node_name):
        kube.delete_resource_slice(s["metadata"]["name"])

    [body, *_] = [b for b in build_slices(node_name, content, 1, layout=right) if b["spec"].get("devices")]
    bad = copy.deepcopy(body)
    bad["spec"]["devices"][0]["consumesCounters"][0]["counters"]["memory-slice-99"] = {"value": "1"}
    if right == LAYOUT_INLINE:
        with pytest.raises(KubeError) as err:
            kube.create_resource_slice(bad)
        assert err.value.status == 422 and "memory-slice-99" in str(err.value)
    else:
        # pool-wide counter sets live in other slices: the server cannot check the reference on write
        kube.create_resource_slice(bad)
        kube.delete_resource_slice(bad["metadata"]["name"])


async def test_component_serves_dynamic_mig_and_leaves_a_static_layout_alone(
        kube: KubeClient, node_name: str, short_tmp: Path) -> None:
    tmp_path = short_tmp
    adapter = adapter_for_sim(open_sim("dgx-a100-40gb", tmp_path / "sim.json"))
    for i in (0, 1):
        if adapter.set_mig_mode(i, True):
            adapter.reset_gpu(i)
    static = adapter.create_mig_device(1, "3g.20gb", 4)  # GPU 1 carries a static layout
    dra = DraComponent(paths=HostPaths(tmp_path / "root"), kube=kube, node_name=node_name, mig=adapter,
                       dynamic_mig=True, gpu_filter=lambda g: g.index in (0, 1))
    await dra.start(adapter.discover())
    try:
        await dra.wait_published()
        names = {d.name for d in dra.devices}
        assert "gpu-0-mig-7g-40gb-at-0" in names and "gpu-0-mig-1g-5gb-at-6" in names
        assert f"gpu-1-mig-{static.gi_id}-{static.ci_id}" in names  # the static device, as it is
        assert not any(n.startswith("gpu-1-mig-") and "-at-" in n for n in names)
        sets = [cs["name"] for s in slices_of(kube, node_name) for cs in s["spec"].get("sharedCounters", [])]
        assert sets == ["gpu-0-counters"]

        uid = str(uuid.uuid4())
        claims = {"c1": {"metadata": {"namespace": "ns", "name": "c1", "uid": uid}, "status": {"allocation": {
            "devices": {"results": [{"request": "r", "driver": "gpu.nodeagent.io", "pool": node_name,
                                     "device": "gpu-0-mig-2g-10gb-at-2"}]}}}}}
        assert dra.preparer is not None
        dra.preparer.read_claim = lambda ns, name: claims[name]
        out = await dra.preparer.prepare([ClaimRef("ns", uid, "c1")])
        assert out[uid].error == ""
        # the daemon rediscovers: GPU 0 now holds the claim's instance, the pool is unchanged, nothing written
        writes = dra.publisher.writes
        await dra.on_inventory(adapter.discover())
        await dra.wait_published()
        assert {d.name for d in dra.devices} == names and dra.publisher.writes == writes
        # unprepare destroys only the claim's instance; the static one on GPU 1 stays
        assert await dra.preparer.unprepare([ClaimRef("ns", uid, "c1")]) == {uid: ""}
        inv = adapter.discover()
        assert inv.gpu(0).mig_devices == ()
        assert [(m.profile, m.placement_start) for m in inv.gpu(1).mig_devices] == [("3g.20gb", 4)]
    finally:
        await dra.stop()
