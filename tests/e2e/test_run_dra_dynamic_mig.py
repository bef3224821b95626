"""``nodeagent run`` with ``[dra] dynamic_mig = true`` against the real kube-apiserver: a MIG-mode GPU without
a static layout publishes its placements and a counter set, a GPU with a static layout keeps its MIG
device, GPUs outside MIG mode stay whole; turning the knob off on SIGHUP publishes the plain pool. Runs once per Kubernetes release: the counters sit in
the slice of their devices on 1.34 and in a slice of their own from 1.35 on."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator.open import open_sim
from tests.e2e._agent import ROOT, eventually, node_root, running_agent
from tests.e2e.test_run_cluster import make_node
from tests.e2e.test_run_dra import config
from tests.integration._releases import shared_release_apiserver
from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers

release_server = shared_release_apiserver  # the API server of each release, shared with other modules


def complete_slices(server: KubeApiServer, node: str) -> list[dict[str, Any]] | None:
    """The node's ResourceSlices once every slice of one pool generation is there; None while the pool is
    absent or partial (it is written slice by slice)."""
    status, body = server.get(f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{node}")
    assert status == 200, body
    items: list[dict[str, Any]] = json.loads(body)["items"]
    if not items:
        return None
    gens = {s["spec"]["pool"]["generation"] for s in items}
    if len(gens) != 1 or len(items) != items[0]["spec"]["pool"]["resourceSliceCount"]:
        return None
    return items


def pool(server: KubeApiServer, node: str) -> tuple[set[str], list[str]] | None:
    """(device names, counter set names) of the node's complete pool; None while it is absent or partial."""
    items = complete_slices(server, node)
    if items is None:
        return None
    names = {d["name"] for s in items for d in s["spec"].get("devices") or []}
    sets = sorted(cs["name"] for s in items for cs in s["spec"].get("sharedCounters") or [])
    return names, sets


def test_dynamic_mig_knob_publishes_placements_and_counters(tmp_path: Path, release_server: KubeApiServer) -> None:
    kube_apiserver = release_server
    node = "e2e-dra-dynmig"
    make_node(kube_apiserver, node)
    state = tmp_path / "sim.json"
    adapter = adapter_for_sim(open_sim("dgx-h100", state))
    for i in (0, 1):
        if adapter.set_mig_mode(i, True):
            adapter.reset_gpu(i)
    static = adapter.create_mig_device(1, "3g.40gb", 0)
    cfg = config(tmp_path / "config.toml", kube_apiserver, "dra", "dynamic_mig = true\n")
    args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", f"{ROOT}/sim.json", "--node-name",
            node]
    with node_root(sim_state=state) as root, running_agent(tmp_path, root, args) as agent:
        agent.wait_notify("READY=1", timeout=20)
        names, sets = eventually(lambda: pool(kube_apiserver, node), 20, "ResourceSlices of the node")
        assert sets == ["gpu-0-counters"]
        # the layout of the release: 1.34 keeps the counter set beside the devices consuming it, later
        # releases put it in a slice of its own
        items = eventually(lambda: complete_slices(kube_apiserver, node), 10, "the complete pool")
        [with_counters] = [s["spec"] for s in items if s["spec"].get("sharedCounters")]
        placements = {d["name"] for d in with_counters.get("devices") or ()}
        if kube_apiserver.version == "v1.34.4":
            assert "gpu-0-mig-7g-80gb-at-0" in placements, sorted(placements)
        else:
            assert not placements, sorted(placements)
        assert {"gpu-0-mig-7g-80gb-at-0", "gpu-0-mig-1g-10gb-at-6", "gpu-0-mig-3g-40gb-at-4"} <= names
        assert f"gpu-1-mig-{static.gi_id}-{static.ci_id}" in names
        assert not any(n.startswith("gpu-1-") and "-at-" in n for n in names)
        assert {f"gpu-{i}" for i in range(2, 8)} <= names and "gpu-0" not in names

        # the knob off: GPU 0 (MIG mode, no instance) offers nothing, no counters
        cfg.write_text(cfg.read_text().replace("dynamic_mig = true", "dynamic_mig = false"))
        agent.send(signal.SIGHUP)

        def plain() -> tuple[set[str], list[str]] | None:
            p = pool(kube_apiserver, node)
            return p if p is not None and not p[1] else None

        names, _ = eventually(plain, 20, "the pool without counters")
        assert not any("-at-" in n for n in names)
        assert f"gpu-1-mig-{static.gi_id}-{static.ci_id}" in names
