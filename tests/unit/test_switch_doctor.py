"""What ``doctor`` says of the two label-driven switches from the Node's labels."""

from __future__ import annotations

from nodeagent.doctor.findings import Report
from nodeagent.doctor.node import switch_findings


def _said(labels: dict[str, str]) -> list[tuple[str, str]]:
    report = Report()
    switch_findings(labels, report)
    return [(f.level, f.text) for f in report.findings]


def test_applied_failed_pending_and_absent() -> None:
    assert _said({}) == []
    assert _said({"nvidia.com/gpu.workload.config": "vm-passthrough",
                  "nvidia.com/gpu.workload.config.state": "vm-passthrough"}) == [
        ("ok", "nvidia.com/gpu.workload.config.state=vm-passthrough")]
    assert _said({"nvidia.com/cc.mode": "on", "nvidia.com/cc.mode.state": "failed"}) == [
        ("error", "nvidia.com/cc.mode=on failed (see the CcModeFailed Event on the Node)")]
    [(level, text)] = _said({"nvidia.com/cc.mode": "on", "nvidia.com/cc.mode.state": "off"})
    assert level == "warning" and text.startswith("nvidia.com/cc.mode=on is not applied (nvidia.com/cc.mode.state is off)")
    assert _said({"nvidia.com/cc.mode": "on", "nvidia.com/cc.mode.state": "on",
                  "nvidia.com/cc.ready.state": "true"}) == [
        ("ok", "nvidia.com/cc.mode.state=on, nvidia.com/cc.ready.state=true")]


def test_switch_components_are_opt_in_and_need_the_api() -> None:
    from nodeagent.config import AgentConfig, apply_overrides, parse_config
    from nodeagent.daemon import default_specs

    specs = {s.name: s for s in default_specs()}
    assert specs["vfio"].sections == frozenset({"vfio"}) and specs["cc"].sections == frozenset({"cc"})
    assert not AgentConfig().vfio.enabled and not AgentConfig().cc.enabled

    class Ctx:
        config = apply_overrides(AgentConfig(), {"vfio.enabled": True, "cc.enabled": True})
        kube = None

    assert specs["vfio"].build(Ctx()) is None  # type: ignore[arg-type]
    assert specs["cc"].build(Ctx()) is None  # type: ignore[arg-type]
    Ctx.config = AgentConfig()
    Ctx.kube = object()  # type: ignore[assignment]
    assert specs["vfio"].build(Ctx()) is None  # type: ignore[arg-type]
    cfg = parse_config('[cc]\nenabled = true\ntool = "/opt/gpu-admin-tools/nvidia_gpu_tools.py"\n', "c.toml")
    assert cfg.cc.tool == "/opt/gpu-admin-tools/nvidia_gpu_tools.py"
