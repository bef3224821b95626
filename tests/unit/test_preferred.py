"""GetPreferredAllocation choices: NVLink sets for whole GPUs, distributed/packed for replicas and MIG."""

from __future__ import annotations

from nodeagent.deviceplugin.server import preferred
from nodeagent.gpu.topology import score_matrix
from nodeagent.sharing.devices import build_resources
from nodeagent.sharing.spec import parse_plugin_config
from tests.unit._dp_inventories import mig_box, nvswitch_box, paired_box


def test_whole_gpus_follow_nvlink() -> None:
    inv = paired_box()
    r = build_resources(inv, parse_plugin_config("version: v1\n"))["nvidia.com/gpu"]
    ids = [d.id for d in r.devices]
    got = preferred(r, ids, [ids[3]], 2, score_matrix(inv), "distributed")
    assert got == [ids[2], ids[3]]
    got4 = preferred(r, ids[1:], [], 4, score_matrix(inv), "distributed")
    assert sorted(got4) == sorted([ids[2], ids[3], ids[4], ids[5]]) or sorted(got4) == sorted(ids[4:8])
    assert preferred(r, ids, [], 0, score_matrix(inv), "distributed") == []


def test_unknown_ids_ignored_and_size_exact() -> None:
    inv = nvswitch_box(8)
    r = build_resources(inv, parse_plugin_config("version: v1\n"))["nvidia.com/gpu"]
    ids = [d.id for d in r.devices]
    for size in range(1, 9):
        got = preferred(r, [*ids, "GPU-x"], [ids[7]], size, score_matrix(inv), "distributed")
        assert len(got) == size and ids[7] in got and "GPU-x" not in got


TS = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"


def test_replicas_distributed_and_packed() -> None:
    inv = nvswitch_box(2)
    r = build_resources(inv, parse_plugin_config(TS))["nvidia.com/gpu"]
    ids = [d.id for d in r.devices]  # GPU0 ::0-3, GPU1 ::0-3
    avail = [i for i in ids if i != ids[0]]  # one replica of GPU 0 already used
    got = preferred(r, avail, [], 2, {}, "distributed")
    assert got == [ids[4], ids[1]]  # least-used GPU first, then alternate
    assert preferred(r, avail, [], 2, {}, "packed") == [ids[1], ids[2]]


def test_mig_devices_spread_over_parents() -> None:
    inv = mig_box(per_gpu=3, gpus_on=2)
    r = build_resources(inv, parse_plugin_config("version: v1\nflags:\n  migStrategy: mixed\n"))["nvidia.com/mig-1g.10gb"]
    ids = [d.id for d in r.devices]  # GPU0: 0-2, GPU1: 3-5
    assert preferred(r, ids, [], 2, {}, "distributed") == [ids[0], ids[3]]
    assert preferred(r, ids, [], 2, {}, "packed") == [ids[0], ids[1]]
