"""Shared GPUs (consumable capacity, KEP-5075) and admin access on the driver's side: what a shared device
publishes, how it is published to an API server without the feature, and what prepare makes of each share
(CDI device per share, the limits as environment, the checkpoint across a restart)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nodeagent.dra.cdi import ClaimSpecs
from nodeagent.dra.checkpoint import Checkpoint
from nodeagent.dra.devices import build_devices
from nodeagent.dra.quantity import parse_quantity, quantity_int
from nodeagent.dra.service import ClaimPreparer, ClaimRef
from nodeagent.dra.slices import build_slices, consumable_capacity_for, pool_content
from tests.unit._dp_inventories import mig_box
from tests.unit.test_dra_service import POOL, Claims

SHARE_A = "5c1c4e5a-0000-4000-8000-00000000000a"
SHARE_B = "5c1c4e5a-0000-4000-8000-00000000000b"


def inventory() -> Any:
    return mig_box(per_gpu=2, gpus_on=1, gpus_off=2)  # gpu-0 in MIG mode (two 1g.10gb), gpu-1, gpu-2 whole


def shared_devices() -> list[Any]:
    return build_devices(inventory(), shareable=lambda g: g.index in (0, 1))


def test_quantities_parse_exactly() -> None:
    assert quantity_int("30Gi") == 30 << 30
    assert quantity_int("32212254720") == 30 << 30
    assert quantity_int("1.5Gi") == 3 << 29
    assert parse_quantity("250m") * 4 == 1
    assert quantity_int("1e3") == 1000
    for bad in ("", "30 Gi", "Gi", "1.2.3", "1e99", "x" * 100):
        with pytest.raises(ValueError, match="quantity"):
            parse_quantity(bad)


def test_a_shared_gpu_allows_multiple_allocations_of_memory_and_compute() -> None:
    devs = {d.name: d for d in shared_devices()}
    assert devs["gpu-1"].shared and devs["gpu-0-mig-1-0"].shared and not devs["gpu-2"].shared
    body = pool_content(list(devs.values())).devices
    gpu1 = next(d for d in body if d["name"] == "gpu-1")
    assert gpu1["allowMultipleAllocations"] is True
    memory = gpu1["capacity"]["memory"]
    assert memory["value"] == "81559Mi"  # the GPU's memory as NVML reports it
    # whole 256 MiB steps up to the largest that fits; a claim naming no amount takes all of them
    assert memory["requestPolicy"] == {"default": "81408Mi", "validRange": {
        "min": "256Mi", "max": "81408Mi", "step": "256Mi"}}
    assert gpu1["capacity"]["computeShare"] == {"value": "100", "requestPolicy": {
        "default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}}}
    gpu2 = next(d for d in body if d["name"] == "gpu-2")
    assert "allowMultipleAllocations" not in gpu2 and gpu2["capacity"] == {"memory": {"value": "81559Mi"}}


def test_an_api_server_without_consumable_capacity_gets_ordinary_devices() -> None:
    assert [consumable_capacity_for(v) for v in ("v1.34.4", "v1.35.4", "v1.36.3", "v1.37.2", "garbage")] == [
        False, False, True, True, False]
    shared = pool_content(shared_devices())
    plain = pool_content(build_devices(inventory()))
    assert shared.shared and not plain.shared
    # exactly what the pool would be without sharing: same bodies, same hash, same slices
    assert shared.without_sharing() == plain
    assert build_slices("n", shared.without_sharing(), 1) == build_slices("n", plain, 1)


def claim_with_shares(uid: str, name: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    for r in results:
        r.setdefault("driver", "gpu.nodeagent.io")
        r.setdefault("pool", POOL)
    return {"metadata": {"namespace": "ns", "name": name, "uid": uid},
            "status": {"allocation": {"devices": {"results": results}}}}


def preparer(tmp_path: Path, claims: Claims) -> ClaimPreparer:
    p = ClaimPreparer(Checkpoint.load(tmp_path / "state" / "dra-claims.json"), ClaimSpecs(tmp_path / "cdi"),
                      claims.read, POOL)
    p.set_devices(shared_devices())
    return p


def spec_env(tmp_path: Path, uid: str) -> list[str]:
    spec = json.loads((tmp_path / "cdi" / f"gpu.nodeagent.io-claim_{uid}.json").read_text())
    env: list[str] = spec["containerEdits"]["env"]
    return env


async def test_each_share_is_prepared_with_its_own_limits(tmp_path: Path) -> None:
    claims = Claims(
        claim_with_shares("u1", "a", [{"request": "gpu", "device": "gpu-1", "shareID": SHARE_A,
                                       "consumedCapacity": {"memory": "30Gi", "computeShare": "25"}}]),
        claim_with_shares("u2", "b", [{"request": "gpu", "device": "gpu-1", "shareID": SHARE_B,
                                       "consumedCapacity": {"memory": "30Gi", "computeShare": "0"}}]),
    )
    p = preparer(tmp_path, claims)
    got = await p.prepare([ClaimRef("ns", "u1", "a"), ClaimRef("ns", "u2", "b")])
    assert not got["u1"].error and not got["u2"].error, got
    [d1], [d2] = got["u1"].devices, got["u2"].devices
    assert (d1.device, d1.share_id, d1.cdi_device_ids) == (
        "gpu-1", SHARE_A, (f"gpu.nodeagent.io/claim=u1-gpu-1-{SHARE_A}",))
    assert d2.share_id == SHARE_B
    uuid = "GPU-00000001-0000-4000-8000-000000000000"
    assert spec_env(tmp_path, "u1") == [
        f"NVIDIA_VISIBLE_DEVICES={uuid}", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=30720M",
        f"NODEAGENT_GPU_MEMORY_LIMIT={uuid}=30720Mi", f"NODEAGENT_GPU_COMPUTE_SHARE={uuid}=25",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"]
    # no compute reserved: no thread percentage, the memory limit stands
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" not in spec_env(tmp_path, "u2")
    assert f"NODEAGENT_GPU_COMPUTE_SHARE={uuid}=0" in spec_env(tmp_path, "u2")
    # both claims hold GPU 1 (a MIG change must wait for both)
    assert [r.uid for r in p.claims_on(frozenset({1}))[1]] == ["u1", "u2"]

    # a restart answers from the checkpoint and rewrites a lost spec with the same limits
    before = (tmp_path / "cdi" / "gpu.nodeagent.io-claim_u1.json").read_text()
    (tmp_path / "cdi" / "gpu.nodeagent.io-claim_u1.json").unlink()
    again = preparer(tmp_path, claims)
    assert any("rewrote the CDI spec" in line for line in again.recover())
    assert (tmp_path / "cdi" / "gpu.nodeagent.io-claim_u1.json").read_text() == before
    assert (await again.prepare([ClaimRef("ns", "u1", "a")]))["u1"].devices == (d1,)
    assert claims.reads == 2


async def test_two_shares_of_one_device_in_a_claim_add_up_and_a_share_of_an_unshared_device_is_refused(
    tmp_path: Path,
) -> None:
    claims = Claims(
        claim_with_shares("u1", "two", [
            {"request": "a", "device": "gpu-0-mig-1-0", "shareID": SHARE_A, "consumedCapacity": {"memory": "2Gi"}},
            {"request": "b", "device": "gpu-0-mig-1-0", "shareID": SHARE_B, "consumedCapacity": {"memory": "3Gi"}},
            {"request": "c", "device": "gpu-2"}]),
        claim_with_shares("u2", "bad", [{"request": "a", "device": "gpu-2", "shareID": SHARE_A}]),
        claim_with_shares("u3", "over", [{"request": "a", "device": "gpu-1", "shareID": SHARE_A,
                                          "consumedCapacity": {"memory": "90Gi"}}]),
    )
    p = preparer(tmp_path, claims)
    got = await p.prepare([ClaimRef("ns", "u1", "two"), ClaimRef("ns", "u2", "bad"), ClaimRef("ns", "u3", "over")])
    assert [d.device for d in got["u1"].devices] == ["gpu-0-mig-1-0", "gpu-0-mig-1-0", "gpu-2"]
    env = spec_env(tmp_path, "u1")
    mig_uuid = env[0].split("=", 1)[1].split(",")[0]
    assert env[0].count(mig_uuid) == 1  # the device is visible once
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=5120M" in env
    assert "does not share it" in got["u2"].error
    assert "outside its capacity" in got["u3"].error
    assert not (tmp_path / "cdi" / "gpu.nodeagent.io-claim_u2.json").exists()


async def test_admin_access_reaches_the_device_without_holding_its_gpu(tmp_path: Path) -> None:
    claims = Claims(
        claim_with_shares("u1", "monitor", [{"request": "gpu", "device": "gpu-2", "adminAccess": True}]),
        claim_with_shares("u2", "user", [{"request": "gpu", "device": "gpu-2"}]),
    )
    p = preparer(tmp_path, claims)
    got = await p.prepare([ClaimRef("ns", "u1", "monitor")])
    [d] = got["u1"].devices
    assert d.admin and (tmp_path / "cdi" / "gpu.nodeagent.io-claim_u1.json").is_file()
    assert p.claims_on(frozenset({2})) == {}  # not a holder: a MIG change does not wait for it
    # a GPU withdrawn for a MIG change still lets the monitor in, never a user
    p.withdrawn = frozenset({2})
    assert not (await p.prepare([ClaimRef("ns", "u1", "monitor")]))["u1"].error
    assert "being reconfigured" in (await p.prepare([ClaimRef("ns", "u2", "user")]))["u2"].error
    p.withdrawn = frozenset()
    assert not (await p.prepare([ClaimRef("ns", "u2", "user")]))["u2"].error
    assert [r.uid for r in p.claims_on(frozenset({2}))[2]] == ["u2"]
    reloaded = Checkpoint.load(tmp_path / "state" / "dra-claims.json")
    assert reloaded.claims["u1"].devices[0].admin and not reloaded.claims["u2"].devices[0].admin


async def test_device_status_names_each_prepared_device_with_its_uuid_placement_and_share(tmp_path: Path) -> None:
    from nodeagent.dra.status import device_status, merged

    claims = Claims(claim_with_shares("u1", "a", [
        {"request": "a", "device": "gpu-0-mig-1-0"},
        {"request": "b", "device": "gpu-1", "shareID": SHARE_A, "consumedCapacity": {"memory": "30Gi"}}]))
    p = preparer(tmp_path, claims)
    got = await p.prepare([ClaimRef("ns", "u1", "a")])
    entries = device_status("gpu.nodeagent.io", got["u1"].devices, p.devices)
    mig, share = entries
    assert (mig["device"], mig["pool"], "shareID" in mig) == ("gpu-0-mig-1-0", POOL, False)
    assert mig["data"]["migProfile"] == "1g.10gb" and mig["data"]["gpuIndex"] == 0
    assert mig["data"]["uuid"] == p.devices["gpu-0-mig-1-0"].uuid
    assert share["shareID"] == SHARE_A and share["data"]["consumedCapacity"] == {"memory": "30Gi"}
    # another driver's entry and an older entry of ours: ours replaced, the other kept
    other: dict[str, Any] = {"driver": "nic.example.com", "pool": POOL, "device": "nic-0", "data": {}, "conditions": None}
    old = {**mig, "data": {"uuid": "stale"}}
    assert merged([other, old], entries, "gpu.nodeagent.io", {("gpu.nodeagent.io", POOL, "gpu-0-mig-1-0", "")}) == [
        {k: v for k, v in other.items() if v is not None}, *entries]


def test_shared_gpus_config_key() -> None:
    from nodeagent.config import parse_config
    from nodeagent.errors import ConfigError

    assert parse_config("[dra]\nshared_gpus = [0, 3]\n", "t.toml").dra.shared_gpus == (0, 3)
    for bad, why in (("[-1]", "negative GPU index"), ("[1, 1]", "lists a GPU twice"), ('"0"', "list of integers")):
        with pytest.raises(ConfigError, match=why) as e:
            parse_config(f"[dra]\nshared_gpus = {bad}\n", "t.toml")
        assert "dra.shared_gpus" in str(e.value) and "\n" not in str(e.value)
