"""doctor's facts from the host itself (nodeagent/hostcommands.py, doctor's HostChecks): systemd's state of the
agent's unit turned into findings, the GPU Operator's device-plugin switch as a conflict, and the bounds of the
one adapter that runs programs (real programs: sh, sleep)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from nodeagent.adopt.detect import operator_conflicts
from nodeagent.config import AgentConfig
from nodeagent.doctor import HostChecks, Report, Sources
from nodeagent.doctor.agent import _unit_activity
from nodeagent.errors import NodeAgentError
from nodeagent.hostcommands import ConfigVerdict, UnitState, run_bounded
from nodeagent.hostpaths import HostPaths


def _src(state: UnitState | None) -> Sources:
    def no_gpus() -> object:
        raise NodeAgentError("no NVML here")

    host = None if state is None else HostChecks(
        unit_state=lambda unit: state, containerd_loads=lambda config: ConfigVerdict("containerd", True))
    return Sources(paths=HostPaths(Path("/")), config=AgentConfig(), discover=no_gpus,  # type: ignore[arg-type]
                   command=lambda sub: f"nodeagent {sub}", host=host)


def _unit(**props: str) -> UnitState:
    return UnitState("nodeagent.service", {"LoadState": "loaded", "NRestarts": "0", **props})


@pytest.mark.parametrize(("props", "level", "start"), [
    ({"ActiveState": "active", "SubState": "running", "Result": "success"}, "ok",
     "nodeagent.service active (running), result success, 0 restart(s)"),
    ({"ActiveState": "failed", "SubState": "failed", "Result": "exit-code", "NRestarts": "5"}, "error",
     "nodeagent.service failed (failed), result exit-code, 5 restart(s) since it was started: systemd gave up"),
    ({"ActiveState": "activating", "SubState": "auto-restart", "Result": "watchdog"}, "error",
     "nodeagent.service activating (auto-restart), result watchdog"),
    ({"ActiveState": "inactive", "SubState": "dead", "Result": "success"}, "ok", "nodeagent.service inactive (dead)"),
])
def test_systemds_state_of_the_unit(props: dict[str, str], level: str, start: str) -> None:
    report = Report()
    _unit_activity(_src(_unit(**props)), True, report)
    (finding,) = report.findings
    assert (finding.area, finding.level) == ("agent", level) and finding.text.startswith(start), finding
    assert ("journalctl -u nodeagent -b" in finding.fix) == (level == "error"), finding


def test_no_unit_no_systemd_and_the_sandbox() -> None:
    report = Report()
    _unit_activity(_src(UnitState("nodeagent.service", {"LoadState": "not-found", "ActiveState": "inactive"})),
                   False, report)
    _unit_activity(_src(UnitState("nodeagent.service", {}, "systemctl is not on PATH")), False, report)
    assert report.findings == []  # nothing installed, nothing to tell
    _unit_activity(_src(UnitState("nodeagent.service", {}, "Failed to connect to bus")), True, report)
    assert [(f.level, f.text) for f in report.findings] == [
        ("warning", "nodeagent.service: systemd's state not read: Failed to connect to bus")]
    sandbox = Report()
    _unit_activity(_src(None), True, sandbox)
    (said,) = sandbox.findings
    assert said.level == "ok" and "not checked under --root /" in said.text


def test_the_operators_device_plugin_switch() -> None:
    def node(value: str | None) -> dict[str, object]:
        labels = {} if value is None else {"nvidia.com/gpu.deploy.device-plugin": value}
        return {"metadata": {"labels": labels}}

    assert operator_conflicts(node(None), ["nvidia.com/gpu"]) == []
    assert operator_conflicts(node("false"), ["nvidia.com/gpu"]) == []
    assert operator_conflicts(node("true"), []) == []  # nothing nodeagent would serve (the DRA plane)
    (c,) = operator_conflicts(node("true"), ["nvidia.com/gpu"])
    assert (c.kind, c.subject, c.reason) == ("gpu-operator", "nvidia.com/gpu", "GpuOperatorDevicePlugin")
    assert "nodeagent leaves nvidia.com/gpu to it" in c.detail


def test_the_adapter_bounds_time_and_output() -> None:
    big = run_bounded([sys.executable, "-c", "import sys; sys.stdout.write('x' * (3 << 20))"], max_output=1000)
    assert big.returncode == 0 and big.stdout == "x" * 1000 and big.problem == ""
    start = time.monotonic()
    slow = run_bounded(["sleep", "30"], timeout=0.5)
    assert time.monotonic() - start < 5 and slow.returncode is None and "did not end within 0.5 s" in slow.problem
    missing = run_bounded(["/nonexistent/containerd", "--version"])
    assert missing.returncode is None and "cannot be run" in missing.problem
    failed = run_bounded(["sh", "-c", "echo out; echo 'first' >&2; echo 'last' >&2; exit 3"])
    assert (failed.returncode, failed.stdout, failed.stderr) == (3, "out\n", "first\nlast\n")
