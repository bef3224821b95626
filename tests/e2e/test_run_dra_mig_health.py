"""``nodeagent run`` with dynamic MIG, prepared by the kubelet's own DRA manager: an XID that NVML ties to
one created GPU instance marks that placement's device unhealthy (ResourceSlice taint, the kubelet's
allocatedResourcesStatus) and no other device of the GPU; recovery clears it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from nodeagent.dra.slices import UNHEALTHY_TAINT_KEY
from nodeagent.gpu import adapter_for_sim
from nodeagent.gpu.sim import open_sim
from nodeagent.gpu.sim.inject import inject_xid
from nodeagent.gpu.sim.state import SimStore
from nodeagent.kube.client import KubeClient, connect
from tests.e2e._agent import eventually, node_root, running_agent
from tests.e2e.test_run_dra import DRIVER, dra_node, remove_node, slice_devices
from tests.integration.test_dra_kubelet import CLAIMS, create_allocated_claim, resource_health
from tests.peers.apiserver import KubeApiServer
from tests.peers.draharness import Pod, running_dra_harness

pytestmark = pytest.mark.peers

BIG, SMALL = "gpu-0-mig-3g-40gb-at-4", "gpu-0-mig-1g-10gb-at-0"


def test_an_xid_on_a_created_instance_marks_only_its_placement(tmp_path: Path, kube_apiserver: KubeApiServer) -> None:
    node = "e2e-dra-mig-health"
    adapter = adapter_for_sim(open_sim("dgx-h100", tmp_path / "sim.json"))
    if adapter.set_mig_mode(0, True):
        adapter.reset_gpu(0)
    # health: a quick recovery window so the test sees the taint go
    _, args = dra_node(tmp_path, kube_apiserver, node, "dra",
                       "dynamic_mig = true\n[health]\nwindow = 2.0\npoll_interval = 0.5\n")
    kube = KubeClient(connect(kube_apiserver.kubeconfig))
    claim_names: list[str] = []
    try:
        with node_root() as root:
            registry = root / "var/lib/kubelet/plugins_registry"
            with running_agent(tmp_path, root, args) as agent:
                agent.wait_notify("READY=1", timeout=20)
                devices = eventually(lambda: slice_devices(kube_apiserver, node), 20, "ResourceSlices of the node")
                assert {BIG, SMALL} <= set(devices), sorted(devices)
                with running_dra_harness(kube_apiserver.kubeconfig, registry, node, host_root=root) as h:
                    h.wait_registered(DRIVER, timeout=20)
                    big = Pod("default", "e2e-mig-big", str(uuid.uuid4()), {}, {"main": ["gpu"]})
                    small = Pod("default", "e2e-mig-small", str(uuid.uuid4()), {}, {"main": ["gpu"]})
                    big_uid = create_allocated_claim(kube, node, [("mig", BIG)], big)
                    small_uid = create_allocated_claim(kube, node, [("mig", SMALL)], small)
                    claim_names += [*big.claims, *small.claims]
                    big_ids = h.prepare(big)["main"]
                    small_ids = h.prepare(small)["main"]
                    record = json.loads((root / "var/lib/nodeagent/dra-claims.json").read_text())["claims"]
                    gi = record[big_uid]["devices"][0]["mig"]["gi_id"]
                    assert isinstance(gi, int) and record[small_uid]["devices"][0]["mig"]["gi_id"] != gi

                    inject_xid(SimStore.open("dgx-h100", tmp_path / "sim.json"), 0, 48, gi_id=gi)

                    def tainted() -> dict[str, bool] | None:
                        devs = slice_devices(kube_apiserver, node) or {}
                        if BIG not in devs or not devs[BIG].get("taints"):
                            return None
                        return {n: bool(d.get("taints")) for n, d in devs.items() if n.startswith("gpu-0-")}

                    marks = eventually(tainted, 20, f"a taint on {BIG}")
                    now = slice_devices(kube_apiserver, node) or {}
                    assert [t["key"] for t in now[BIG]["taints"]] == [UNHEALTHY_TAINT_KEY]
                    assert [n for n, bad in marks.items() if bad] == [BIG], marks
                    eventually(lambda: resource_health(h, big) == {big_ids[0]: "Unhealthy"} or None, 20,
                               "the big claim Unhealthy at the kubelet")
                    assert resource_health(h, small) == {small_ids[0]: "Healthy"}

                    # no new XID for the recovery window: healthy again, the taint gone
                    eventually(lambda: not (slice_devices(kube_apiserver, node) or {}).get(BIG, {}).get("taints")
                               or None, 30, "the taint removed")
                    eventually(lambda: resource_health(h, big) == {big_ids[0]: "Healthy"} or None, 20,
                               "the big claim Healthy again")
                    h.unprepare(big)
                    h.unprepare(small)
                code, _ = agent.stop()
                assert code == 0, agent.log()
                assert f"GPU 0 GI {gi}: critical XID 48" in agent.log(), agent.log()
    finally:
        kube.close()
        for name in claim_names:
            kube_apiserver.request("DELETE", f"{CLAIMS}/{name}")
        remove_node(kube_apiserver, node)
