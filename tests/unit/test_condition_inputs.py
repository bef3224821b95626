"""``ctx.shared.conditions``: what components report is kept (across reloads, before the writer runs), a
listener hears each change once and nothing else."""

from __future__ import annotations

from nodeagent.daemon.shared import ConditionInputs, Shared
from nodeagent.kube.conditions import (
    GPU_HEALTHY,
    MIG_CONFIGURED,
    RUNTIME_READY,
    GpuFault,
    GpuHealthInput,
    build_conditions,
)


def test_reports_are_kept_and_only_changes_wake() -> None:
    inputs = ConditionInputs()
    woken: list[int] = []

    def listener() -> None:
        woken.append(1)

    inputs.report_mig(state="success", config="all-1g.10gb")  # before anyone listens: kept
    inputs.subscribe(listener)
    inputs.report_mig(state="success", config="all-1g.10gb")
    assert woken == []
    inputs.report_health(GpuHealthInput(4, (GpuFault(1, "GPU-1", xid=79, lost=True),)))
    inputs.report_health(GpuHealthInput(4, (GpuFault(1, "GPU-1", xid=79, lost=True),)))
    assert len(woken) == 1
    inputs.report_runtime(wired=True)
    inputs.report_cdi(current=True)  # the CDI part leaves the containerd part as it was
    assert len(woken) == 3
    by_type = {c.type: c for c in build_conditions(inputs.snapshot())}
    assert by_type[MIG_CONFIGURED].reason == "MigConfigApplied"
    assert by_type[GPU_HEALTHY].reason == "GpuLost"
    assert (by_type[RUNTIME_READY].status, by_type[RUNTIME_READY].reason) == ("True", "RuntimeWired")
    inputs.report_cdi(current=False, detail="disk full")
    assert {c.type: c for c in build_conditions(inputs.snapshot())}[RUNTIME_READY].reason == "CdiSpecStale"
    inputs.unsubscribe(listener)
    inputs.report_mig(state="failed", config="x", error="bad")
    assert len(woken) == 4


def test_shared_owns_one_inputs_object() -> None:
    shared = Shared()
    assert shared.conditions is shared.conditions
    assert Shared().conditions is not shared.conditions
