"""Dynamic MIG through partitionable devices on the NVML simulator: the published counters forbid every
pair of overlapping placements (and every pair the simulated driver refuses) on every simulated MIG GPU
model; NodePrepareResources creates the allocated GPU instance and Unprepare destroys it; a kill at any
step is finished or undone by the next start; a GPU with a static layout is never touched."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from nodeagent.dra import checkpoint as ckpt
from nodeagent.dra.cdi import ClaimSpecs
from nodeagent.dra.checkpoint import Checkpoint
from nodeagent.dra.devices import DraDevice, build_counter_sets, build_devices, mig_counters, with_instance
from nodeagent.dra.service import ClaimPreparer, ClaimRef
from nodeagent.dra.slices import (
    LAYOUT_INLINE,
    LAYOUT_SEPARATE,
    MAX_COUNTER_SETS,
    MAX_DEVICES_ADVANCED,
    MAX_SHARED_COUNTERS_INLINE,
    build_slices,
    layout_for,
    pool_content,
)
from nodeagent.errors import InsufficientResourcesError
from nodeagent.gpu.inventory import Gpu, Inventory
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator import inject
from nodeagent.simulator.machine import load_machine, machine_names
from nodeagent.simulator.open import open_sim

POOL = "node-a"
DRIVER = "gpu.nodeagent.io"


def mig_models() -> list[str]:
    """One machine per simulated MIG product."""
    seen: dict[str, str] = {}
    for name in machine_names():
        for spec in load_machine(name).gpus:
            if spec.mig_product is not None and spec.mig_product.key not in seen:
                seen[spec.mig_product.key] = name
    return sorted(seen.values())


def sim_with_mig(machine: str, state: Path | None = None, gpus: tuple[int, ...] = (0,)) -> NvmlAdapter:
    adapter = adapter_for_sim(open_sim(machine, state))
    for i in gpus:
        if adapter.set_mig_mode(i, True):
            adapter.reset_gpu(i)
    return adapter


def all_dynamic(gpu: Gpu) -> bool:
    return True


def gpu_devices(inv: Inventory, index: int) -> list[DraDevice]:
    return [d for d in build_devices(inv, dynamic_mig=all_dynamic) if d.gpu_index == index]


def fits_together(counters: Mapping[str, int], *devs: DraDevice) -> bool:
    used: dict[str, int] = {}
    for d in devs:
        [(_, consumed)] = d.consumes.items()
        for k, v in consumed.items():
            used[k] = used.get(k, 0) + v
    return all(v <= counters[k] for k, v in used.items())


def overlap(a: DraDevice, b: DraDevice) -> bool:
    assert a.placement is not None and b.placement is not None
    ra = set(range(a.placement.start, a.placement.start + a.placement.size))
    return bool(ra & set(range(b.placement.start, b.placement.start + b.placement.size)))


@pytest.mark.parametrize("machine", mig_models())
def test_counters_forbid_every_overlapping_pair_and_match_the_driver(machine: str) -> None:
    adapter = sim_with_mig(machine)
    inv = adapter.discover()
    gpu = inv.gpu(0)
    devs = gpu_devices(inv, 0)
    counters = mig_counters(gpu)
    # one device per placement of each profile NVML offers, named after profile and start
    assert len(devs) == sum(len(p.placement_starts) for p in gpu.mig_profiles) > 0
    assert len({d.name for d in devs}) == len(devs)
    assert all(len(d.name) <= 63 for d in devs)
    assert all(len(d.attributes) + len(d.capacity) <= 32 for d in devs)
    for d in devs:
        assert fits_together(counters, d), d.name  # each placement fits an empty GPU alone
    refused = 0
    for a, b in itertools.combinations(devs, 2):
        assert a.placement is not None and b.placement is not None
        together = fits_together(counters, a, b)
        if overlap(a, b):
            assert not together, f"{machine}: {a.name} and {b.name} overlap but fit the counters"
        # and the counters agree with the simulated driver on every pair
        first = adapter.create_mig_device(0, a.placement.profile, a.placement.start)
        try:
            second = adapter.create_mig_device(0, b.placement.profile, b.placement.start)
        except InsufficientResourcesError:
            second = None
        assert (second is not None) == together, f"{machine}: {a.name} + {b.name}"
        refused += second is None
        if second is not None:
            adapter.destroy_mig_device(0, second.gi_id)
        adapter.destroy_mig_device(0, first.gi_id)
    assert refused > 0


@pytest.mark.parametrize("machine", mig_models())
def test_every_models_pool_fits_the_api_limits_in_both_layouts(machine: str) -> None:
    gpus = tuple(range(len(load_machine(machine).gpus)))
    adapter = sim_with_mig(machine, gpus=gpus)
    inv = adapter.discover()
    devs = build_devices(inv, dynamic_mig=all_dynamic)
    content = pool_content(devs, None, build_counter_sets(devs, inv))
    assert len(content.counter_sets) == len(gpus)
    for layout in (LAYOUT_SEPARATE, LAYOUT_INLINE):
        slices = build_slices(POOL, content, 1, layout=layout)
        assert sum(len(s["spec"].get("devices", [])) for s in slices) == len(devs)
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}
        sets_seen = [cs["name"] for s in slices for cs in s["spec"].get("sharedCounters", [])]
        assert sorted(sets_seen) == sorted(cs["name"] for cs in content.counter_sets)
        for s in slices:
            spec = s["spec"]
            assert len(spec.get("devices", [])) <= MAX_DEVICES_ADVANCED
            own = {cs["name"] for cs in spec.get("sharedCounters", [])}
            if layout == LAYOUT_SEPARATE:
                assert not (spec.get("devices") and spec.get("sharedCounters"))  # one or the other
                assert len(spec.get("sharedCounters", [])) <= MAX_COUNTER_SETS
            else:
                assert sum(len(cs["counters"]) for cs in spec.get("sharedCounters", [])) <= MAX_SHARED_COUNTERS_INLINE
                for d in spec.get("devices", []):
                    assert {c["counterSet"] for c in d["consumesCounters"]} <= own  # 1.34: same slice


def test_layout_follows_the_server_version() -> None:
    assert layout_for("v1.34.4") == LAYOUT_INLINE
    assert layout_for("v1.35.0") == LAYOUT_SEPARATE
    assert layout_for("v1.37.2") == LAYOUT_SEPARATE
    assert layout_for("garbage") == LAYOUT_SEPARATE


# -- prepare / unprepare ------------------------------------------------------------------------------

def claim(uid: str, name: str, devices: list[str]) -> dict[str, Any]:
    results = [{"request": "mig", "driver": DRIVER, "pool": POOL, "device": d} for d in devices]
    return {"metadata": {"namespace": "ns", "name": name, "uid": uid},
            "status": {"allocation": {"devices": {"results": results}}}}


class Claims:
    def __init__(self, *items: dict[str, Any]) -> None:
        self.items = {c["metadata"]["name"]: c for c in items}

    def read(self, namespace: str, name: str) -> Mapping[str, Any]:
        return self.items[name]


def preparer(tmp_path: Path, adapter: NvmlAdapter, claims: Claims) -> ClaimPreparer:
    p = ClaimPreparer(Checkpoint.load(tmp_path / "state" / "dra-claims.json"), ClaimSpecs(tmp_path / "cdi"),
                      claims.read, POOL, mig=adapter)
    p.set_devices(build_devices(adapter.discover(), dynamic_mig=all_dynamic))
    return p


def instances(adapter: NvmlAdapter, index: int = 0) -> list[tuple[str, int]]:
    gpu = adapter.discover().gpu(index)
    return sorted((m.profile, m.placement_start) for m in (*gpu.mig_devices, *gpu.bare_gpu_instances))


async def test_prepare_creates_the_instance_and_unprepare_destroys_it(tmp_path: Path) -> None:
    adapter = sim_with_mig("dgx-h100", tmp_path / "sim.json")
    claims = Claims(claim("u1", "one", ["gpu-0-mig-3g-40gb-at-4"]),
                    claim("u2", "two", ["gpu-0-mig-1g-10gb-at-0", "gpu-0-mig-2g-20gb-at-2"]))
    p = preparer(tmp_path, adapter, claims)
    out = await p.prepare([ClaimRef("ns", "u1", "one"), ClaimRef("ns", "u2", "two")])
    assert out["u1"].error == "" and out["u2"].error == ""
    assert instances(adapter) == [("1g.10gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)]
    [dev] = out["u1"].devices
    assert dev.cdi_device_ids == ("gpu.nodeagent.io/claim=u1-gpu-0-mig-3g-40gb-at-4",)
    assert dev.mig is not None and dev.mig.uuid.startswith("MIG-")
    spec = json.loads(p.specs.path("u1").read_text())
    assert spec["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={dev.mig.uuid}"]
    nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes[0] == "/dev/nvidia0" and any("nvidia-cap" in n for n in nodes[1:])
    assert Checkpoint.load(p.checkpoint.path).claims["u1"].state == ckpt.PREPARED
    # idempotent: no second instance
    assert (await p.prepare([ClaimRef("ns", "u1", "one")]))["u1"] == out["u1"]
    assert len(instances(adapter)) == 3

    # an overlapping placement cannot be created while u1 holds 4..7; nothing is left behind
    claims.items["bad"] = claim("u3", "bad", ["gpu-0-mig-4g-40gb-at-0"])
    bad = await p.prepare([ClaimRef("ns", "u3", "bad")])
    assert "u3" not in p.checkpoint.claims and bad["u3"].error
    assert len(instances(adapter)) == 3 and not p.specs.path("u3").exists()

    assert await p.unprepare([ClaimRef("ns", "u1", "one"), ClaimRef("ns", "u2", "two")]) == {"u1": "", "u2": ""}
    assert instances(adapter) == [] and p.checkpoint.claims == {} and p.specs.claim_uids() == set()
    assert await p.unprepare([ClaimRef("ns", "u1", "one")]) == {"u1": ""}


@pytest.mark.parametrize("step", ["recorded", "instance-created", "spec-written"])
async def test_a_kill_during_prepare_is_undone_by_the_next_start(tmp_path: Path, step: str) -> None:
    state = tmp_path / "sim.json"
    adapter = sim_with_mig("dgx-a100-40gb", state)
    claims = Claims(claim("u1", "one", ["gpu-0-mig-3g-20gb-at-0"]), claim("u2", "two", ["gpu-0-mig-1g-5gb-at-6"]))
    p = preparer(tmp_path, adapter, claims)
    assert (await p.prepare([ClaimRef("ns", "u2", "two")]))["u2"].error == ""
    # what the files hold when the process is killed at ``step`` of preparing u1
    dev = p.devices["gpu-0-mig-3g-20gb-at-0"]
    gpu_uuid = adapter.discover().gpu(0).uuid
    pd = ckpt.PreparedDevice(("mig",), POOL, dev.name, ("gpu.nodeagent.io/claim=u1-" + dev.name,),
                        ckpt.MigInstance(0, gpu_uuid, "3g.20gb", 0))
    p.checkpoint.put(ckpt.ClaimRecord("u1", "ns", "one", ckpt.PREPARING, (pd,)))
    if step != "recorded":
        inst = adapter.create_mig_device(0, "3g.20gb", 0)
        if step == "spec-written":
            p.specs.write("u1", [with_instance(dev, inst)])
    assert Checkpoint.load(p.checkpoint.path).claims["u1"].state == ckpt.PREPARING

    # a fresh process over the same simulator state file
    adapter2 = adapter_for_sim(open_sim(None, state))
    p2 = preparer(tmp_path, adapter2, claims)
    done = p2.recover(adapter2.discover())
    assert any("undid the interrupted prepare" in line for line in done)
    assert instances(adapter2) == [("1g.5gb", 6)]  # the other claim's instance is untouched
    assert sorted(p2.checkpoint.claims) == ["u2"] and p2.specs.claim_uids() == {"u2"}
    # the kubelet retries: prepared now
    assert (await p2.prepare([ClaimRef("ns", "u1", "one")]))["u1"].error == ""
    assert instances(adapter2) == [("1g.5gb", 6), ("3g.20gb", 0)]


async def test_a_kill_during_unprepare_is_finished_and_a_lost_instance_drops_the_record(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    adapter = sim_with_mig("dgx-a100-40gb", state)
    claims = Claims(claim("u1", "one", ["gpu-0-mig-3g-20gb-at-0"]), claim("u2", "two", ["gpu-0-mig-1g-5gb-at-6"]))
    p = preparer(tmp_path, adapter, claims)
    out = await p.prepare([ClaimRef("ns", "u1", "one"), ClaimRef("ns", "u2", "two")])
    assert out["u1"].error == "" and out["u2"].error == ""
    # killed after recording "unpreparing" (instance still there, or already destroyed)
    rec = p.checkpoint.claims["u1"]
    p.checkpoint.put(dataclasses.replace(rec, state=ckpt.UNPREPARING))
    # while an unprepare is unfinished, a prepare of the same claim is refused (nothing created twice)
    again = await p.prepare([ClaimRef("ns", "u1", "one")])
    assert "being unprepared" in again["u1"].error and len(instances(adapter)) == 2
    p2 = preparer(tmp_path, adapter_for_sim(open_sim(None, state)), claims)
    assert any("finished the interrupted unprepare" in line for line in p2.recover(p2.mig.discover()))  # type: ignore[union-attr]
    assert instances(adapter) == [("1g.5gb", 6)] and not p2.specs.path("u1").exists()
    assert sorted(p2.checkpoint.claims) == ["u2"]

    # the GPU instance vanished (reboot / GPU reset): the prepared record is dropped, the kubelet re-prepares
    adapter.destroy_mig_device(0, adapter.discover().gpu(0).mig_devices[0].gi_id)
    p3 = preparer(tmp_path, adapter_for_sim(open_sim(None, state)), claims)
    assert any("its MIG instance is gone" in line for line in p3.recover(p3.mig.discover()))  # type: ignore[union-attr]
    assert p3.checkpoint.claims == {} and p3.specs.claim_uids() == set()


_KILLED_CHILD = r'''
import asyncio, sys, time
from pathlib import Path
from nodeagent.dra.cdi import ClaimSpecs
from nodeagent.dra.checkpoint import Checkpoint
from nodeagent.dra.devices import build_devices
from nodeagent.dra.service import ClaimPreparer, ClaimRef
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator import inject
from nodeagent.simulator.open import open_sim

tmp, device, stop_after = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
adapter = adapter_for_sim(open_sim(None, tmp / "sim.json"))
real_create = adapter.create_mig_device


def create(index, profile, start=None):
    if stop_after == "recorded":
        print("stopped", flush=True)
        time.sleep(600)
    made = real_create(index, profile, start)
    print("stopped", flush=True)  # the GPU instance exists; the spec and the prepared record do not
    time.sleep(600)
    return made


adapter.create_mig_device = create
claim = {"metadata": {"namespace": "ns", "name": "one", "uid": "u1"}, "status": {"allocation": {"devices": {
    "results": [{"request": "mig", "driver": "gpu.nodeagent.io", "pool": "node-a", "device": device}]}}}}
p = ClaimPreparer(Checkpoint.load(tmp / "state" / "dra-claims.json"), ClaimSpecs(tmp / "cdi"),
                  lambda ns, name: claim, "node-a", mig=adapter)
p.set_devices(build_devices(adapter.discover(), dynamic_mig=lambda g: True))
asyncio.run(p.prepare([ClaimRef("ns", "u1", "one")]))
'''


@pytest.mark.parametrize("stop_after", ["recorded", "instance-created"])
def test_kill_9_during_prepare_is_undone_by_the_next_start(tmp_path: Path, stop_after: str) -> None:
    """A real SIGKILL of a preparing process (simulator state in a file shared with this process)."""
    adapter = sim_with_mig("dgx-h100", tmp_path / "sim.json")
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(tmp_path), "gpu-0-mig-3g-40gb-at-0", stop_after],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "stopped"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert Checkpoint.load(tmp_path / "state" / "dra-claims.json").claims["u1"].state == ckpt.PREPARING
    assert instances(adapter) == ([("3g.40gb", 0)] if stop_after == "instance-created" else [])

    fresh = adapter_for_sim(open_sim(None, tmp_path / "sim.json"))
    p = preparer(tmp_path, fresh, Claims(claim("u1", "one", ["gpu-0-mig-3g-40gb-at-0"])))
    assert any("undid the interrupted prepare" in line for line in p.recover(fresh.discover()))
    assert instances(fresh) == [] and p.checkpoint.claims == {} and p.specs.claim_uids() == set()


async def test_unprepare_waits_for_a_busy_instance_and_copes_with_a_vanished_one(tmp_path: Path) -> None:
    state = tmp_path / "sim.json"
    adapter = sim_with_mig("dgx-h100", state)
    sim = open_sim(None, state)
    claims = Claims(claim("u1", "one", ["gpu-0-mig-2g-20gb-at-0"]), claim("u2", "two", ["gpu-0-mig-1g-10gb-at-6"]))
    p = preparer(tmp_path, adapter, claims)
    out = await p.prepare([ClaimRef("ns", "u1", "one"), ClaimRef("ns", "u2", "two")])
    assert out["u1"].error == "" and out["u2"].error == ""
    m1 = out["u1"].devices[0].mig
    assert m1 is not None and m1.gi_id is not None
    # a process still runs on u1's instance: unprepare fails, stays recorded, and a prepare is refused
    inject.inject_process(sim.store, 0, 4242, "trainer", gi_id=m1.gi_id)
    err = await p.unprepare([ClaimRef("ns", "u1", "one")])
    assert err["u1"] and p.checkpoint.claims["u1"].state == ckpt.UNPREPARING
    assert ("2g.20gb", 0) in instances(adapter)
    inject.kill_process(sim.store, 0, 4242)
    assert await p.unprepare([ClaimRef("ns", "u1", "one")]) == {"u1": ""}
    assert instances(adapter) == [("1g.10gb", 6)] and "u1" not in p.checkpoint.claims
    # u2's instance vanished behind the driver's back (a GPU reset): unprepare still completes
    m2 = out["u2"].devices[0].mig
    assert m2 is not None and m2.gi_id is not None
    adapter.destroy_mig_device(0, m2.gi_id)
    assert await p.unprepare([ClaimRef("ns", "u2", "two")]) == {"u2": ""}
    assert p.checkpoint.claims == {} and p.specs.claim_uids() == set()


async def test_a_fault_on_a_created_instance_hits_its_device_only(tmp_path: Path) -> None:
    """NVML ties an XID to the GPU instance it hit: while a claim holds a dynamic MIG device, a fault on its
    instance makes that device unhealthy and no other placement of the GPU; a whole-GPU fault hits them all;
    once unprepared, the placement is no longer tied to that instance id."""
    from nodeagent.dra.health import unhealthy_devices

    adapter = sim_with_mig("dgx-h100", tmp_path / "sim.json")
    claims = Claims(claim("u1", "one", ["gpu-0-mig-3g-40gb-at-4"]), claim("u2", "two", ["gpu-0-mig-1g-10gb-at-0"]))
    p = preparer(tmp_path, adapter, claims)
    out = await p.prepare([ClaimRef("ns", "u1", "one"), ClaimRef("ns", "u2", "two")])
    assert out["u1"].error == "" and out["u2"].error == ""
    live = p.live_instances()
    assert set(live) == {"gpu-0-mig-3g-40gb-at-4", "gpu-0-mig-1g-10gb-at-0"}
    gi = live["gpu-0-mig-3g-40gb-at-4"]
    assert gi == next(m.gi_id for m in adapter.discover().gpu(0).mig_devices if m.placement_start == 4)
    devices = list(p.devices.values())
    assert unhealthy_devices(devices, {(0, gi): "XID 48"}, live) == {"gpu-0-mig-3g-40gb-at-4": "XID 48"}
    assert unhealthy_devices(devices, {(0, gi): "XID 48"}) == {}  # without the live map: not tied to any device
    whole = unhealthy_devices(devices, {(0, None): "XID 79"}, live)
    assert set(whole) == {d.name for d in devices if d.gpu_index == 0} and len(whole) > 2
    assert await p.unprepare([ClaimRef("ns", "u1", "one")]) == {"u1": ""}
    assert unhealthy_devices(devices, {(0, gi): "XID 48"}, p.live_instances()) == {}
