"""KEP-5304 device metadata written by the DRA driver: the file per prepared request (a stream of
v1beta1 and v1alpha1 ``DeviceMetadata``), the CDI spec mounting it where the released library puts it, its
generation when a device's attributes change, and its removal at unprepare and recovery."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from nodeagent.dra.cdi import ClaimSpecs
from nodeagent.dra.checkpoint import Checkpoint
from nodeagent.dra.devices import build_devices
from nodeagent.dra.metadata import ClaimMetadata, first_generation, group_requests
from nodeagent.dra.service import ClaimPreparer, ClaimRef
from nodeagent.hostpaths import HostPaths
from tests.unit._dp_inventories import mig_box
from tests.unit.test_dra_service import DRIVER, POOL, Claims, claim

DATA = "/var/lib/kubelet/plugins/gpu.nodeagent.io/dra-device-metadata"
INSIDE = "/var/run/kubernetes.io/dra-device-attributes"


def make(root: Path, claims: Claims, inventory: Any = None) -> ClaimPreparer:
    paths = HostPaths(root)
    meta = ClaimMetadata(DRIVER, paths(DATA), paths("/var/run/cdi"), root=paths, published=paths.published)
    p = ClaimPreparer(Checkpoint.load(paths("/var/lib/nodeagent/dra-claims.json"), paths),
                      ClaimSpecs(paths("/var/run/cdi"), paths), claims.read, POOL, metadata=meta)
    p.set_devices(build_devices(inventory or mig_box(per_gpu=2, gpus_on=1, gpus_off=2)))
    return p


def stream(path: Path) -> list[dict[str, Any]]:
    decoder = json.JSONDecoder()
    text, i, out = path.read_text(), 0, []
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)
    return out


async def test_each_request_gets_its_metadata_file_and_cdi_mount_and_unprepare_removes_them(tmp_path: Path) -> None:
    root = tmp_path / "root"
    claims = Claims(claim("u1", "one", [("gpu", "gpu-1"), ("mig/small", "gpu-0-mig-1-0"), ("mig/small", "gpu-2")]))
    p = make(root, claims)
    out = (await p.prepare([ClaimRef("ns", "u1", "one")]))["u1"]
    assert out.error == ""
    # the metadata CDI device of each (base) request rides on the request's first device
    assert [d.cdi_device_ids for d in out.devices] == [
        ("gpu.nodeagent.io/claim=u1-gpu-1", "gpu.nodeagent.io/metadata=u1_gpu"),
        ("gpu.nodeagent.io/claim=u1-gpu-0-mig-1-0", "gpu.nodeagent.io/metadata=u1_mig"),
        ("gpu.nodeagent.io/claim=u1-gpu-2",),
    ]
    host = root / DATA.lstrip("/") / "ns_one"
    docs = stream(host / "mig" / "metadata.json")
    assert [d["apiVersion"] for d in docs] == ["metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1"]
    assert docs[0] | {"apiVersion": ""} == docs[1] | {"apiVersion": ""}
    doc = docs[0]
    assert doc["kind"] == "DeviceMetadata"
    assert doc["metadata"] == {"name": "one", "namespace": "ns", "uid": "u1", "generation": 1}
    assert "podClaimName" not in doc
    [req] = doc["requests"]
    assert req["name"] == "mig/small"  # the full request name; the path has the base request
    assert [(d["driver"], d["pool"], d["name"]) for d in req["devices"]] == [
        (DRIVER, POOL, "gpu-0-mig-1-0"), (DRIVER, POOL, "gpu-2")]
    mig, whole = (d["attributes"] for d in req["devices"])
    dev = p.devices["gpu-0-mig-1-0"]
    assert mig["uuid"] == {"string": dev.uuid} and mig["profile"] == {"string": "1g.10gb"}
    assert mig["parentUUID"] == dev.attributes["parentUUID"]
    assert mig["memory"]["int"] == int(dev.capacity["memory"]["value"].removesuffix("Mi")) << 20
    assert whole["resource.kubernetes.io/pciBusID"] == p.devices["gpu-2"].attributes["resource.kubernetes.io/pciBusID"]
    assert whole["productName"]["string"] and whole["driverVersion"] == {"version": "550.54.15"}
    assert stream(host / "gpu" / "metadata.json")[0]["requests"][0]["devices"][0]["name"] == "gpu-1"
    assert oct((host / "gpu" / "metadata.json").stat().st_mode & 0o777) == "0o644"

    spec = json.loads((root / "var/run/cdi/gpu.nodeagent.io_metadata_u1_mig.json").read_text())
    assert spec == {"cdiVersion": "0.5.0", "kind": "gpu.nodeagent.io/metadata", "devices": [{
        "name": "u1_mig", "containerEdits": {"mounts": [{
            "hostPath": str(host / "mig" / "metadata.json"),
            "containerPath": f"{INSIDE}/resourceclaims/one/mig/gpu.nodeagent.io-metadata.json",
            "options": ["ro", "bind"]}]}}]}

    # a restarted driver answers from its checkpoint with the same IDs, nothing rewritten
    before = (host / "gpu" / "metadata.json").stat().st_mtime_ns
    p2 = make(root, claims)
    assert p2.recover() == []
    assert (await p2.prepare([ClaimRef("ns", "u1", "one")]))["u1"] == out
    assert (host / "gpu" / "metadata.json").stat().st_mtime_ns == before

    assert await p2.unprepare([ClaimRef("ns", "u1", "one")]) == {"u1": ""}
    assert not host.exists()
    assert sorted((root / "var/run/cdi").iterdir()) == []


async def test_a_template_claim_is_mounted_under_its_pod_claim_name_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    made = claim("u1", "pod-gpu-x7k2", [("gpu", "gpu-1")])
    made["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpu"}
    bad = claim("u2", "pod-gpu-bad", [("gpu", "gpu-2")])
    bad["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "../../etc"}
    p = make(root, Claims(made, bad))
    out = await p.prepare([ClaimRef("ns", "u1", "pod-gpu-x7k2"), ClaimRef("ns", "u2", "pod-gpu-bad")])
    assert out["u1"].error == ""
    spec = json.loads((root / "var/run/cdi/gpu.nodeagent.io_metadata_u1_gpu.json").read_text())
    mount = spec["devices"][0]["containerEdits"]["mounts"][0]
    assert mount["containerPath"] == f"{INSIDE}/resourceclaimtemplates/gpu/gpu/gpu.nodeagent.io-metadata.json"
    assert mount["hostPath"] == str(root / DATA.lstrip("/") / "ns_pod-gpu-x7k2/gpu/metadata.json")
    assert stream(Path(mount["hostPath"]))[0]["podClaimName"] == "gpu"
    # the pod claim name survives a restart (a reboot emptied /var/run/cdi: the spec is written again alike)
    (root / "var/run/cdi/gpu.nodeagent.io_metadata_u1_gpu.json").unlink()
    p2 = make(root, Claims(made, bad))
    assert p2.recover() == ["wrote the device metadata of claim ns/pod-gpu-x7k2 (u1)"]
    assert json.loads((root / "var/run/cdi/gpu.nodeagent.io_metadata_u1_gpu.json").read_text()) == spec
    assert out["u2"].error == ("annotation resource.kubernetes.io/pod-claim-name '../../etc' is not a DNS label, "
                               "so it cannot name a device metadata file")
    assert "u2" not in p.checkpoint.claims and not (root / DATA.lstrip("/") / "ns_pod-gpu-bad").exists()
    assert not (root / "var/run/cdi/gpu.nodeagent.io-claim_u2.json").exists()


async def test_a_changed_attribute_raises_the_generation_and_recovery_drops_orphans(tmp_path: Path) -> None:
    root = tmp_path / "root"
    claims = Claims(claim("u1", "one", [("gpu", "gpu-1")]))
    inv = mig_box(per_gpu=2, gpus_on=1, gpus_off=2)
    p = make(root, claims, inv)
    assert (await p.prepare([ClaimRef("ns", "u1", "one")]))["u1"].error == ""
    file = root / DATA.lstrip("/") / "ns_one/gpu/metadata.json"
    assert first_generation(file.read_text()) is not None
    assert await p.refresh_metadata() == []  # nothing changed: nothing written
    assert stream(file)[0]["metadata"]["generation"] == 1

    # the driver was upgraded under the running claim: its devices' attributes changed
    p.set_devices(build_devices(dataclasses.replace(inv, driver_version="580.65.6")))
    assert await p.refresh_metadata() == ["ns/one"]
    docs = stream(file)
    assert [d["metadata"]["generation"] for d in docs] == [2, 2]
    assert docs[0]["requests"][0]["devices"][0]["attributes"]["driverVersion"] == {"version": "580.65.6"}
    assert await p.refresh_metadata() == []

    # files no record owns (a process killed between writing them and recording the claim) go at start
    meta = p.metadata
    assert meta is not None
    meta.write("ns", "ghost", "u9", None, group_requests([(("gpu",), POOL, p.devices["gpu-2"])]))
    assert meta.claim_uids() == {"u1", "u9"}
    p2 = make(root, claims, dataclasses.replace(inv, driver_version="580.65.6"))
    done = p2.recover()
    assert done == ["removed the orphaned device metadata CDI specs of claim u9",
                    "removed the orphaned device metadata of ns_ghost"], done
    assert meta.claim_uids() == {"u1"} and meta.claim_dirs() == {"ns_one"}
    assert stream(file)[0]["metadata"]["generation"] == 2
