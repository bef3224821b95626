"""The conflict detection's pure parts: which other agent acts on what nodeagent acts on, from the facts the
adapters read (sockets that answer, the kubelet's checkpoint, ResourceSlices, managedFields, NFD)."""

from __future__ import annotations

from typing import Any

from nodeagent.adopt.detect import (
    ForeignSocket,
    dra_conflicts,
    feature_label_conflicts,
    mig_manager_conflicts,
    nfd_label_keys,
    plugin_conflicts,
)
from nodeagent.kube.conditions import (
    ConditionSnapshot,
    ConflictInput,
    GpuFault,
    GpuHealthInput,
    build_conditions,
)
from nodeagent.metrics import state_families

WANTED = {"nvidia.com/gpu": "nvidia-gpu.sock", "nvidia.com/mig-1g.10gb": "nvidia-mig-1g.10gb.sock"}
UUIDS = {"GPU-a", "GPU-b", "MIG-c"}


def test_a_plugin_on_our_socket_name_serves_that_resource() -> None:
    (c,) = plugin_conflicts([ForeignSocket("nvidia-gpu.sock", ("GPU-a", "GPU-b"), 42)], {}, WANTED, UUIDS)
    assert (c.kind, c.subject, c.owner, c.reason) == (
        "device-plugin",
        "nvidia.com/gpu",
        "nvidia-gpu.sock",
        "AnotherDevicePlugin",
    )
    assert "pid 42" in c.detail and "2 of its 2 device(s) are this node's GPUs" in c.detail


def test_another_socket_name_is_named_by_the_kubelet_checkpoint() -> None:
    sock = ForeignSocket("dp.1700000000", ("Dev-1", "Dev-2"))
    checkpoint = {"nvidia.com/gpu": ("Dev-1", "Dev-2"), "example.com/x": ("X",)}
    (c,) = plugin_conflicts([sock], checkpoint, WANTED, UUIDS)
    assert (c.subject, c.owner) == ("nvidia.com/gpu", "dp.1700000000")
    # the same socket with devices the checkpoint registers under a resource nodeagent does not serve
    assert plugin_conflicts([sock], {"example.com/x": ("Dev-1",)}, WANTED, UUIDS) == []


def test_another_socket_name_listing_our_device_ids_serves_our_resource() -> None:
    ids = {"nvidia.com/gpu": ["GPU-a", "GPU-b"], "nvidia.com/mig-1g.10gb": ["MIG-c"]}
    (c,) = plugin_conflicts([ForeignSocket("dp.1", ("GPU-b",))], {}, WANTED, UUIDS, ids)
    assert (c.subject, c.owner) == ("nvidia.com/gpu", "dp.1")


def test_an_unknown_resource_with_our_gpus_is_a_conflict_a_plugin_of_other_devices_is_not() -> None:
    (c,) = plugin_conflicts([ForeignSocket("vendor.sock", ("GPU-b",))], {}, WANTED, UUIDS)
    assert c.subject == "GPUs GPU-b"
    assert plugin_conflicts([ForeignSocket("fpga.sock", ("fpga-0",))], {}, WANTED, UUIDS) == []


def _slice(driver: str, *values: str) -> dict[str, Any]:
    return {
        "spec": {
            "driver": driver,
            "devices": [
                {"name": f"d{i}", "attributes": {"uuid": {"string": v}}} for i, v in enumerate(values)
            ],
        }
    }


def test_dra_slices_of_another_driver_with_the_same_uuids() -> None:
    slices = [
        _slice("gpu.nodeagent.io", "GPU-a"),
        _slice("gpu.nvidia.com", "GPU-a", "MIG-c"),
        _slice("other.example.com", "GPU-z"),
    ]
    (c,) = dra_conflicts(slices, "gpu.nodeagent.io", UUIDS)
    assert (c.kind, c.owner, c.subject, c.reason) == (
        "dra-driver",
        "gpu.nvidia.com",
        "2 GPU(s)",
        "AnotherDraDriver",
    )
    assert "GPU-a, MIG-c" in c.detail


def _node(
    managers: dict[str, list[str]], labels: dict[str, str], annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {
            "labels": labels,
            "annotations": annotations or {},
            "managedFields": [
                {
                    "manager": m,
                    "operation": "Update",
                    "fieldsV1": {"f:metadata": {"f:labels": {f"f:{k}": {} for k in keys}}},
                }
                for m, keys in managers.items()
            ],
        }
    }


def test_the_mig_state_label_written_by_another_manager() -> None:
    state = {"nvidia.com/mig.config.state": "success"}
    node = _node(
        {"nvidia-mig-manager": ["nvidia.com/mig.config.state"], "nodeagent": ["nvidia.com/gpu.count"]}, state
    )
    (c,) = mig_manager_conflicts(node)
    assert (c.owner, c.reason) == ("nvidia-mig-manager", "AnotherMigManager")
    assert mig_manager_conflicts(_node({"nodeagent": ["nvidia.com/mig.config.state"]}, state)) == []
    assert mig_manager_conflicts(_node({"nvidia-mig-manager": []}, {})) == []


def test_nfd_owning_our_label_keys() -> None:
    assert nfd_label_keys("cpu-model.id, nvidia.com/gpu.product,") == {
        "feature.node.kubernetes.io/cpu-model.id",
        "nvidia.com/gpu.product",
    }
    node = _node({}, {}, {"nfd.node.kubernetes.io/feature-labels": "cpu-model.id,nvidia.com/gpu.product"})
    feature = {
        "metadata": {"namespace": "gpu-operator", "name": "n1-gfd"},
        "spec": {"labels": {"nvidia.com/gpu.count": "8", "nvidia.com/other": "x"}},
    }
    found = feature_label_conflicts(node, [feature], {"nvidia.com/gpu.product", "nvidia.com/gpu.count"})
    assert [(c.owner, c.subject) for c in found] == [
        ("NFD (nfd.node.kubernetes.io/feature-labels)", "1 label(s)"),
        ("NodeFeature gpu-operator/n1-gfd", "1 label(s)"),
    ]
    assert feature_label_conflicts(node, [feature], {"nodeagent.io/x"}) == []


def test_a_conflict_is_the_gpu_ready_reason_and_a_metric() -> None:
    conflict = ConflictInput(
        "device-plugin",
        "nvidia.com/gpu",
        "nvidia-gpu.sock",
        "AnotherDevicePlugin",
        "another device plugin serves nvidia.com/gpu on nvidia-gpu.sock",
    )
    snap = ConditionSnapshot(health=GpuHealthInput(2), conflicts=(conflict,))
    ready = build_conditions(snap)[0]
    # the status still says whether the GPUs can run work (the other plugin may serve them): no taint rule
    # on GPUReady=False fires in the middle of a migration; the reason and message say who else is there
    assert (ready.status, ready.reason) == ("True", "AnotherDevicePlugin")
    assert ready.message == (
        "all 2 GPU(s) present and healthy; 1 conflict(s) with another agent: another device plugin serves "
        "nvidia.com/gpu on nvidia-gpu.sock"
    )
    assert build_conditions(ConditionSnapshot(health=GpuHealthInput(2)))[0].reason == "AllGpusReady"
    sick = ConditionSnapshot(health=GpuHealthInput(2, (GpuFault(1, xid=48),)), conflicts=(conflict,))
    assert build_conditions(sick)[0].reason == "GpusUnhealthy"  # a fault comes first
    (family,) = [f for f in state_families(snap, {}) if f.name == "nodeagent_conflict"]
    assert [(s.labels, s.value) for s in family.samples] == [
        ({"kind": "device-plugin", "subject": "nvidia.com/gpu", "owner": "nvidia-gpu.sock"}, 1)
    ]


def test_operand_pods_by_their_names_on_the_kubelet() -> None:
    """A node agent that may not list pods finds the operator's operand pods among the pods the kubelet's
    PodResources API names: ``<daemonset>-<5 characters>``."""
    from nodeagent.adopt import operand_pods_by_name

    pods = [
        ("gpu-operator", "nvidia-device-plugin-daemonset-q7x2k"),
        ("gpu-operator", "gpu-feature-discovery-8fz2p"),
        ("gpu-operator", "nvidia-dcgm-exporter-k2m9x"),
        ("gpu-operator", "nvidia-driver-daemonset-7d2kq"),  # the driver stays: not waited for
        ("ml", "nvidia-device-plugin-daemonset-test"),  # not a DaemonSet pod name
        ("ml", "train-0"),
    ]
    assert operand_pods_by_name(pods) == [
        "gpu-operator/gpu-feature-discovery-8fz2p",
        "gpu-operator/nvidia-device-plugin-daemonset-q7x2k",
    ]
    assert "gpu-operator/nvidia-dcgm-exporter-k2m9x" in operand_pods_by_name(pods, with_dcgm_exporter=True)


def test_another_drivers_gpus_are_known_by_uuid_mig_uuid_or_pci_bus_id_and_held_ones_stay_out() -> None:
    from nodeagent.adopt.detect import ForeignDraGpus, gpu_keys
    from tests.unit._dp_inventories import mig_box

    inv = mig_box(per_gpu=1, gpus_on=1, gpus_off=3)
    keys = gpu_keys(inv)
    mig_uuid = inv.gpus[0].mig_devices[0].uuid
    theirs = {"spec": {"driver": "gpu.nvidia.com", "pool": {"name": "n"}, "devices": [
        {"name": "mig-0", "attributes": {"uuid": {"string": mig_uuid}}},
        {"name": "gpu-1", "attributes": {"uuid": {"string": inv.gpus[1].uuid}}},
        # NVML's form of the bus id, upper case: the same GPU as the standard form
        {"name": "gpu-2", "attributes": {"pciBusID": {"string": inv.gpus[2].pci_bus_id.upper()}}},
    ]}}
    (c,) = dra_conflicts([theirs], "gpu.nodeagent.io", (), keys)
    assert (c.owner, c.subject) == ("gpu.nvidia.com", "3 GPU(s)")
    assert "nodeagent leaves GPU(s) 0,1,2 out of its ResourceSlices" in c.detail

    foreign = ForeignDraGpus()
    assert foreign.update([theirs], "gpu.nodeagent.io", keys, set()) == {0, 1, 2}
    # the other driver is gone: only what a pod still holds through one of its claims stays out
    assert foreign.update([], "gpu.nodeagent.io", keys, None) == {0, 1, 2}  # the kubelet cannot be asked
    assert foreign.update([], "gpu.nodeagent.io", keys, {("gpu.nvidia.com", "n", "gpu-2")}) == {2}
    assert foreign.update([], "gpu.nodeagent.io", keys, set()) == set()
    assert foreign.remembered == {}


def test_the_hand_over_switches_the_dra_stack_only_where_it_runs() -> None:
    from nodeagent.adopt import to_switch

    plain = to_switch({"nvidia.com/gpu.deploy.device-plugin": "true"}, False)
    assert plain == ["container-toolkit", "device-plugin", "gpu-feature-discovery", "mig-manager"]
    dra_stack = {f"nvidia.com/gpu.deploy.{op}": "true" for op in (
        "dra-driver", "dra-validator", "dcgm-dra", "dcgm-exporter-dra", "kata-sandbox-device-plugin", "client")}
    assert to_switch(dra_stack, False) == sorted([*plain, "dra-driver", "dra-validator"])
    assert to_switch(dra_stack, True) == sorted([*plain, "dcgm-exporter", "dcgm-exporter-dra", "dra-driver",
                                                 "dra-validator"])


def test_nodeagents_own_node_feature_is_no_conflict() -> None:
    node = {"metadata": {"name": "n1", "annotations": {"nfd.node.kubernetes.io/feature-labels": "nvidia.com/gpu.count"}}}
    own = {"metadata": {"name": "nodeagent-n1", "namespace": "nodeagent",
                        "labels": {"app.kubernetes.io/managed-by": "nodeagent"}},
           "spec": {"labels": {"nvidia.com/gpu.count": "8"}}}
    gfd = {"metadata": {"name": "n1-gfd", "namespace": "gpu-operator"}, "spec": {"labels": {"nvidia.com/gpu.count": "8"}}}
    ours = {"nvidia.com/gpu.count"}
    assert [c.owner for c in feature_label_conflicts(node, [own], ours, through_nfd=True)] == []
    assert [c.owner for c in feature_label_conflicts(node, [own, gfd], ours, through_nfd=True)] == [
        "NodeFeature gpu-operator/n1-gfd"]
    # labels on the Node: NFD's annotation naming nodeagent's keys is a conflict
    assert [c.owner for c in feature_label_conflicts(node, [own], ours)] == [
        "NFD (nfd.node.kubernetes.io/feature-labels)"]
