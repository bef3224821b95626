"""ComputeDomain → ResourceClaimTemplate and status (nodeagent/computedomain/reconcile.py) and the IMEX channel
device model of the DRA driver (nodeagent/dra/channels.py), pure."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from nodeagent.computedomain import reconcile as rc
from nodeagent.dra import channels
from nodeagent.errors import ConfigError
from nodeagent.hostpaths import HostPaths

CLIQUE_A = "7b968a6d-c8aa-45e1-9e07-e1e51be99c31.1"
CLIQUE_B = "7b968a6d-c8aa-45e1-9e07-e1e51be99c31.2"


def cd(mode: str | None = "Single", num: int = 0, template: str = "imex-channel", **spec: Any) -> dict[str, Any]:
    channel: dict[str, Any] = {"resourceClaimTemplate": {"name": template}}
    if mode is not None:
        channel["allocationMode"] = mode
    return {"apiVersion": rc.API_VERSION, "kind": rc.KIND,
            "metadata": {"namespace": "team", "name": "job", "uid": "uid-1"},
            "spec": {"numNodes": num, "channel": channel, **spec}}


def node(name: str, clique: str = CLIQUE_A, ip: str = "10.0.0.1", report: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {channels.CLIQUE_LABEL: clique} if clique else {}}
    if report is not None:
        meta["annotations"] = {rc.REPORT_ANNOTATION: report}
    return {"metadata": meta, "status": {"addresses": [{"type": "Hostname", "address": name},
                                                       {"type": "InternalIP", "address": ip}]}}


def facts(*nodes: dict[str, Any]) -> list[rc.NodeFacts]:
    return [rc.node_facts(n)[0] for n in nodes]


def test_parse_defaults_and_fields() -> None:
    d = rc.parse_domain(cd(mode=None))
    assert d == rc.Domain("team", "job", "uid-1", "imex-channel", "Single", 0)
    assert rc.parse_domain(cd("All", 2)).allocation_mode == "All"


@pytest.mark.parametrize(("obj", "field"), [
    (cd(mode="Some"), "spec.channel.allocationMode"),
    (cd(template="Bad_Name"), "spec.channel.resourceClaimTemplate.name"),
    (cd(num=-1), "spec.numNodes"),
    ({"metadata": {"namespace": "team", "name": "job", "uid": "u"}, "spec": {}}, "spec.channel"),
    ({"metadata": {"name": "job"}, "spec": {}}, "metadata.namespace"),
])
def test_bad_domain_one_error_naming_field(obj: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        rc.parse_domain(obj)
    assert field in str(e.value) and "ComputeDomain" in str(e.value)


@pytest.mark.parametrize("mode", ["Single", "All"])
def test_template_requests_channel_in_one_clique_owned_by_domain(mode: str) -> None:
    d = rc.parse_domain(cd(mode))
    t = rc.desired_template(d, CLIQUE_A)
    assert t["metadata"]["name"] == "imex-channel" and t["metadata"]["namespace"] == "team"
    assert t["metadata"]["ownerReferences"] == [{"apiVersion": "resource.nvidia.com/v1beta1",
                                                 "kind": "ComputeDomain", "name": "job", "uid": "uid-1",
                                                 "controller": True}]
    assert t["metadata"]["labels"][rc.DOMAIN_LABEL] == "uid-1"
    devices = t["spec"]["spec"]["devices"]
    (req,) = devices["requests"]
    assert req["exactly"]["deviceClassName"] == channels.CHANNEL_CLASS
    assert req["exactly"]["selectors"] == [
        {"cel": {"expression": f'device.attributes["gpu.nodeagent.io"].clique == "{CLIQUE_A}"'}}]
    (cfg,) = devices["config"]
    assert cfg["requests"] == [req["name"]] and cfg["opaque"]["driver"] == "gpu.nodeagent.io"
    params = cfg["opaque"]["parameters"]
    assert channels.parse_channel_config(params, "x") == channels.ChannelConfig("uid-1", mode)
    assert rc.template_matches(t, t)
    assert not rc.template_matches(t, rc.desired_template(d, CLIQUE_B))
    # as the API server stores it: its defaults added; still the same template (not made again at every pass)
    stored = copy.deepcopy(t)
    stored["spec"]["metadata"] = {}
    stored["spec"]["spec"]["devices"]["requests"][0]["exactly"].update(allocationMode="ExactCount", count=1)
    assert rc.template_matches(stored, t)
    stored["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = []
    assert not rc.template_matches(stored, t)


def test_clique_choice_keeps_pin_prefers_members_then_largest() -> None:
    d = rc.parse_domain(cd())
    three = facts(node("a", CLIQUE_A), node("b", CLIQUE_B), node("c", CLIQUE_B), node("d", ""))
    assert rc.choose_clique(d, three, None) == CLIQUE_B  # the larger clique
    assert rc.choose_clique(d, three, CLIQUE_A) == CLIQUE_A  # a pin stays while a node has it
    assert rc.choose_clique(d, three, "gone.9") == CLIQUE_B  # a vanished pin is chosen again
    member = facts(node("a", CLIQUE_A, report='{"uid-1":"Ready"}'), node("b", CLIQUE_B), node("c", CLIQUE_B))
    assert rc.choose_clique(d, member, None) == CLIQUE_A  # where the domain already runs
    tie = facts(node("b", CLIQUE_B), node("a", CLIQUE_A))
    assert rc.choose_clique(d, tie, None) == CLIQUE_A  # ties: the lowest name
    assert rc.choose_clique(d, facts(node("x", "")), None) is None


def test_status_from_reports_indices_stable_and_ready_rule() -> None:
    d = rc.parse_domain(cd(num=2))
    a = node("a", CLIQUE_A, "10.0.0.1", '{"uid-1":"Ready"}')
    b = node("b", CLIQUE_A, "10.0.0.2", '{"uid-1":"NotReady","other":"Ready"}')
    c = node("c", CLIQUE_A, "10.0.0.3", '{"other":"Ready"}')
    s = rc.desired_status(d, None, facts(a, b, c))
    assert s == {"status": "NotReady", "nodes": [
        {"name": "a", "ipAddress": "10.0.0.1", "cliqueID": CLIQUE_A, "index": 0, "status": "Ready"},
        {"name": "b", "ipAddress": "10.0.0.2", "cliqueID": CLIQUE_A, "index": 1, "status": "NotReady"}]}
    b2 = node("b", CLIQUE_A, "10.0.0.2", '{"uid-1":"Ready"}')
    s2 = rc.desired_status(d, s, facts(a, b2))
    assert s2["status"] == "Ready" and [n["index"] for n in s2["nodes"]] == [0, 1]
    # a leaves: b keeps index 1, a newcomer takes the free 0; too few nodes for numNodes: NotReady
    s3 = rc.desired_status(d, s2, facts(b2))
    assert s3 == {"status": "NotReady", "nodes": [s2["nodes"][1]]}
    z = node("z", CLIQUE_A, "10.0.0.9", '{"uid-1":"Ready"}')
    s4 = rc.desired_status(d, s3, facts(b2, z))
    assert {n["name"]: n["index"] for n in s4["nodes"]} == {"b": 1, "z": 0} and s4["status"] == "Ready"
    assert rc.status_equal(s4, rc.desired_status(d, s4, facts(b2, z)))
    # no node and numNodes 0: Ready (NVIDIA's rule); an empty list is not written
    assert rc.desired_status(rc.parse_domain(cd()), None, []) == {"status": "Ready"}


@pytest.mark.parametrize("value", ["{", "[]", '{"u":"Up"}', '{"u":1}'])
def test_bad_report_is_named_and_ignored(value: str) -> None:
    f, complaint = rc.node_facts(node("a", report=value))
    assert f.reports == {} and complaint is not None
    assert "Node a" in complaint and rc.REPORT_ANNOTATION in complaint


def test_report_round_trip() -> None:
    v = rc.encode_report({"b": "NotReady", "a": "Ready"})
    assert v == '{"a":"Ready","b":"NotReady"}' and rc.parse_report(v) == {"a": "Ready", "b": "NotReady"}


def test_channel_devices_and_cdi_nodes(tmp_path: Path) -> None:
    dev = channels.channel_device(CLIQUE_A)
    assert dev["name"] == "channel-0"
    assert dev["attributes"] == {"type": {"string": "channel"}, "id": {"int": 0}, "clique": {"string": CLIQUE_A}}
    assert list(channels.channel_ids("Single")) == [0] and list(channels.channel_ids("All")) == list(range(2048))
    # the entries come from nodeagent.imex.channels, which makes the channels (stand-ins under a sandbox root)
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/devices").write_text("Character devices:\n195 nvidia-frontend\n234 nvidia-caps-imex-channels\n")
    nodes = channels.channel_nodes(HostPaths(tmp_path))(3)
    assert [(n["path"], n["type"], n["major"], n["minor"], n["fileMode"]) for n in nodes] == [
        (f"/dev/nvidia-caps-imex-channels/channel{i}", "c", 234, i, 0o666) for i in range(3)]
    assert sorted(p.name for p in (tmp_path / "dev/nvidia-caps-imex-channels").iterdir()) == [
        "channel0", "channel1", "channel2"]


@pytest.mark.parametrize(("params", "field"), [
    ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}, "ComputeDomainChannelConfig"),
    ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig"}, "domainID"),
    ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig", "domainID": "u",
      "allocationMode": "Many"}, "allocationMode"),
    ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig", "domainID": "u",
      "extra": 1}, "extra"),
])
def test_bad_channel_config(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        channels.parse_channel_config(params, "claim team/c")
