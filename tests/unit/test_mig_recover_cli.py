"""`nodeagent mig apply` and `nodeagent bootstrap --mig-config` resolve the crash record a killed agent left.

The record is made the way a SIGKILL makes it: an apply through the real ``Applier`` that dies (a
``BaseException``, so no rollback runs) half-way through building GPU 1, with the MIG state file at the place
every command shares under ``--root`` (``/var/lib/nodeagent/mig``). The simulator state is a file, so the
command then sees exactly the half-changed GPUs the dead agent left.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodeagent.cli import main
from nodeagent.hostpaths import HostPaths
from nodeagent.mig.apply import Applier, GpuCheckpoint, MigStateFile
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator import inject
from nodeagent.simulator.open import open_sim
from tests.unit.test_mig_recovery import CONFIG, DyingAdapter, Killed, arrange_inside, make_plan

OLD = ["3g.40gb", "3g.40gb"]


def killed_mid_apply(root: Path, sim_state: Path) -> tuple[dict[int, GpuCheckpoint], dict[int, GpuCheckpoint]]:
    """GPUs 0 and 1 start with 2 x 3g.40gb, GPU 2 with MIG off; the config ``c`` makes 7 x 1g.10gb on GPUs 0-2.
    The apply dies inside the 10th create: GPU 0 done, GPU 1 half built (a GPU instance without compute
    instance), GPU 2 in MIG mode without instances.
    Returns the old and the new layouts."""
    sim_state.parent.mkdir(parents=True, exist_ok=True)
    nvml = open_sim("dgx-h100", sim_state)
    store = nvml.store
    inject.write_mig_layout(store, 0, OLD)
    inject.write_mig_layout(store, 1, OLD)
    adapter = adapter_for_sim(nvml)
    old = {g.index: GpuCheckpoint.of(g) for g in adapter.discover().gpus}
    inv, p = make_plan(adapter)
    new = {**old, **{g.index: GpuCheckpoint.target(g) for g in p.gpus}}
    state = MigStateFile(HostPaths(root).mig_state_dir)
    arrange_inside(store, "create", 10)
    with pytest.raises(Killed):
        Applier(DyingAdapter(adapter, "create", 10, "inside"), state=state).apply(p, inv)
    inject.recover(store)  # the faults that stopped it are gone; the next process runs on a healthy machine
    assert state.inflight(), "the dead apply must leave its in-flight record"
    assert any(g.bare_gpu_instances for g in adapter.discover().gpus)
    return old, new


def layouts(sim_state: Path) -> dict[int, GpuCheckpoint]:
    return {g.index: GpuCheckpoint.of(g) for g in adapter_for_sim(open_sim(None, sim_state)).discover().gpus}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


def test_mig_apply_recovers_the_record_of_a_killed_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, sim_state = tmp_path / "root", tmp_path / "root" / "sim.json"
    old, new = killed_mid_apply(root, sim_state)
    config = tmp_path / "mig.yaml"
    config.write_text(CONFIG)
    # another config than the dead run's: the half-changed GPUs must be whole before the new plan is made
    code, out, err = run(capsys, "--root", str(root), "mig", "apply", "--sim-state", str(sim_state),
                         "-f", str(config), "-c", "c")
    assert code == 0, err
    assert "recovered from an interrupted apply of MIG config c: restored GPU 1, 2 to the previous layout" in out
    assert "applied c to GPU" in out
    assert layouts(sim_state) == new
    assert MigStateFile(HostPaths(root).mig_state_dir).inflight() == []
    # nothing left to recover or apply the second time
    code, out, _ = run(capsys, "--root", str(root), "mig", "apply", "--sim-state", str(sim_state),
                       "-f", str(config), "-c", "c")
    assert code == 0 and "recovered" not in out and "nothing to do" in out
    assert old != new


def test_mig_apply_of_the_old_layout_after_a_crash_gets_the_old_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, sim_state = tmp_path / "root", tmp_path / "root" / "sim.json"
    old, _ = killed_mid_apply(root, sim_state)
    config = tmp_path / "old.yaml"
    config.write_text("version: v1\nmig-configs:\n  old:\n    - devices: [0, 1]\n      mig-enabled: true\n"
                      "      mig-devices: {3g.40gb: 2}\n    - devices: [2, 3, 4, 5, 6, 7]\n      mig-enabled: false\n")
    code, out, err = run(capsys, "--root", str(root), "mig", "apply", "--sim-state", str(sim_state),
                         "-f", str(config), "-c", "old")
    assert code == 0, err
    assert "recovered from an interrupted apply" in out
    assert layouts(sim_state) == old  # no orphan GPU instance left behind, the exact old placements


def test_bootstrap_recovers_the_record_of_a_killed_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, sim_state = tmp_path / "root", tmp_path / "root" / "sim.json"
    _, new = killed_mid_apply(root, sim_state)
    etc = root / "etc/nodeagent"
    etc.mkdir(parents=True)
    (etc / "mig-config.yaml").write_text(CONFIG)
    (etc / "config.toml").write_text("[runtime]\nenabled = false\n")
    code, out, err = run(capsys, "--root", str(root), "bootstrap", "--sim-state", str(sim_state), "--no-kube",
                         "--mig-config", "c")
    assert code == 0, err
    report = json.loads(out)
    (mig,) = [s for s in report["steps"] if s["step"] == "mig"]
    assert mig["result"] == "changed", mig
    assert "restored GPU 1, 2 to the previous layout" in mig["details"]["recovered"]
    assert layouts(sim_state) == new
    assert MigStateFile(HostPaths(root).mig_state_dir).inflight() == []
    code, out, _ = run(capsys, "--root", str(root), "bootstrap", "--sim-state", str(sim_state), "--no-kube",
                       "--mig-config", "c")
    assert code == 0 and json.loads(out)["changed"] is False


def test_bad_input_leaves_the_crash_record_and_the_gpus_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, sim_state = tmp_path / "root", tmp_path / "root" / "sim.json"
    killed_mid_apply(root, sim_state)
    before = layouts(sim_state)
    code, _, err = run(capsys, "--root", str(root), "mig", "apply", "--sim-state", str(sim_state), "-c", "nope")
    assert code == 2 and "no config named 'nope'" in err
    (root / "etc/nodeagent").mkdir(parents=True)
    (root / "etc/nodeagent/config.toml").write_text("[runtime]\nenabled = false\n")
    code, out, _ = run(capsys, "--root", str(root), "bootstrap", "--sim-state", str(sim_state), "--no-kube",
                       "--mig-config", "nope")
    assert code == 2, out
    assert layouts(sim_state) == before
    assert MigStateFile(HostPaths(root).mig_state_dir).inflight()
