"""IMEX channel claims in nodeagent's DRA plane (nodeagent/dra/channels.py through ClaimPreparer): the channel
device of a ComputeDomain's template is prepared with channel 0 (Single) or every channel (All) as CDI device
nodes, kept across a restart of the agent, refused without NVIDIA's channel config; the prepared domains are
what the node reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nodeagent.dra.cdi import ClaimSpecs
from nodeagent.dra.channels import CHANNEL_DEVICE, channel_dra_device
from nodeagent.dra.checkpoint import Checkpoint
from nodeagent.dra.devices import build_devices
from nodeagent.dra.service import ClaimPreparer, ClaimRef
from tests.unit._dp_inventories import mig_box
from tests.unit.test_dra_service import POOL, Claims, claim

CLIQUE = "7b968a6d-c8aa-45e1-9e07-e1e51be99c31.1"


def channel_claim(uid: str, name: str, mode: str | None, *, gpu: bool = False) -> dict[str, Any]:
    c = claim(uid, name, [("channel", CHANNEL_DEVICE), *([("gpu", "gpu-1")] if gpu else [])])
    if mode is not None:
        c["status"]["allocation"]["devices"]["config"] = [{"source": "FromClaim", "requests": ["channel"], "opaque": {
            "driver": "gpu.nodeagent.io", "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig",
                "domainID": f"cd-{uid}", "allocationMode": mode}}}]
    return c


def preparer(tmp_path: Path, claims: Claims) -> ClaimPreparer:
    p = ClaimPreparer(Checkpoint.load(tmp_path / "state" / "dra-claims.json"), ClaimSpecs(tmp_path / "cdi"),
                      claims.read, POOL)
    p.set_devices([*build_devices(mig_box(per_gpu=2, gpus_on=1, gpus_off=2)), channel_dra_device(CLIQUE)])
    p.channel_count = 8  # the node's channels for "All" (2048 on a real node)
    return p


def spec(p: ClaimPreparer, uid: str) -> dict[str, Any]:
    text = p.specs.current(uid)
    assert text is not None
    out: dict[str, Any] = json.loads(text)
    return out


def nodes(device: dict[str, Any]) -> list[str]:
    return [n["path"] for n in device["containerEdits"]["deviceNodes"]]


async def test_single_all_restart_and_refusal(tmp_path: Path) -> None:
    claims = Claims(channel_claim("u1", "single", "Single"), channel_claim("u2", "all", "All"),
                    channel_claim("u3", "none", None), channel_claim("u4", "both", "Single", gpu=True))
    p = preparer(tmp_path, claims)
    out = await p.prepare([ClaimRef("ns", u, n) for u, n in
                           (("u1", "single"), ("u2", "all"), ("u3", "none"), ("u4", "both"))])
    assert out["u1"].error == "" and out["u2"].error == "" and out["u4"].error == ""
    assert "needs a ComputeDomainChannelConfig" in out["u3"].error and "u3" not in p.checkpoint.claims
    single = spec(p, "u1")
    (dev,) = single["devices"]
    assert nodes(dev) == ["/dev/nvidia-caps-imex-channels/channel0"]
    assert "containerEdits" not in single  # no GPU, no control devices, no NVIDIA_VISIBLE_DEVICES
    every = spec(p, "u2")
    assert nodes(every["devices"][0]) == [f"/dev/nvidia-caps-imex-channels/channel{n}" for n in range(8)]
    both = spec(p, "u4")
    assert [nodes(d) for d in both["devices"]] == [["/dev/nvidia-caps-imex-channels/channel0"], ["/dev/nvidia1"]]
    visible = [e for e in both["containerEdits"]["env"] if e.startswith("NVIDIA_VISIBLE_DEVICES=")]
    assert visible and "," not in visible[0]  # the GPU's UUID only
    assert out["u2"].devices[0].channels == 8 and out["u2"].devices[0].domain == "cd-u2"
    assert p.domains() == {"cd-u1", "cd-u2", "cd-u4"}

    # a restarted agent: the recorded channels keep the specs as written
    before = {u: p.specs.current(u) for u in ("u1", "u2", "u4")}
    again = preparer(tmp_path, claims)
    assert again.recover() == []
    assert {u: again.specs.current(u) for u in before} == before
    assert again.domains() == {"cd-u1", "cd-u2", "cd-u4"}
    assert (await again.unprepare([ClaimRef("ns", "u2", "all")])) == {"u2": ""}
    assert again.domains() == {"cd-u1", "cd-u4"} and again.specs.current("u2") is None


async def test_channels_made_on_the_node_and_named_with_their_numbers(tmp_path: Path) -> None:
    """With the component's channel maker (nodeagent.imex.channels) the channels a claim needs are made under
    the root and its spec carries their numbers, as NVIDIA's driver writes them."""
    from nodeagent.dra.channels import channel_nodes
    from nodeagent.hostpaths import HostPaths

    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    (root / "proc/devices").write_text("Character devices:\n195 nvidia-frontend\n511 nvidia-caps-imex-channels\n")
    claims = Claims(channel_claim("u5", "all", "All"))
    p = preparer(tmp_path, claims)
    p.specs.channel_nodes = channel_nodes(HostPaths(root))
    assert (await p.prepare([ClaimRef("ns", "u5", "all")]))["u5"].error == ""
    entries = spec(p, "u5")["devices"][0]["containerEdits"]["deviceNodes"]
    assert [(e["path"], e["major"], e["minor"], e["type"], e["fileMode"]) for e in entries] == [
        (f"/dev/nvidia-caps-imex-channels/channel{n}", 511, n, "c", 0o666) for n in range(8)]
    assert all(e["hostPath"].startswith(str(root)) for e in entries)  # stand-ins under a sandbox root
    assert len(list((root / "dev/nvidia-caps-imex-channels").iterdir())) == 8
    # no IMEX channels on the node (no /proc/devices line): the claim is refused, nothing recorded
    (root / "proc/devices").write_text("Character devices:\n195 nvidia-frontend\n")
    bad = preparer(tmp_path / "other", Claims(channel_claim("u6", "one", "Single")))
    bad.specs.channel_nodes = channel_nodes(HostPaths(root))
    out = await bad.prepare([ClaimRef("ns", "u6", "one")])
    assert "nvidia-caps-imex-channels" in out["u6"].error and "u6" not in bad.checkpoint.claims
