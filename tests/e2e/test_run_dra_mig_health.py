"""``nodeagent run`` with dynamic MIG, prepared by the kubelet's own DRA manager: an XID that NVML ties to
one created GPU instance marks that placement's device unhealthy (ResourceSlice taint, the kubelet's
allocatedResourcesStatus) and no other device of the GPU; unpreparing the claim clears it at once (the
placement no longer holds that instance), and without an unprepare the health window's end clears it."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from nodeagent.dra.slices import UNHEALTHY_TAINT_KEY
from nodeagent.kube.client import KubeClient, connect
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator.inject import inject_xid
from nodeagent.simulator.open import open_sim
from nodeagent.simulator.state import SimStore
from tests.e2e._agent import eventually, node_root, running_agent
from tests.e2e.test_run_dra import DRIVER, dra_node, remove_node, slice_devices
from tests.e2e.test_run_dra_dynamic_mig import complete_slices
from tests.integration.test_dra_kubelet import CLAIMS, create_allocated_claim, resource_health
from tests.peers.apiserver import KubeApiServer
from tests.peers.draharness import Pod, running_dra_harness

pytestmark = pytest.mark.peers

BIG, SMALL = "gpu-0-mig-3g-40gb-at-4", "gpu-0-mig-1g-10gb-at-0"
WINDOW = 12.0


def complete_pool(server: KubeApiServer, node: str) -> dict[str, dict[str, Any]] | None:
    """Device name → device of the node's complete pool, else None."""
    items = complete_slices(server, node)
    return None if items is None else {d["name"]: d for s in items for d in s["spec"].get("devices") or []}


def test_an_xid_on_a_created_instance_marks_only_its_placement(
    tmp_path: Path, kube_apiserver: KubeApiServer
) -> None:
    node = "e2e-dra-mig-health"
    adapter = adapter_for_sim(open_sim("dgx-h100", tmp_path / "sim.json"))
    if adapter.set_mig_mode(0, True):
        adapter.reset_gpu(0)
    # a health window (WINDOW s without a new XID until healthy) long enough to tell an unprepare from it
    _, args = dra_node(
        tmp_path,
        kube_apiserver,
        node,
        "dra",
        f"dynamic_mig = true\n[health]\nwindow = {WINDOW}\npoll_interval = 0.5\n",
    )
    kube = KubeClient(connect(kube_apiserver.kubeconfig))
    claim_names: list[str] = []
    try:
        with node_root(sim_state=tmp_path / "sim.json") as root:
            registry = root / "var/lib/kubelet/plugins_registry"
            with running_agent(tmp_path, root, args) as agent:
                agent.wait_notify("READY=1", timeout=20)
                devices = eventually(
                    lambda: slice_devices(kube_apiserver, node), 20, "ResourceSlices of the node"
                )
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

                    store = SimStore.open("dgx-h100", root / "sim.json")
                    small_gi = record[small_uid]["devices"][0]["mig"]["gi_id"]

                    def taints() -> dict[str, bool] | None:
                        """GPU 0's placement devices → tainted, read from a complete pool only (the pool
                        is rewritten slice by slice: a partial read would miss devices)."""
                        got = complete_pool(kube_apiserver, node)
                        if got is None:
                            return None
                        return {n: bool(d.get("taints")) for n, d in got.items() if n.startswith("gpu-0-")}

                    def only_tainted(name: str) -> dict[str, bool] | None:
                        marks = taints()
                        return marks if marks and marks.get(name) else None

                    def untainted() -> bool | None:
                        marks = taints()
                        return (marks is not None and BIG in marks and not any(marks.values())) or None

                    inject_xid(store, 0, 48, gi_id=gi)
                    marks = eventually(lambda: only_tainted(BIG), 20, f"a taint on {BIG}")
                    hit = time.monotonic()
                    now = eventually(lambda: complete_pool(kube_apiserver, node), 20, "the pool")
                    assert [t["key"] for t in now[BIG]["taints"]] == [UNHEALTHY_TAINT_KEY]
                    assert [n for n, bad in marks.items() if bad] == [BIG], marks
                    eventually(
                        lambda: resource_health(h, big) == {big_ids[0]: "Unhealthy"} or None,
                        20,
                        "the big claim Unhealthy at the kubelet",
                    )
                    assert resource_health(h, small) == {small_ids[0]: "Healthy"}

                    # unprepared: the instance is gone, the placement is free and untainted long before the
                    # health window ends
                    h.unprepare(big)
                    eventually(untainted, 20, f"the taint on {BIG} removed")
                    assert time.monotonic() - hit < WINDOW - 2

                    # still prepared: the taint goes when the window passes without a new XID
                    inject_xid(store, 0, 48, gi_id=small_gi)
                    marks = eventually(lambda: only_tainted(SMALL), 20, f"a taint on {SMALL}")
                    assert [n for n, bad in marks.items() if bad] == [SMALL], marks
                    eventually(untainted, WINDOW + 20, "the taint gone after the window")
                    eventually(
                        lambda: resource_health(h, small) == {small_ids[0]: "Healthy"} or None,
                        20,
                        "the small claim Healthy again",
                    )
                    h.unprepare(small)
                code, _ = agent.stop()
                assert code == 0, agent.log()
                assert f"GPU 0 GI {gi}: critical XID 48" in agent.log(), agent.log()
    finally:
        kube.close()
        for name in claim_names:
            kube_apiserver.request("DELETE", f"{CLAIMS}/{name}")
        remove_node(kube_apiserver, node)
