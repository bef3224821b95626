"""DRA devices, ResourceSlice bodies, per-claim CDI specs and the claim checkpoint (pure / local files)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from nodeagent.dra.cdi import CDI_KIND, ClaimSpecs, cdi_device_id, claim_spec
from nodeagent.dra.checkpoint import PREPARED, Checkpoint, ClaimRecord, PreparedDevice
from nodeagent.dra.devices import (
    PCI_BUS_ID_ATTR,
    PCIE_ROOT_ATTR,
    build_devices,
    pci_bus_id,
    pcie_root,
    semver,
)
from nodeagent.dra.slices import UNHEALTHY_TAINT_KEY, build_slices, pool_content, taint_value
from nodeagent.errors import InputError
from tests.unit._dp_inventories import mig_box, nvswitch_box


def test_whole_gpus_carry_the_attributes_and_memory() -> None:
    devs = build_devices(nvswitch_box(2), {"00000000:10:00.0": "pci0000:00"})
    assert [d.name for d in devs] == ["gpu-0", "gpu-1"]
    a = devs[0].attributes
    assert a["type"] == {"string": "gpu"}
    assert a["uuid"] == {"string": "GPU-00000000-0000-4000-8000-000000000000"}
    assert a["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert a["architecture"] == {"string": "hopper"}
    assert a["cudaComputeCapability"] == {"version": "9.0.0"}
    assert a["driverVersion"] == {"version": "550.54.15"}
    assert a["cudaDriverVersion"] == {"version": "12.4.0"}
    assert a[PCI_BUS_ID_ATTR] == {"string": "0000:10:00.0"}
    assert a[PCIE_ROOT_ATTR] == {"string": "pci0000:00"}
    assert a["numaNode"] == {"int": 0}
    assert a["resource.kubernetes.io/numaNode"] == {"int": 0}  # the standard name beside the driver's own
    assert PCIE_ROOT_ATTR not in devs[1].attributes  # sysfs did not know it
    assert devs[0].capacity == {"memory": {"value": "81559Mi"}}
    assert len(a) + len(devs[0].capacity) <= 32  # API limit per device


def test_mig_gpus_publish_their_mig_devices_instead_of_the_whole_gpu() -> None:
    devs = build_devices(mig_box(per_gpu=2, gpus_on=1, gpus_off=1))
    assert [d.name for d in devs] == ["gpu-0-mig-1-0", "gpu-0-mig-2-0", "gpu-1"]
    m = devs[0]
    assert (m.kind, m.gpu_index, m.gi_id, m.ci_id) == ("mig", 0, 1, 0)
    assert m.attributes["type"] == {"string": "mig"}
    assert m.attributes["profile"] == {"string": "1g.10gb"}
    assert m.attributes["parentUUID"] == {"string": "GPU-00000000-0000-4000-8000-000000000000"}
    assert m.capacity == {"memory": {"value": "9856Mi"}}
    assert "numaNode" not in devs[2].attributes  # unknown NUMA node is left out, not guessed
    assert "resource.kubernetes.io/numaNode" not in devs[2].attributes


def test_gpu_filter_leaves_gpus_to_the_other_plane() -> None:
    devs = build_devices(mig_box(per_gpu=2, gpus_on=1, gpus_off=2), gpu_filter=lambda g: g.index != 1)
    assert [d.name for d in devs] == ["gpu-0-mig-1-0", "gpu-0-mig-2-0", "gpu-2"]


def test_lost_gpus_are_not_published() -> None:
    inv = nvswitch_box(2)
    inv = replace(inv, gpus=(inv.gpus[0], replace(inv.gpus[1], lost=True)))
    assert [d.name for d in build_devices(inv)] == ["gpu-0"]


@pytest.mark.parametrize(("raw", "want"), [("550.54.15", "550.54.15"), ("535.104.05", "535.104.5"),
                                           ("12.4", "12.4.0"), ("560", "560.0.0"), ("r550-beta", None)])
def test_semver(raw: str, want: str | None) -> None:
    assert semver(raw) == want


def test_pci_bus_id_and_pcie_root_from_sysfs(tmp_path: Path) -> None:
    assert pci_bus_id("00000000:07:00.0") == "0000:07:00.0"
    assert pci_bus_id("0000000A:8F:00.1") == "000a:8f:00.1"
    devdir = tmp_path / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:07:00.0"
    devdir.mkdir(parents=True)
    bus = tmp_path / "bus"
    bus.mkdir()
    (bus / "0000:07:00.0").symlink_to(devdir)
    assert pcie_root(bus, "00000000:07:00.0") == "pci0000:00"
    assert pcie_root(bus, "00000000:08:00.0") is None


def test_slices_split_at_the_limit_and_name_the_pool() -> None:
    devs = build_devices(mig_box(per_gpu=7, gpus_on=2, gpus_off=1))  # 15 devices
    content = pool_content(devs)
    slices = build_slices("n1", content, 3, max_devices=4)
    assert [s["metadata"]["name"] for s in slices] == [f"n1-gpu.nodeagent.io-{i}" for i in range(4)]
    assert [len(s["spec"]["devices"]) for s in slices] == [4, 4, 4, 3]
    for s in slices:
        assert s["spec"]["pool"] == {"name": "n1", "generation": 3, "resourceSliceCount": 4}
        assert s["spec"]["nodeName"] == "n1"
        assert s["spec"]["driver"] == "gpu.nodeagent.io"
    assert len(build_slices("n1", content, 1)) == 1
    empty = build_slices("n1", pool_content([]), 1)
    assert len(empty) == 1 and empty[0]["spec"]["devices"] == []
    with pytest.raises(ValueError, match="max_devices"):
        build_slices("n1", content, 1, max_devices=129)


def test_unhealthy_devices_carry_a_taint_and_change_the_digest() -> None:
    devs = build_devices(nvswitch_box(2))
    healthy = pool_content(devs)
    sick = pool_content(devs, {"gpu-1": "XID 79 (fell off the bus)"})
    assert healthy.digest != sick.digest
    assert "taints" not in sick.devices[0]
    assert sick.devices[1]["taints"] == [
        {"key": UNHEALTHY_TAINT_KEY, "value": "XID-79--fell-off-the-bus", "effect": "NoSchedule"}
    ]
    assert pool_content(devs).digest == healthy.digest  # stable
    assert len(taint_value("x" * 100)) == 63


def test_a_remediation_taint_beside_the_unhealthy_one() -> None:
    from nodeagent.dra.slices import REMEDIATION_TAINT_KEY, remediation_taint

    devs = build_devices(nvswitch_box(2), {})
    content = pool_content(devs, {"gpu-1": "XID 48"}, (), {"gpu-1": [remediation_taint("reset-gpu: XID 48", "NoExecute")]})
    assert "taints" not in content.devices[0]
    assert content.devices[1]["taints"] == [
        {"key": UNHEALTHY_TAINT_KEY, "value": "XID-48", "effect": "NoSchedule"},
        {"key": REMEDIATION_TAINT_KEY, "value": "reset-gpu--XID-48", "effect": "NoExecute"}]
    assert content.digest != pool_content(devs, {"gpu-1": "XID 48"}).digest
    with pytest.raises(ValueError, match="NoSchedule, NoExecute"):
        remediation_taint("x", "PreferNoSchedule")


class ProbeKube:
    """Answers the dry-run create of the taint probe as a server with or without device taints."""

    def __init__(self, keeps: bool | None) -> None:
        self.keeps = keeps
        self.asked: list[str] = []

    def request(self, method: str, path: str, body: dict | None = None, **kw: object) -> dict:  # type: ignore[type-arg]
        from nodeagent.errors import KubeError

        self.asked.append(f"{method} {path}")
        if self.keeps is None:
            raise KubeError("connection refused")
        assert body is not None
        spec = json.loads(json.dumps(body["spec"]))
        if not self.keeps:
            for d in spec["devices"]:
                d.pop("taints", None)
        return {"spec": spec}


@pytest.mark.parametrize("keeps", [True, False])
def test_the_publisher_asks_once_by_a_dry_run_whether_taints_are_kept(keeps: bool) -> None:
    from nodeagent.dra.publisher import SlicePublisher

    kube = ProbeKube(keeps)
    pub = SlicePublisher(kube, "n1")  # type: ignore[arg-type]
    assert pub.device_taints() is keeps and pub.device_taints() is keeps
    assert kube.asked == ["POST /apis/resource.k8s.io/v1/resourceslices?dryRun=All"]


def test_the_taint_question_unanswered_is_asked_again() -> None:
    from nodeagent.dra.publisher import SlicePublisher

    kube = ProbeKube(None)
    pub = SlicePublisher(kube, "n1")  # type: ignore[arg-type]
    assert pub.device_taints() is False and pub.taints is None
    kube.keeps = True
    assert pub.device_taints() is True and len(kube.asked) == 2


def test_claim_cdi_spec_has_device_nodes_and_env(tmp_path: Path) -> None:
    devs = build_devices(mig_box(per_gpu=1, gpus_on=1, gpus_off=1))
    spec = claim_spec("uid-1", devs)
    assert spec["kind"] == CDI_KIND == "gpu.nodeagent.io/claim"
    names = [d["name"] for d in spec["devices"]]
    assert names == ["uid-1-gpu-0-mig-1-0", "uid-1-gpu-1"]
    mig_nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert mig_nodes[0] == "/dev/nvidia0"
    assert all(p.startswith("/dev/nvidia-caps/nvidia-cap") for p in mig_nodes[1:]) and len(mig_nodes) == 3
    assert spec["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={devs[0].uuid},{devs[1].uuid}"]
    assert "/dev/nvidiactl" in [n["path"] for n in spec["containerEdits"]["deviceNodes"]]

    specs = ClaimSpecs(tmp_path / "cdi")
    ids = specs.write("uid-1", devs)
    assert ids == [cdi_device_id("uid-1", "gpu-0-mig-1-0"), "gpu.nodeagent.io/claim=uid-1-gpu-1"]
    path = specs.path("uid-1")
    assert json.loads(path.read_text()) == spec
    assert path.stat().st_mode & 0o777 == 0o644
    assert specs.claim_uids() == {"uid-1"}
    assert specs.remove("uid-1") and not specs.remove("uid-1")
    with pytest.raises(ValueError, match="claim UID"):
        specs.path("../etc")


def test_checkpoint_round_trip_and_damage(tmp_path: Path) -> None:
    path = tmp_path / "state" / "dra-claims.json"
    cp = Checkpoint.load(path)
    assert cp.claims == {}
    rec = ClaimRecord("u1", "ns", "c1", PREPARED, (PreparedDevice(("gpu",), "n1", "gpu-0", ("k=a",)),))
    cp.put(rec)
    assert path.stat().st_mode & 0o777 == 0o600
    assert Checkpoint.load(path).claims == {"u1": rec}
    assert cp.drop("u1") and not cp.drop("u1")
    assert Checkpoint.load(path).claims == {}
    path.write_text('{"version": 1, "claims": {"u": {"state": "bogus"}}}')
    before = path.read_text()
    with pytest.raises(InputError, match=r"DRA checkpoint .*dra-claims.json is damaged"):
        Checkpoint.load(path)
    assert path.read_text() == before
