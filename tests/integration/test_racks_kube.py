"""The NVLink clique on the REAL kube-apiserver: nvidia.com/gpu.clique published as GFD writes it and withdrawn
while the fabric is not ready, the NVLinkCliqueReady condition saying why, and the clique's Nodes found by
label with their InternalIPs (the IMEX daemon's peers)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from pathlib import Path
from types import SimpleNamespace

from nodeagent.config import AgentConfig, ImexSettings, PublishSettings, SimulateSettings
from nodeagent.daemon.components.racks import IMEX_READY_LABEL, RacksComponent
from nodeagent.daemon.shared import ConditionInputs
from nodeagent.gpu.fabric import CLIQUE_LABEL, decide
from nodeagent.gpu.inventory import Fabric, Gpu, Inventory
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import JSON_PATCH, KubeClient
from nodeagent.kube.conditions import NVLINK_CLIQUE_READY, ConditionSnapshot, ConditionWriter
from nodeagent.kube.node import NodeClient, internal_ips
from nodeagent.kube.publisher import NodePublisher
from tests.integration._kube import throwaway_node

UUID = "7b968a6d-c8aa-45e1-9e07-e1e51be99c31"
HEALTHY = Fabric(state=3, status=0, cluster_uuid=UUID, clique_id=1, health_mask=4522, health_summary=1)


def _inv(fabric: Fabric) -> Inventory:
    gpus = tuple(Gpu(i, f"GPU-{i}-gb", "NVIDIA GB200", f"0000000{8 + i}:01:00.0", 0x294110DE, 189471, 0, 10, 0, i,
                     "blackwell", fabric=fabric) for i in range(2))
    return Inventory("570.133.20", 12080, gpus)


def _set_ip(kube: KubeClient, name: str, ip: str) -> None:
    kube.request("PATCH", f"/api/v1/nodes/{name}/status", content_type=JSON_PATCH, body=[
        {"op": "add", "path": "/status/addresses", "value": [{"type": "InternalIP", "address": ip},
                                                            {"type": "Hostname", "address": name}]}])


def test_clique_label_condition_and_peers(kube: KubeClient, node_name: str) -> None:
    nc = NodeClient(kube, node_name)
    pub = NodePublisher(kube, node_name, PublishSettings(gpu_objects=False, extended_resources=False))
    writer = ConditionWriter(nc)
    value = f"{UUID}.1"

    pub.publish(_inv(HEALTHY))
    assert nc.get().labels[CLIQUE_LABEL] == value
    writer.sync(ConditionSnapshot(fabric=decide(_inv(HEALTHY))))
    cond = {c["type"]: c for c in nc.get().conditions}[NVLINK_CLIQUE_READY]
    assert (cond["status"], cond["reason"]) == ("True", "CliqueJoined")

    # the clique's Nodes by label: this one (with its InternalIP), not a Node of another clique
    _set_ip(kube, node_name, "10.99.0.2")
    with throwaway_node(kube, "rack-other", lambda n: {CLIQUE_LABEL: f"{UUID}.2"}) as other:
        _set_ip(kube, other, "10.99.0.3")
        found = internal_ips(kube.list_nodes(label_selector=f"{CLIQUE_LABEL}={value}"))
        assert found == {node_name: "10.99.0.2"}

    # fabric registration restarts: the label goes, the condition says why
    starting = dataclasses.replace(HEALTHY, state=2, status=27, cluster_uuid="00000000-0000-0000-0000-000000000000",
                                   clique_id=0)
    pub.publish(_inv(starting))
    assert CLIQUE_LABEL not in nc.get().labels
    assert writer.sync(ConditionSnapshot(fabric=decide(_inv(starting)))) == [NVLINK_CLIQUE_READY]
    cond = {c["type"]: c for c in nc.get().conditions}[NVLINK_CLIQUE_READY]
    assert (cond["status"], cond["reason"]) == ("False", "FabricInProgress")
    assert "GPU 0" in cond["message"]
    assert writer.sync(ConditionSnapshot(fabric=decide(_inv(starting)))) == []  # nothing new, nothing written


def test_racks_component_runs_imex_for_the_clique(kube: KubeClient, node_name: str, tmp_path: Path) -> None:
    """The daemon component on the real apiserver: channel made, the stand-in IMEX daemon started for the clique
    (peers from the labelled Nodes), IMEXReady and nodeagent.io/imex.ready; the fabric restarting gives one
    Warning Event naming why and stops the daemon."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/devices").write_text("Character devices:\n511 nvidia-caps-imex-channels\n")
    ip = "127.0.0.6"
    with socket.socket() as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    cfg = AgentConfig(imex=ImexSettings(enabled=True, address=ip, server_port=port, cmd_port=port + 1 if port < 65535
                                        else port - 1), simulate=SimulateSettings(machine="gb200-nvl"))
    shared = SimpleNamespace(conditions=ConditionInputs())
    ctx = SimpleNamespace(config=cfg, paths=HostPaths(tmp_path), kube=kube, node_name=node_name, shared=shared,
                          set_status=lambda component, text: None)
    nc = NodeClient(kube, node_name)
    comp = RacksComponent(ctx)  # type: ignore[arg-type]

    async def scenario() -> None:
        await comp.start(ctx)  # type: ignore[arg-type]
        assert (tmp_path / "dev/nvidia-caps-imex-channels/channel0").is_file()
        assert "nvidia.com/imex-channel" in (tmp_path / "var/run/cdi/nvidia-imex-channels.yaml").read_text()
        try:
            await comp.on_inventory(_inv(HEALTHY))
            deadline = time.monotonic() + 40
            # the condition input is set before the label's patch is sent: wait for both
            while not (shared.conditions.imex and shared.conditions.imex.ready
                       and (await nc.aget()).labels.get(IMEX_READY_LABEL) == "true"):
                assert time.monotonic() < deadline, shared.conditions.imex
                await asyncio.sleep(0.05)
            starting = dataclasses.replace(HEALTHY, state=1, status=27, clique_id=0,
                                           cluster_uuid="00000000-0000-0000-0000-000000000000")
            await comp.on_inventory(_inv(starting))
            await comp.on_inventory(_inv(starting))  # the same reason again: no second Event
            imex = shared.conditions.imex
            assert imex is not None and not imex.running and imex.clique is None
            assert nc.get().labels[IMEX_READY_LABEL] == "false"
        finally:
            await comp.stop()

    asyncio.run(scenario())
    events = [e for e in nc.list_events() if e.get("reason") == "FabricNotStarted"]
    assert len(events) == 1 and events[0]["type"] == "Warning" and CLIQUE_LABEL in events[0]["message"]


def test_rack_conditions_go_when_they_no_longer_apply(kube: KubeClient, node_name: str) -> None:
    """A node that leaves the rack (its GPUs on no fabric cluster any more) loses NVLinkCliqueReady; [imex] turned
    off removes IMEXReady; another writer's condition stays. A withheld clique keeps its condition (False, with the
    reason), and an agent restarted on a node without them writes nothing for them."""
    from nodeagent.kube.conditions import IMEX_READY, ImexInput

    nc = NodeClient(kube, node_name)
    other = {"type": "example.com/Other", "status": "True", "reason": "Fine", "message": "not nodeagent's"}
    nc.patch_status_conditions([other])
    writer = ConditionWriter(nc)
    imex = ImexInput(running=True, ready=True, peers=2, answer="READY", clique=f"{UUID}.1")
    writer.sync(ConditionSnapshot(fabric=decide(_inv(HEALTHY)), imex=imex))
    types = {c["type"]: c for c in nc.get().conditions}
    assert types[NVLINK_CLIQUE_READY]["status"] == types[IMEX_READY]["status"] == "True"

    # the clique withheld: still a rack node, the condition stays and says why
    starting = dataclasses.replace(HEALTHY, state=1, status=27, clique_id=0,
                                   cluster_uuid="00000000-0000-0000-0000-000000000000")
    writer.sync(ConditionSnapshot(fabric=decide(_inv(starting)), imex=dataclasses.replace(imex, clique=None)))
    types = {c["type"]: c for c in nc.get().conditions}
    assert (types[NVLINK_CLIQUE_READY]["status"], types[NVLINK_CLIQUE_READY]["reason"]) == ("False", "FabricNotStarted")
    assert (types[IMEX_READY]["status"], types[IMEX_READY]["reason"]) == ("False", "NoClique")

    # out of the rack (no fabric at all), [imex] still on: the clique condition goes, IMEX says NoClique
    gone = dataclasses.replace(HEALTHY, state=0, status=0, cluster_uuid="", clique_id=0)
    assert decide(_inv(gone)).applicable is False
    no_rack = ConditionSnapshot(fabric=decide(_inv(gone)), imex=dataclasses.replace(imex, clique=None, running=False))
    assert writer.sync(no_rack) == [NVLINK_CLIQUE_READY]
    types = {c["type"]: c for c in nc.get().conditions}
    assert NVLINK_CLIQUE_READY not in types and types[IMEX_READY]["reason"] == "NoClique"
    assert writer.sync(no_rack) == []  # removed once, nothing more to send

    # [imex] turned off: IMEXReady goes too; the other writer's condition was never touched
    off = ConditionSnapshot(fabric=decide(_inv(gone)), imex_off=True)
    assert writer.sync(off) == [IMEX_READY]
    types = {c["type"]: c for c in nc.get().conditions}
    assert IMEX_READY not in types and NVLINK_CLIQUE_READY not in types
    assert {k: types[other["type"]][k] for k in other} == other
    assert ConditionWriter(nc).sync(off) == []  # a restarted agent: nothing to remove, no request


def test_imex_label_goes_when_imex_is_off(kube: KubeClient, node_name: str, tmp_path: Path) -> None:
    """[imex] turned off: the racks component removes the nodeagent.io/imex.ready label an earlier configuration
    left (one write), keeps the other labels, writes nothing more at later passes, and a restarted agent (a new
    component) sends nothing when the label is already absent."""
    from nodeagent.daemon.components.racks import imex_label_change

    assert imex_label_change(False, False, "true") == {IMEX_READY_LABEL: None}
    assert imex_label_change(False, True, None) == {}
    assert imex_label_change(True, True, "false") == {IMEX_READY_LABEL: "true"}
    assert imex_label_change(True, False, "false") == {}

    nc = NodeClient(kube, node_name)
    nc.patch_labels({IMEX_READY_LABEL: "true", "example.com/other": "kept"})
    cfg = AgentConfig(imex=ImexSettings(enabled=False))
    ctx = SimpleNamespace(config=cfg, paths=HostPaths(tmp_path), kube=kube, node_name=node_name,
                          shared=SimpleNamespace(conditions=ConditionInputs()),
                          set_status=lambda component, text: None)

    async def passes(comp: RacksComponent) -> None:
        await comp.start(ctx)  # type: ignore[arg-type]
        try:
            await comp.on_inventory(_inv(HEALTHY))
            await comp.resync()
            await comp.on_inventory(_inv(HEALTHY))
        finally:
            await comp.stop()

    writes = kube.stats.writes
    asyncio.run(passes(RacksComponent(ctx)))  # type: ignore[arg-type]
    labels = nc.get().labels
    assert IMEX_READY_LABEL not in labels and labels["example.com/other"] == "kept"
    assert kube.stats.writes == writes + 1  # the removal, once, however many passes
    assert not (tmp_path / "dev").exists()  # [imex] off: no channel made, no daemon

    writes = kube.stats.writes
    asyncio.run(passes(RacksComponent(ctx)))  # type: ignore[arg-type]
    assert kube.stats.writes == writes  # restarted: the label is absent, nothing is sent
    nc.patch_labels({"example.com/other": None})
