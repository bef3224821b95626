"""Allocate responses per device-list strategy, device specs, replica mapping and refusals."""

from __future__ import annotations

import pytest

from nodeagent.deviceplugin.allocate import (
    VOLUME_MOUNT_ROOT,
    AllocationError,
    allocate,
    cdi_annotation_key,
    container_allocation,
    mig_cap_minors,
)
from nodeagent.sharing.devices import build_resources
from nodeagent.sharing.spec import parse_plugin_config
from tests.unit._dp_inventories import mig_box, nvswitch_box

TS = "sharing:\n  timeSlicing:\n    failRequestsGreaterThanOne: {fail}\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"


def resource(extra: str = "", inv=None, name: str = "nvidia.com/gpu"):  # type: ignore[no-untyped-def]
    c = parse_plugin_config("version: v1\n" + extra)
    return build_resources(inv or nvswitch_box(4), c)[name], c.flags.plugin


def test_envvar_default() -> None:
    r, flags = resource()
    ids = [r.devices[1].id, r.devices[3].id]
    a = container_allocation(r, flags, ids)
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}
    assert a.mounts == () and a.devices == () and a.annotations == {} and a.cdi_devices == ()


def test_volume_mounts() -> None:
    r, flags = resource("flags:\n  plugin:\n    deviceListStrategy: volume-mounts\n")
    a = container_allocation(r, flags, [r.devices[0].id])
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": VOLUME_MOUNT_ROOT}
    assert [(m.container_path, m.host_path, m.read_only) for m in a.mounts] == [
        (f"{VOLUME_MOUNT_ROOT}/{r.devices[0].id}", "/dev/null", True)
    ]


def test_cdi_annotations_and_cri_together() -> None:
    r, flags = resource("flags:\n  plugin:\n    deviceListStrategy: [cdi-annotations, cdi-cri]\n    cdiAnnotationPrefix: cdi.example/\n")
    ids = [d.id for d in r.devices[:2]]
    a = container_allocation(r, flags, ids)
    names = [f"nvidia.com/gpu={i}" for i in ids]
    assert a.cdi_devices == tuple(names)
    assert a.annotations == {cdi_annotation_key("cdi.example/", ids): ",".join(names)}
    key = next(iter(a.annotations))
    assert key.startswith("cdi.example/nodeagent-device-plugin_") and len(key.split("/")[1]) <= 63
    assert "NVIDIA_VISIBLE_DEVICES" not in a.envs


def test_index_ids_in_envvar() -> None:
    r, flags = resource("flags:\n  plugin:\n    deviceIDStrategy: index\n")
    assert container_allocation(r, flags, ["2", "0"]).envs["NVIDIA_VISIBLE_DEVICES"] == "2,0"


def test_pass_device_specs_whole_gpus() -> None:
    r, flags = resource("flags:\n  plugin:\n    passDeviceSpecs: true\n")
    a = container_allocation(r, flags, [r.devices[2].id])
    assert [d.host_path for d in a.devices] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia2"]
    assert {d.permissions for d in a.devices} == {"rw"}
    assert all(d.container_path == d.host_path for d in a.devices)


def test_pass_device_specs_mig_caps() -> None:
    inv = mig_box(per_gpu=2, gpus_on=2)
    r, flags = resource("flags:\n  migStrategy: mixed\n  plugin:\n    passDeviceSpecs: true\n", inv, "nvidia.com/mig-1g.10gb")
    dev = r.devices[3]  # GPU 1, GI 2
    a = container_allocation(r, flags, [dev.id])
    gi_minor, ci_minor = mig_cap_minors(1, 2, 0)
    assert [d.host_path for d in a.devices][3:] == [
        "/dev/nvidia1",
        f"/dev/nvidia-caps/nvidia-cap{gi_minor}",
        f"/dev/nvidia-caps/nvidia-cap{ci_minor}",
    ]
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == dev.physical.uuid


def test_mig_cap_minor_numbering() -> None:
    # mig-minors: gpu0/gi0/access 3, gpu0/gi0/ci0/access 4, gpu0/gi1/access 12, gpu1/gi0/access 138
    assert mig_cap_minors(0, 0, 0) == (3, 4)
    assert mig_cap_minors(0, 1, 0) == (12, 13)
    assert mig_cap_minors(1, 0, 7) == (138, 146)


def test_replicas_map_to_physical_once() -> None:
    r, flags = resource(TS.format(fail="false"))
    uuid0 = r.devices[0].physical.uuid
    a = container_allocation(r, flags, [f"{uuid0}::0", f"{uuid0}::3", r.devices[4].id])
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == f"{uuid0},{r.devices[4].physical.uuid}"


def test_fail_requests_greater_than_one() -> None:
    r, flags = resource(TS.format(fail="true"))
    assert container_allocation(r, flags, [r.devices[0].id]).envs
    with pytest.raises(AllocationError, match=r"request for 2 devices of shared resource nvidia.com/gpu .*failRequestsGreaterThanOne"):
        container_allocation(r, flags, [r.devices[0].id, r.devices[5].id])


def test_unknown_and_empty_requests_refused() -> None:
    r, flags = resource()
    with pytest.raises(AllocationError, match=r"GPU-bogus were never advertised for nvidia.com/gpu"):
        allocate(r, flags, [[r.devices[0].id], ["GPU-bogus"]])
    with pytest.raises(AllocationError, match="empty allocation request"):
        allocate(r, flags, [[]])


def test_multiple_containers() -> None:
    r, flags = resource()
    out = allocate(r, flags, [[r.devices[0].id], [r.devices[1].id]])
    assert [a.envs["NVIDIA_VISIBLE_DEVICES"] for a in out] == [r.devices[0].id, r.devices[1].id]
