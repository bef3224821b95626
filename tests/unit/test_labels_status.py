"""Extended resources by status JSON patch: planning (pure), including ownership and served names."""

from __future__ import annotations

from nodeagent.gpu.inventory import Gpu, Inventory
from nodeagent.kube.resources import (
    MANAGED_RESOURCES_ANNOTATION,
    ResourceSettings,
    desired_resources,
    json_pointer_escape,
    merge_fields,
    plan_status,
)


def _gpu(i: int, mem: int) -> Gpu:
    return Gpu(i, f"GPU-{i}", "NVIDIA L4", f"00000000:0{i}:00.0", 0x27B810DE, mem, 0, 8, 9, i, "ada")


INV = Inventory("550.54.15", 12040, (_gpu(0, 23034), _gpu(1, 23034)))


def test_desired_memory_in_mib_and_gib() -> None:
    d = desired_resources(INV, ResourceSettings(gpushare_memory="aliyun.com/gpu-mem"))
    assert d == {"nvidia.com/gpu-memory": "46068", "aliyun.com/gpu-mem": "44"}
    assert desired_resources(Inventory("1", 0), ResourceSettings()) == {}


def test_pointer_escape() -> None:
    assert json_pointer_escape("nvidia.com/gpu-memory") == "nvidia.com~1gpu-memory"
    assert json_pointer_escape("a~b/c") == "a~0b~1c"


def test_add_both_capacity_and_allocatable_and_record_ownership() -> None:
    p = plan_status({"cpu": "4"}, {"cpu": "4"}, {}, {"nvidia.com/gpu-memory": "100"}, served=["nvidia.com/gpu"])
    assert p.ops == [
        {"op": "add", "path": "/status/capacity/nvidia.com~1gpu-memory", "value": "100"},
        {"op": "add", "path": "/status/allocatable/nvidia.com~1gpu-memory", "value": "100"},
    ]
    assert p.annotation_before == "nvidia.com/gpu-memory"
    assert p.annotation_after is None


def test_nothing_to_do_when_equal() -> None:
    cap = {"nvidia.com/gpu-memory": "100"}
    p = plan_status(cap, cap, {MANAGED_RESOURCES_ANNOTATION: "nvidia.com/gpu-memory"}, cap, served=())
    assert p.ops == [] and p.annotation_before is None and p.annotation_after is None


def test_served_names_are_never_written_and_reported() -> None:
    p = plan_status({}, {}, {}, {"nvidia.com/gpu": "8"}, served=["nvidia.com/gpu"])
    assert p.ops == [] and p.refused == ("nvidia.com/gpu",)


def test_stale_owned_resource_removed_then_forgotten() -> None:
    cap = {"cpu": "4", "aliyun.com/gpu-mem": "44", "example.com/other": "1"}
    ann = {MANAGED_RESOURCES_ANNOTATION: "aliyun.com/gpu-mem"}
    p = plan_status(cap, cap, ann, {}, served=())
    assert p.ops == [
        {"op": "remove", "path": "/status/capacity/aliyun.com~1gpu-mem"},
        {"op": "remove", "path": "/status/allocatable/aliyun.com~1gpu-mem"},
    ]
    assert p.annotation_after == ""  # remove the annotation afterwards


def test_owned_name_now_served_is_left_to_the_kubelet() -> None:
    cap = {"nvidia.com/gpu-memory": "100"}
    p = plan_status(cap, cap, {MANAGED_RESOURCES_ANNOTATION: "nvidia.com/gpu-memory"}, {}, served=["nvidia.com/gpu-memory"])
    assert p.ops == []
    assert p.annotation_after == ""


def test_reset_value_is_written_again() -> None:
    ann = {MANAGED_RESOURCES_ANNOTATION: "nvidia.com/gpu-memory"}
    p = plan_status({"nvidia.com/gpu-memory": "0"}, {}, ann, {"nvidia.com/gpu-memory": "100"}, served=(),
                    has_allocatable=False)
    assert {"op": "add", "path": "/status/allocatable", "value": {}} in p.ops
    assert {"op": "add", "path": "/status/capacity/nvidia.com~1gpu-memory", "value": "100"} in p.ops


def test_merge_fields_carry_the_same_change_as_the_ops() -> None:
    """The ops of a first publish and of a removal, as status fields of one merge patch."""
    first = plan_status({"cpu": "8"}, {}, {}, {"nvidia.com/gpu-memory": "100", "example.com/a~b": "1"}, [],
                        has_allocatable=False)
    assert merge_fields(first.ops) == {
        "capacity": {"example.com/a~b": "1", "nvidia.com/gpu-memory": "100"},
        "allocatable": {"example.com/a~b": "1", "nvidia.com/gpu-memory": "100"},
    }
    gone = plan_status({"aliyun.com/gpu-mem": "44"}, {"aliyun.com/gpu-mem": "44"},
                       {MANAGED_RESOURCES_ANNOTATION: "aliyun.com/gpu-mem"}, {}, [])
    assert merge_fields(gone.ops) == {"capacity": {"aliyun.com/gpu-mem": None},
                                      "allocatable": {"aliyun.com/gpu-mem": None}}
    assert merge_fields([]) == {}
    try:
        merge_fields([{"op": "add", "path": "/metadata/labels", "value": {}}])
    except ValueError as e:
        assert "not a status op" in str(e)
    else:
        raise AssertionError("a non-status op was accepted")
