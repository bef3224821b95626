"""bootstrap's step logic and report with injected parts (the real parts run in tests/e2e)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nodeagent.bootstrap import BootstrapParts, Options, Outcome, StepResult, bootstrap
from nodeagent.config import AgentConfig, apply_overrides
from nodeagent.errors import ConfigError, KubeError, RebootRequired, RuntimeConfigError
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths

INV = Inventory("550.54.15", 12040, ())


class _Kube:
    """An API client that answered (bootstrap closes it at the end)."""

    def close(self) -> None:
        pass


class Node:
    """Records what each part did; the runtime part changes only on the first call (idempotence)."""

    def __init__(self) -> None:
        self.runtime_written = False
        self.restarts = 0
        self.labels: dict[str, str] = {}
        self.rc = False
        self.calls: list[str] = []
        self.cdi_written = False

    def parts(self, **over: Any) -> BootstrapParts:
        def runtime(cfg: AgentConfig, paths: HostPaths) -> StepResult:
            self.calls.append("runtime")
            if self.runtime_written:
                return StepResult(Outcome.UNCHANGED)
            self.runtime_written = True
            return StepResult(Outcome.CHANGED, "runtime nvidia added", {"file": "/etc/containerd/conf.d/99-nvidia.toml"})

        def restart(cfg: AgentConfig, paths: HostPaths) -> StepResult:
            self.restarts += 1
            return StepResult(Outcome.CHANGED, "containerd restarted")

        def rc(kube: Any, cfg: AgentConfig) -> StepResult:
            if self.rc:
                return StepResult(Outcome.UNCHANGED)
            self.rc = True
            return StepResult(Outcome.CHANGED)

        def labels(kube: Any, cfg: AgentConfig, paths: HostPaths, inv: Inventory) -> StepResult:
            want = {"nvidia.com/gpu.count": str(len(inv.gpus))}
            if self.labels == want:
                return StepResult(Outcome.UNCHANGED)
            self.labels = want
            return StepResult(Outcome.CHANGED)

        def cdi(cfg: AgentConfig, paths: HostPaths, inv: Inventory) -> StepResult:
            if self.cdi_written:
                return StepResult(Outcome.UNCHANGED)
            self.cdi_written = True
            return StepResult(Outcome.CHANGED, "wrote /var/run/cdi/nvidia.yaml")

        base: dict[str, Any] = {
            "write_cdi": cdi,
            "discover": lambda c, p: INV,
            "apply_mig": lambda c, p, inv, name: StepResult(Outcome.UNCHANGED, f"already {name}"),
            "configure_runtime": runtime,
            "restart_containerd": restart,
            "ensure_runtimeclass": rc,
            "publish_labels": labels,
            "connect": lambda c, p: _Kube(),
        }
        base.update(over)
        return BootstrapParts(**base)


P = HostPaths(Path("/"))


def results(report: Any) -> dict[str, str]:
    return {s.name: s.outcome.value for s in report.steps}


def test_first_run_changes_second_run_does_not() -> None:
    node = Node()
    r1 = bootstrap(AgentConfig(), P, Options(), node.parts())
    assert results(r1) == {
        "discover": "unchanged", "mig": "skipped", "runtime": "changed", "containerd-restart": "changed",
        "cdi": "changed", "runtimeclass": "changed", "labels": "changed",
    }
    assert r1.changed and r1.exit_code == 0
    r2 = bootstrap(AgentConfig(), P, Options(), node.parts())
    assert not r2.changed and r2.exit_code == 0
    assert results(r2)["containerd-restart"] == "skipped"
    assert node.restarts == 1
    doc = json.loads(json.dumps(r2.to_dict()))
    assert doc["changed"] is False
    assert doc["steps"][0]["step"] == "discover"


def test_api_unreachable_skips_kube_steps() -> None:
    def down(c: AgentConfig, p: HostPaths) -> Any:
        raise KubeError("GET /version: connection refused")

    r = bootstrap(AgentConfig(), P, Options(), Node().parts(connect=down))
    assert results(r)["runtimeclass"] == "skipped"
    assert "API not reachable" in r.steps[-1].reason
    assert r.exit_code == 0


def test_failed_runtime_is_not_restarted_and_exits_1() -> None:
    def bad(c: AgentConfig, p: HostPaths) -> StepResult:
        raise RuntimeConfigError("/etc/containerd/config.toml: cannot parse line 3")

    node = Node()
    r = bootstrap(AgentConfig(), P, Options(), node.parts(configure_runtime=bad))
    assert results(r)["runtime"] == "failed"
    assert results(r)["containerd-restart"] == "skipped"
    assert node.restarts == 0
    assert r.exit_code == 1
    assert "line 3" in r.to_dict()["steps"][2]["reason"]


def test_bad_mig_name_exits_2_and_reboot_exits_3() -> None:
    def unknown(c: AgentConfig, p: HostPaths, inv: Inventory, name: str) -> StepResult:
        raise ConfigError(f"mig config '{name}' not found")

    r = bootstrap(AgentConfig(), P, Options(mig_config="nope"), Node().parts(apply_mig=unknown))
    assert r.exit_code == 2
    assert results(r)["mig"] == "failed"

    def reboot(c: AgentConfig, p: HostPaths, inv: Inventory, name: str) -> StepResult:
        raise RebootRequired("MIG mode change on GPU 0 needs a reboot")

    r = bootstrap(AgentConfig(), P, Options(mig_config="all-enabled"), Node().parts(apply_mig=reboot))
    assert r.exit_code == 3
    assert results(r)["mig"] == "reboot-required"


def test_image_build_no_restart_no_kube() -> None:
    node = Node()
    cfg = apply_overrides(AgentConfig(), {"kube": False})
    r = bootstrap(cfg, P, Options(restart_containerd=False), node.parts())
    assert results(r)["containerd-restart"] == "skipped"
    assert results(r)["labels"] == "skipped"
    assert node.restarts == 0
    assert r.exit_code == 0


def test_crashing_step_still_reports() -> None:
    def boom(c: AgentConfig, p: HostPaths) -> Inventory:
        raise RuntimeError("bug")

    r = bootstrap(AgentConfig(), P, Options(mig_config="x"), Node().parts(discover=boom))
    assert results(r)["discover"] == "failed"
    assert results(r)["mig"] == "skipped"
    assert results(r)["labels"] == "skipped"
    assert r.exit_code == 1


def test_the_runtime_step_uses_the_configured_kubelet_dir_and_reports_warnings_and_notes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import nodeagent.runtime.configure as configure_mod
    from nodeagent.bootstrap import _configure_runtime
    from nodeagent.config import apply_overrides
    from nodeagent.runtime.configure import Options as RuntimeOptions
    from nodeagent.runtime.configure import Result

    seen: list[RuntimeOptions] = []

    def configure(paths: HostPaths, opts: RuntimeOptions) -> Result:
        seen.append(opts)
        return Result(changed=False, restart_needed=False, mode="dropin",
                      warnings=["CRI plugin disabled"], notes=["already wired"])

    monkeypatch.setattr(configure_mod, "configure", configure)
    cfg = apply_overrides(AgentConfig(), {"kubelet.dir": "/data/kubelet"})
    res = _configure_runtime(cfg, P)
    assert [o.kubelet_dir for o in seen] == ["/data/kubelet"]
    assert res.details["warnings"] == ["CRI plugin disabled"] and res.details["notes"] == ["already wired"]


def test_a_restart_that_failed_before_is_done_by_the_next_run() -> None:
    """An earlier run wrote the containerd config and its restart failed (its init container ran again): the
    config is unchanged now, but containerd started before it was written, so this run restarts it."""
    node = Node()
    node.runtime_written = True
    seen: list[list[str]] = []

    def behind(cfg: AgentConfig, paths: HostPaths, files: list[str]) -> str | None:
        seen.append(files)
        return "containerd started before /etc/containerd/config.toml was last written"

    r = bootstrap(AgentConfig(), P, Options(), node.parts(containerd_behind=behind))
    assert results(r)["runtime"] == "unchanged" and results(r)["containerd-restart"] == "changed"
    assert node.restarts == 1 and r.exit_code == 0
    # up to date: nothing restarted
    r2 = bootstrap(AgentConfig(), P, Options(), node.parts(containerd_behind=lambda c, p, f: None))
    assert results(r2)["containerd-restart"] == "skipped" and node.restarts == 1
    # an image build never restarts, and is not even asked
    seen.clear()
    r3 = bootstrap(AgentConfig(), P, Options(restart_containerd=False), node.parts(containerd_behind=behind))
    assert results(r3)["containerd-restart"] == "skipped" and node.restarts == 1 and not seen
