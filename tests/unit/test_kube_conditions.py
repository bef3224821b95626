"""The pure GPU Node condition builder and its change planner."""

from __future__ import annotations

import re
from datetime import datetime, timezone

from nodeagent.kube.conditions import (
    CONDITION_TYPES,
    GPU_HEALTHY,
    GPU_READY,
    MESSAGE_MAX,
    MIG_CONFIGURED,
    RUNTIME_READY,
    Condition,
    ConditionSnapshot,
    ConflictInput,
    GpuFault,
    GpuHealthInput,
    MigInput,
    PassthroughInput,
    RuntimeInput,
    build_conditions,
    one_line,
    plan_conditions,
)

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
T1 = datetime(2026, 1, 1, 12, 5, 0, tzinfo=timezone.utc)
CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]*$")


def by_type(s: ConditionSnapshot) -> dict[str, Condition]:
    return {c.type: c for c in build_conditions(s)}


def healthy_node() -> ConditionSnapshot:
    return ConditionSnapshot(
        health=GpuHealthInput(8),
        mig=MigInput(state="success", config="all-1g.10gb"),
        runtime=RuntimeInput(containerd_wired=True, cdi_current=True),
    )


def test_all_good() -> None:
    c = by_type(healthy_node())
    assert list(c) == list(CONDITION_TYPES)
    assert (c[GPU_READY].status, c[GPU_READY].reason) == ("True", "AllGpusReady")
    assert c[GPU_READY].message == "all 8 GPU(s) present and healthy"
    assert (c[GPU_HEALTHY].status, c[GPU_HEALTHY].reason) == ("True", "AllGpusHealthy")
    assert (c[MIG_CONFIGURED].status, c[MIG_CONFIGURED].reason) == ("True", "MigConfigApplied")
    assert "'all-1g.10gb'" in c[MIG_CONFIGURED].message
    assert (c[RUNTIME_READY].status, c[RUNTIME_READY].reason) == ("True", "RuntimeWired")


def test_nothing_known_is_unknown() -> None:
    c = by_type(ConditionSnapshot())
    assert {k: v.status for k, v in c.items()} == {t: "Unknown" for t in CONDITION_TYPES}
    assert c[MIG_CONFIGURED].reason == "MigConfigNotRequested"
    assert c[RUNTIME_READY].reason == "RuntimeCheckPending"


def test_xid_fault_names_index_uuid_xid_and_recovery() -> None:
    s = ConditionSnapshot(health=GpuHealthInput(8, (
        GpuFault(5, "GPU-bbb", xid=79, lost=True),
        GpuFault(2, "GPU-aaa", xid=48, recovery="GPU reset"),
    )))
    c = by_type(s)
    assert (c[GPU_READY].status, c[GPU_READY].reason) == ("False", "GpusUnhealthy")
    assert c[GPU_READY].message == "2 of 8 GPU(s) unhealthy: GPU 2, 5"
    h = c[GPU_HEALTHY]
    assert (h.status, h.reason) == ("False", "GpuLost")  # the worst fault names the reason
    assert h.message == ("2 of 8 GPU(s) unhealthy: GPU 2 (GPU-aaa): XID 48, recovery: GPU reset; "
                         "GPU 5 (GPU-bbb): lost, XID 79, recovery: none")


def test_health_reasons_by_kind() -> None:
    def reason(*faults: GpuFault) -> str:
        return by_type(ConditionSnapshot(health=GpuHealthInput(4, faults)))[GPU_HEALTHY].reason

    assert reason(GpuFault(0, xid=48)) == "XidError"
    assert reason(GpuFault(0, xid=48, recovery="node reboot")) == "GpuRecoveryRequired"
    assert reason(GpuFault(0)) == "GpuUnhealthy"
    gi = by_type(ConditionSnapshot(health=GpuHealthInput(4, (GpuFault(1, "U", xid=94, gi_id=3),))))
    assert "GPU 1 GI 3 (U): XID 94" in gi[GPU_HEALTHY].message


def test_no_gpus_and_no_health_checks() -> None:
    c = by_type(ConditionSnapshot(health=GpuHealthInput(0)))
    assert (c[GPU_READY].status, c[GPU_READY].reason) == ("False", "NoGpusFound")
    c = by_type(ConditionSnapshot(health=GpuHealthInput(4, monitored=False)))
    assert (c[GPU_READY].status, c[GPU_HEALTHY].status) == ("Unknown", "Unknown")
    assert c[GPU_HEALTHY].reason == "HealthChecksUnavailable"


def test_vm_passthrough_is_ready_for_vms_not_missing_gpus() -> None:
    """Every GPU on vfio-pci (NVML finds none): GPUReady True with reason VfioPassthrough naming the GPUs,
    the driver and the resource; GPUHealthy Unknown (the nvidia driver checks nothing it does not own)."""
    p = PassthroughInput(8, ("vfio-pci",), ("nvidia.com/GH100_H100_SXM5_80GB",))
    c = by_type(ConditionSnapshot(health=GpuHealthInput(0), passthrough=p))
    ready, healthy = c[GPU_READY], c[GPU_HEALTHY]
    assert (ready.status, ready.reason) == ("True", "VfioPassthrough")
    assert ready.message == ("8 GPU(s) bound to vfio-pci for virtual machines (nvidia.com/gpu.workload.config="
                             "vm-passthrough), served as nvidia.com/GH100_H100_SXM5_80GB")
    assert (healthy.status, healthy.reason) == ("Unknown", "VfioPassthrough")
    assert "the nvidia driver does not own them" in healthy.message
    assert not ready.provisional and not healthy.provisional
    # a conflict names its reason, the status stays what passthrough says
    conflict = ConflictInput("device-plugin", "nvidia.com/gpu", "other", "AnotherDevicePlugin", "x serves them")
    c = by_type(ConditionSnapshot(health=GpuHealthInput(0), passthrough=p, conflicts=(conflict,)))
    assert (c[GPU_READY].status, c[GPU_READY].reason) == ("True", "AnotherDevicePlugin")
    # GPUs NVML still sees (a GPU left on nvidia, the switch not done): the usual conditions
    c = by_type(ConditionSnapshot(health=GpuHealthInput(2), passthrough=p))
    assert (c[GPU_READY].reason, c[GPU_HEALTHY].reason) == ("AllGpusReady", "AllGpusHealthy")
    # no GPU bound and none found: still NoGpusFound; nothing known yet: Unknown
    c = by_type(ConditionSnapshot(health=GpuHealthInput(0), passthrough=PassthroughInput(0)))
    assert (c[GPU_READY].status, c[GPU_READY].reason) == ("False", "NoGpusFound")
    c = by_type(ConditionSnapshot(health=None, passthrough=p))
    assert c[GPU_READY].status == "Unknown"


def test_mig_states() -> None:
    def mig(**kw: object) -> Condition:
        return by_type(ConditionSnapshot(mig=MigInput(**kw)))[MIG_CONFIGURED]  # type: ignore[arg-type]

    failed = mig(state="failed", config="all-7g.99gb", error="no config named 'all-7g.99gb'\n(known: a, b)")
    assert (failed.status, failed.reason) == ("False", "MigConfigFailed")
    assert failed.message == "MIG config 'all-7g.99gb' failed: no config named 'all-7g.99gb' (known: a, b)"
    assert (mig(state="rebooting", config="x").status, mig(state="rebooting", config="x").reason) == (
        "False", "MigConfigRebootRequired")
    assert mig(state="pending", config="x").reason == "MigConfigPending"
    assert (mig(enabled=False).status, mig(enabled=False).reason) == ("Unknown", "MigManagementDisabled")
    assert mig(state="odd").status == "Unknown"


def test_runtime() -> None:
    def rt(**kw: object) -> Condition:
        return by_type(ConditionSnapshot(runtime=RuntimeInput(**kw)))[RUNTIME_READY]  # type: ignore[arg-type]

    assert rt(containerd_wired=False, containerd_detail="/etc/containerd/conf.d/99-nvidia.toml not as wanted",
              cdi_current=True).reason == "ContainerdNotWired"
    assert rt(containerd_wired=True, cdi_current=False, cdi_detail="disk full").reason == "CdiSpecStale"
    assert rt(containerd_wired=True, cdi_current=None).reason == "CdiSpecPending"
    assert rt(containerd_wired=True, cdi_enabled=False).status == "True"
    assert rt(check_enabled=False).reason == "RuntimeCheckDisabled"


def test_reasons_camel_case_messages_one_bounded_line() -> None:
    many = tuple(GpuFault(i, f"GPU-{'x' * 40}-{i}", xid=79, recovery="node reboot") for i in range(64))
    snaps = [
        healthy_node(), ConditionSnapshot(),
        ConditionSnapshot(health=GpuHealthInput(64, many),
                          mig=MigInput(state="failed", config="c", error="e\n" * 1000),
                          runtime=RuntimeInput(containerd_wired=False, containerd_detail="a\tb\n" * 500)),
    ]
    for s in snaps:
        for c in build_conditions(s):
            assert CAMEL.match(c.reason), c
            assert "\n" not in c.message and "\t" not in c.message, c
            assert 0 < len(c.message) <= MESSAGE_MAX, c
    assert one_line("a" * 600).endswith("...") and len(one_line("a" * 600)) == MESSAGE_MAX


def test_plan_writes_only_changes_and_keeps_transition_time() -> None:
    first = plan_conditions([], build_conditions(healthy_node()), T0)
    assert [c["type"] for c in first] == list(CONDITION_TYPES)
    assert all(c["lastTransitionTime"] == "2026-01-01T12:00:00Z" for c in first)
    # the same again: nothing to write (no heartbeat)
    assert plan_conditions(first, build_conditions(healthy_node()), T1) == []
    # an XID: GPUReady and GPUHealthy change status, transition time moves; the other two stay unwritten
    bad = ConditionSnapshot(health=GpuHealthInput(8, (GpuFault(2, "GPU-a", xid=48),)),
                            mig=healthy_node().mig, runtime=healthy_node().runtime)
    second = plan_conditions(first, build_conditions(bad), T1)
    assert [c["type"] for c in second] == [GPU_READY, GPU_HEALTHY]
    assert all(c["lastTransitionTime"] == "2026-01-01T12:05:00Z" for c in second)
    # a second GPU fails too: message changes, status does not: transition time kept
    current = {c["type"]: c for c in first} | {c["type"]: c for c in second}
    worse = ConditionSnapshot(health=GpuHealthInput(8, (GpuFault(2, "GPU-a", xid=48), GpuFault(3, "GPU-b", xid=48))),
                              mig=healthy_node().mig, runtime=healthy_node().runtime)
    third = plan_conditions(list(current.values()), build_conditions(worse), datetime(2026, 1, 2, tzinfo=timezone.utc))
    assert [c["type"] for c in third] == [GPU_READY, GPU_HEALTHY]
    assert all(c["lastTransitionTime"] == "2026-01-01T12:05:00Z" for c in third)
    assert all(c["lastHeartbeatTime"] == "2026-01-02T00:00:00Z" for c in third)


def test_plan_ignores_other_conditions() -> None:
    kubelet = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting"}
    out = plan_conditions([kubelet], build_conditions(healthy_node()), T0)
    assert "Ready" not in {c["type"] for c in out}


def test_not_known_yet_does_not_replace_a_known_condition() -> None:
    """A restarting agent whose checks have not answered yet leaves the Node's conditions as they are."""
    first = plan_conditions([], build_conditions(healthy_node()), T0)
    assert plan_conditions(first, build_conditions(ConditionSnapshot()), T1) == []
    # on a Node without them, "not known yet" is written as Unknown
    assert {c["status"] for c in plan_conditions([], build_conditions(ConditionSnapshot()), T1)} == {"Unknown"}
    # known-Unknown (the check is off) does replace
    off = ConditionSnapshot(health=GpuHealthInput(8), mig=MigInput(enabled=False),
                            runtime=RuntimeInput(check_enabled=False))
    assert [c["type"] for c in plan_conditions(first, build_conditions(off), T1)] == [MIG_CONFIGURED, RUNTIME_READY]


def test_status_stage_replaces_wakes_and_clears_only_what_was_written() -> None:
    from nodeagent.kube.conditions import StatusStage

    stage = StatusStage()
    woken: list[int] = []
    stage.subscribe(lambda: woken.append(1))
    first = {"capacity": {"nvidia.com/gpu-memory": "100"}}
    stage.stage(first)
    stage.stage(first)  # the same again: nothing new to wake for
    assert stage.peek() == first and woken == [1]
    newer = {"capacity": {"nvidia.com/gpu-memory": "200"}}
    stage.stage(newer)
    stage.clear(first)  # a write of the older values does not drop the newer ones
    assert stage.peek() == newer and woken == [1, 1]
    stage.clear(newer)
    assert stage.peek() == {}
    stage.stage({})  # nothing to write wakes nobody
    assert woken == [1, 1]


def test_rack_conditions_no_longer_applying_are_retired() -> None:
    """Out of the rack (no fabric cluster) NVLinkCliqueReady is retired, with [imex] off IMEXReady; the planner
    deletes a retired type only where the Node has it (strategic-merge delete directive) and nothing else."""
    from nodeagent.gpu.fabric import CliqueDecision
    from nodeagent.kube.conditions import IMEX_READY, NVLINK_CLIQUE_READY, ImexInput, retired_conditions

    member = CliqueDecision(True, "uuid.1", None, "joined")
    outside = CliqueDecision(False, None, None, "no GPU of this node is on an NVLink fabric")
    assert retired_conditions(ConditionSnapshot()) == ()  # no inventory yet: nothing is known to be gone
    assert retired_conditions(ConditionSnapshot(fabric=member)) == ()
    assert retired_conditions(ConditionSnapshot(fabric=outside)) == (NVLINK_CLIQUE_READY,)
    assert retired_conditions(ConditionSnapshot(fabric=outside, imex_off=True)) == (NVLINK_CLIQUE_READY, IMEX_READY)
    running = ImexInput(running=True, ready=True, clique="uuid.1")
    assert retired_conditions(ConditionSnapshot(fabric=member, imex=running)) == ()
    assert NVLINK_CLIQUE_READY not in by_type(ConditionSnapshot(fabric=outside))

    current = [{"type": NVLINK_CLIQUE_READY, "status": "True", "reason": "CliqueJoined", "message": "x"},
               {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet"}]
    out = plan_conditions(current, [], T0, (NVLINK_CLIQUE_READY, IMEX_READY))
    assert out == [{"type": NVLINK_CLIQUE_READY, "$patch": "delete"}]
    assert plan_conditions(current[1:], [], T0, (NVLINK_CLIQUE_READY,)) == []
