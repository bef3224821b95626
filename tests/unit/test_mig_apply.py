"""Applying plans on the NVML simulator: busy refusal, rollback on failure midway, Ampere vs Hopper, hooks."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest

from nodeagent.errors import GpuBusyError, InsufficientResourcesError, OperationError, RebootRequired
from nodeagent.gpu.inventory import Inventory
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.mig.apply import Applier, GpuCheckpoint, MigStateFile, pod_uid_from_cgroup
from nodeagent.mig.hooks import HookRunner, parse_hooks
from nodeagent.mig.planner import Plan, plan
from nodeagent.mig.spec import parse_config, resolve
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator import inject
from nodeagent.simulator.open import open_sim
from nodeagent.simulator.state import SimStore

POD = "8f0c2a1e-3b4d-4c5e-9f60-718293a4b5c6"


def sim(machine: str) -> tuple[NvmlAdapter, SimStore]:
    nvml = open_sim(machine)
    return adapter_for_sim(nvml), nvml.store


def make_plan(adapter: NvmlAdapter, yaml_text: str, name: str) -> tuple[Inventory, Plan]:
    inv = adapter.discover()
    cfg = parse_config(yaml_text, "t.yaml")
    n, entries = cfg.select(name)
    return inv, plan(inv, resolve(n, entries, inv))


def cfg(devices: str, profiles: dict[str, int] | None, enabled: bool = True) -> str:
    md = "" if profiles is None else "\n      mig-devices: " + json.dumps(profiles)
    return f"version: v1\nmig-configs:\n  c:\n    - devices: {devices}\n      mig-enabled: {str(enabled).lower()}{md}\n"


def snapshot(adapter: NvmlAdapter) -> dict[int, tuple[GpuCheckpoint, tuple[str, ...]]]:
    inv = adapter.discover()
    return {g.index: (GpuCheckpoint.of(g), tuple(sorted(d.uuid for d in g.mig_devices))) for g in inv.gpus}


def test_idle_ampere_switches_without_a_reset(tmp_path: Path) -> None:
    """On bare metal the driver resets an idle A100 itself: the new mode is current at once."""
    adapter, _ = sim("dgx-a100-40gb")
    inv, p = make_plan(adapter, cfg("[1]", {"3g.20gb": 2}), "c")
    result = Applier(adapter).apply(p, inv)
    assert result.resets == ()
    assert adapter.mig_mode(1) == (True, True)


def test_ampere_enable_resets_only_changed_gpus(tmp_path: Path) -> None:
    adapter, store = sim("dgx-a100-40gb")
    inject.write_mig_layout(store, 0, ["3g.20gb", "3g.20gb"])
    for i in range(8):  # a persistence daemon holds every GPU: mode changes stay pending until a reset
        inject.hold_device(store, i, "nvidia-persistenced")
    before = snapshot(adapter)
    inv, p = make_plan(adapter, cfg("[0, 1]", {"3g.20gb": 2}), "c")
    assert [g.index for g in p.touched] == [1]
    state = MigStateFile(tmp_path)
    result = Applier(adapter, state=state).apply(p, inv)
    assert result.resets == (1,)  # Ampere: pending mode made effective by resetting GPU 1 only
    after = snapshot(adapter)
    assert after[0] == before[0]  # same instances, same UUIDs: GPU 0 was not touched
    for i in range(2, 8):
        assert after[i] == before[i]
    assert after[1][0].instances == (("3g.20gb", 0), ("3g.20gb", 4))
    doc = state.load()
    assert doc is not None and doc["phase"] == "success" and doc["touched"] == [1]
    assert doc["checkpoint"][0]["mig_current"] is False


def test_hopper_mode_applies_without_reset() -> None:
    adapter, _ = sim("dgx-h100")
    inv, p = make_plan(adapter, cfg("[2]", {"1g.10gb": 7}), "c")
    result = Applier(adapter).apply(p, inv)
    assert result.resets == ()
    g = adapter.discover().gpu(2)
    assert g.mig_current and len(g.mig_devices) == 7


def test_busy_gpu_refused_with_pid_command_and_pod(tmp_path: Path) -> None:
    adapter, store = sim("dgx-a100-80gb")
    inject.write_mig_layout(store, 3, ["7g.80gb"])
    inject.inject_process(store, 3, 4242, "python")
    proc = tmp_path / "proc" / "4242"
    proc.mkdir(parents=True)
    (proc / "cmdline").write_bytes(b"python\0train.py\0--epochs=3\0")
    (proc / "cgroup").write_text(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        + POD.replace("-", "_") + ".slice/cri-containerd-abc.scope\n")
    before = snapshot(adapter)
    inv, p = make_plan(adapter, cfg("[3]", {"3g.40gb": 2}), "c")
    with pytest.raises(GpuBusyError) as e:
        Applier(adapter, proc_root=tmp_path / "proc", pod_name=lambda uid: "ml/train-0" if uid == POD else None
                ).apply(p, inv)
    msg = str(e.value)
    assert "GPU 3: pid 4242 (python train.py --epochs=3) in pod ml/train-0 (uid " + POD + ")" in msg
    assert e.value.exit_code == 1
    assert snapshot(adapter) == before


def test_adding_instances_next_to_busy_ones_is_allowed() -> None:
    adapter, store = sim("dgx-a100-80gb")
    inject.write_mig_layout(store, 0, ["3g.40gb"])
    inject.inject_process(store, 0, 77, "serve")
    inv, p = make_plan(adapter, cfg("[0]", {"3g.40gb": 1, "1g.10gb": 3}), "c")
    assert not p.gpus[0].destroy and p.gpus[0].mode is None
    Applier(adapter).apply(p, inv)
    assert len(adapter.discover().gpu(0).mig_devices) == 4


@pytest.mark.parametrize("after", [0, 2, 5])
def test_failure_midway_restores_every_touched_gpu_exactly(after: int, tmp_path: Path) -> None:
    adapter, store = sim("dgx-a100-40gb")
    inject.write_mig_layout(store, 0, ["4g.20gb", "2g.10gb", "1g.5gb"])
    inject.write_mig_layout(store, 1, ["1g.5gb"] * 7)
    inject.write_mig_layout(store, 2, ["3g.20gb", "3g.20gb"])  # already matches: must stay untouched
    before = snapshot(adapter)
    inv, p = make_plan(adapter, cfg("[0, 1, 2, 3]", {"3g.20gb": 2}), "c")
    assert [g.index for g in p.touched] == [0, 1, 3]
    inject.fail_next(store, "nvmlDeviceCreateGpuInstanceWithPlacement",
                     int(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES), after=after)
    state = MigStateFile(tmp_path)
    with pytest.raises(InsufficientResourcesError, match=r"restored to their previous layout"):
        Applier(adapter, state=state).apply(p, inv)
    after_snap = snapshot(adapter)
    for i in range(8):
        assert after_snap[i][0] == before[i][0], i  # same mode, same profiles at the same starts
    assert after_snap[2] == before[2]  # untouched GPU kept even its instance UUIDs
    doc = state.load()
    assert doc is not None and doc["phase"] == "failed"


def test_failed_mode_change_rolls_back_ampere_pending() -> None:
    adapter, store = sim("dgx-a100-40gb")
    before = snapshot(adapter)
    inv, p = make_plan(adapter, cfg("[0, 1]", {"7g.40gb": 1}), "c")
    # GPU 0 switches and resets fine, GPU 1's reset fails: both come back to MIG off, nothing pending.
    for i in range(8):
        inject.hold_device(store, i, "dcgm")
    inject.fail_next(store, "simResetGpu", int(pynvml.NVML_ERROR_UNKNOWN), after=1)
    with pytest.raises(OperationError, match="restored"):
        Applier(adapter).apply(p, inv)
    assert snapshot(adapter) == before


def test_reset_impossible_means_reboot_then_resume(tmp_path: Path) -> None:
    adapter, store = sim("dgx-a100-80gb")
    inv, p = make_plan(adapter, cfg("[5]", {"2g.20gb": 3}), "c")
    inject.hold_device(store, 5, "nvidia-persistenced")
    inject.fail_next(store, "simResetGpu", int(pynvml.NVML_ERROR_RESET_REQUIRED))
    state = MigStateFile(tmp_path)
    with pytest.raises(RebootRequired) as e:
        Applier(adapter, state=state).apply(p, inv)
    assert e.value.exit_code == 3
    doc = state.load()
    assert doc is not None and doc["phase"] == "rebooting" and doc["config"] == "c"
    g = adapter.discover().gpu(5)
    assert (g.mig_current, g.mig_pending) == (False, True)  # Ampere: mode pending until reboot
    inject.reboot(store)
    inv, p = make_plan(adapter, cfg("[5]", {"2g.20gb": 3}), "c")
    assert p.gpus[0].mode is None  # the mode persisted through the reboot
    Applier(adapter, state=state).apply(p, inv)
    assert len(adapter.discover().gpu(5).mig_devices) == 3


def test_hopper_loses_mode_on_reboot_and_reapply_restores_it() -> None:
    adapter, store = sim("dgx-h100")
    inv, p = make_plan(adapter, cfg("all", {"3g.40gb": 2}), "c")
    Applier(adapter).apply(p, inv)
    inject.reboot(store)
    inv, p = make_plan(adapter, cfg("all", {"3g.40gb": 2}), "c")
    assert all(g.mode is True for g in p.gpus)
    Applier(adapter).apply(p, inv)
    assert all(len(g.mig_devices) == 2 for g in adapter.discover().gpus)


def test_disable_with_instances(tmp_path: Path) -> None:
    adapter, store = sim("a30x4")
    inject.write_mig_layout(store, 1, ["2g.12gb", "1g.6gb", "1g.6gb"])
    inv, p = make_plan(adapter, cfg("all", None, enabled=False), "c")
    assert [g.index for g in p.touched] == [1]
    Applier(adapter).apply(p, inv)
    g = adapter.discover().gpu(1)
    assert not g.mig_current and not g.mig_devices


def test_hooks_run_in_order_with_environment(tmp_path: Path) -> None:
    adapter, _ = sim("a30x4")
    log = tmp_path / "hooks.log"
    hooks = parse_hooks(
        "version: v1\nhooks:\n"
        + "".join(
            f"  {name}:\n    - workdir: {tmp_path}\n      command: /bin/sh\n"
            f"      args: ['-c', 'echo {name} $MIG_PARTED_SELECTED_CONFIG $NODEAGENT_MIG_GPUS $EXTRA >> hooks.log']\n"
            f"      envs: {{EXTRA: x}}\n"
            for name in ("apply-start", "pre-apply-mode", "pre-apply-config", "apply-exit")
        ),
        "hooks.yaml",
    )
    inv, p = make_plan(adapter, cfg("[0]", {"4g.24gb": 1}), "c")
    env = HookRunner.environment(config_file="t.yaml", hooks_file="hooks.yaml", selected="c", gpus=[0])
    Applier(adapter, hooks=HookRunner(hooks, env)).apply(p, inv)
    assert log.read_text().splitlines() == [
        "apply-start c 0 x", "pre-apply-mode c 0 x", "pre-apply-config c 0 x", "apply-exit c 0 x"]


def test_failing_hook_stops_before_changes_and_still_runs_exit(tmp_path: Path) -> None:
    adapter, _ = sim("a30x4")
    hooks = parse_hooks(
        "version: v1\nhooks:\n  pre-apply-mode:\n    - command: /bin/sh\n      args: ['-c', 'echo no >&2; exit 4']\n"
        f"  apply-exit:\n    - command: /bin/sh\n      args: ['-c', 'touch {tmp_path}/exit-ran']\n")
    before = snapshot(adapter)
    inv, p = make_plan(adapter, cfg("[0]", {"4g.24gb": 1}), "c")
    with pytest.raises(OperationError, match=r"hook pre-apply-mode\[0\] \(/bin/sh -c echo no >&2; exit 4\) exited 4: no"):
        Applier(adapter, hooks=HookRunner(hooks, {})).apply(p, inv)
    assert (tmp_path / "exit-ran").exists()
    assert snapshot(adapter) == before


def test_hooks_file_rules() -> None:
    from nodeagent.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown hook 'post-apply'"):
        parse_hooks("version: v1\nhooks:\n  post-apply: []\n", "h.yaml")
    with pytest.raises(ConfigError, match=r"h.yaml: hook apply-start\[0\]: 'command' must be"):
        parse_hooks("version: v1\nhooks:\n  apply-start:\n    - args: [x]\n", "h.yaml")
    with pytest.raises(ConfigError, match="unknown key 'env'"):
        parse_hooks("version: v1\nhooks:\n  apply-start:\n    - command: x\n      env: {}\n", "h.yaml")


def test_pod_uid_from_cgroup_forms() -> None:
    assert pod_uid_from_cgroup(f"12:memory:/kubepods/besteffort/pod{POD}/0123abcd\n") == POD
    assert pod_uid_from_cgroup("0::/system.slice/ssh.service\n") is None


def test_passthrough_vm_mode_change_means_reboot(tmp_path: Path) -> None:
    """In a passthrough VM SetMigMode answers RESET_REQUIRED: the mode is pending and only a reboot of the
    VM makes it current; the applier says so (exit 3) without trying a reset."""
    adapter, store = sim("vm-a100-passthrough")
    inv, p = make_plan(adapter, cfg("all", {"3g.40gb": 2}), "c")
    state = MigStateFile(tmp_path)
    with pytest.raises(RebootRequired, match="GPU 0: MIG mode on needs a reboot") as e:
        Applier(adapter, state=state).apply(p, inv)
    assert e.value.exit_code == 3
    assert adapter.mig_mode(0) == (False, True)
    inject.reboot(store)
    inv, p = make_plan(adapter, cfg("all", {"3g.40gb": 2}), "c")
    assert p.gpus[0].mode is None
    Applier(adapter, state=state).apply(p, inv)
    assert [d.profile for d in adapter.discover().gpu(0).mig_devices] == ["3g.40gb", "3g.40gb"]


def test_unprivileged_apply_fails_with_one_line() -> None:
    from nodeagent.errors import NvmlPermissionError
    from nodeagent.nvmlsource import adapter_for_sim
    from nodeagent.simulator.nvml import SimulatedNvml

    _, store = sim("dgx-h100")
    inject.write_mig_layout(store, 0, ["3g.40gb"])
    adapter = adapter_for_sim(SimulatedNvml(store, privileged=False))
    with pytest.raises(NvmlPermissionError, match=r"^NVML shows these only to root: GPU instances"):
        adapter.discover()  # what planning starts with
    inv, p = make_plan(adapter_for_sim(SimulatedNvml(store)), cfg("all", {"3g.40gb": 2}), "c")
    adapter.discover(partial=True)
    with pytest.raises(NvmlPermissionError) as e:
        Applier(adapter).apply(p, inv)
    assert str(e.value).startswith("changing MIG needs root: NVML refused to show this user")
    assert "\n" not in str(e.value)
    assert [d.profile for d in adapter_for_sim(SimulatedNvml(store)).discover().gpu(0).mig_devices] == ["3g.40gb"]
