"""The clique label decision from fabric info, as gpu-feature-discovery decides it."""

from __future__ import annotations

import dataclasses

from nodeagent.gpu import fabric
from nodeagent.gpu.fabric import CliqueReason, decide
from nodeagent.gpu.inventory import Fabric, Gpu, Inventory

UUID = "7B968A6D-C8AA-45E1-9E07-E1E51BE99C31".lower()
HEALTHY = 2 | (2 << 2) | (2 << 4) | (2 << 6) | (1 << 8) | (1 << 12)


def _gpu(i: int, f: Fabric | None) -> Gpu:
    return Gpu(index=i, uuid=f"GPU-{i}", name="NVIDIA GB200", pci_bus_id=f"0000000{i}:01:00.0",
               pci_device_id=0x294110DE, memory_mib=189471, numa_node=0, compute_major=10, compute_minor=0,
               minor_number=i, architecture="blackwell", fabric=f)


def _inv(*fabrics: Fabric | None) -> Inventory:
    return Inventory("570.133.20", 12080, tuple(_gpu(i, f) for i, f in enumerate(fabrics)))


OK = Fabric(state=3, status=0, cluster_uuid=UUID, clique_id=1, health_mask=HEALTHY, health_summary=1)


def test_label_value_is_gfds() -> None:
    d = decide(_inv(OK, OK, OK, OK))
    assert d.value == "7b968a6d-c8aa-45e1-9e07-e1e51be99c31.1" and d.reason is CliqueReason.JOINED
    assert not d.withheld and d.degraded == ()


def test_not_applicable_without_fabric_or_cluster() -> None:
    assert not decide(_inv(None, None)).applicable
    single = Fabric(state=3, status=0, cluster_uuid=fabric.ZERO_UUID, clique_id=0)
    assert not decide(_inv(single, single)).applicable


def test_withheld_with_reasons() -> None:
    cases = {
        CliqueReason.NOT_STARTED: dataclasses.replace(OK, state=1),
        CliqueReason.IN_PROGRESS: dataclasses.replace(OK, state=2),
        CliqueReason.FABRIC_ERROR: dataclasses.replace(OK, status=999),
    }
    for reason, bad in cases.items():
        d = decide(_inv(OK, bad, OK, OK))
        assert d.withheld and d.reason is reason and "GPU 1" in d.message
    d = decide(_inv(OK, OK, dataclasses.replace(OK, clique_id=2), OK))
    assert d.reason is CliqueReason.DISAGREE and f"{UUID}.2" in d.message


def test_health_problems_reported_label_kept() -> None:
    degraded = dataclasses.replace(OK, health_mask=(HEALTHY & ~0x3) | 1, health_summary=3)
    d = decide(_inv(OK, degraded))
    assert d.value is not None and d.degraded == ("GPU 1: degraded bandwidth",)
    unhealthy = dataclasses.replace(OK, health_mask=(HEALTHY & ~(0x3 << 4)) | (1 << 4))
    assert fabric.health_problems(unhealthy) == ["route unhealthy"]
    assert fabric.summary_name(3) == "LIMITED_CAPACITY" and fabric.state_name(2) == "IN_PROGRESS"
