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
