"""The one MIG pipeline: the same input error is the same error line and exit code from `nodeagent mig`,
`bootstrap --mig-config`, the daemon's config files and the label reconciler; `mig assert` fails when the
config leaves MIG-capable GPUs unselected (as mig-parted's assert does)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent import bootstrap
from nodeagent.config import AgentConfig, apply_overrides
from nodeagent.daemon import read_config_files
from nodeagent.errors import ConfigError
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths
from nodeagent.mig.pipeline import (
    MigPipeline,
    MigSources,
    load_configured_sources,
    load_sources,
    plan_config,
    unselected_mig_gpus,
)
from nodeagent.mig.reconciler import MigReconciler, MigReconcilerOptions
from nodeagent.nvmlsource import open_nvml
from tests.unit.test_mig_cli import run

ONE_GPU = "version: v1\nmig-configs:\n  first:\n  - devices: [0]\n    mig-enabled: false\n"
NONE_SELECTED = ("version: v1\nmig-configs:\n  nothing:\n  - devices: all\n    device-filter: '0x00000000'\n"
                 "    mig-enabled: false\n")
ALL_OFF = "version: v1\nmig-configs:\n  all-off:\n  - devices: all\n    mig-enabled: false\n"
MISSING_INDEX = "version: v1\nmig-configs:\n  nine:\n  - devices: [9]\n    mig-enabled: false\n"


def sim_args(tmp_path: Path) -> list[str]:
    return ["--simulate", "a30x4", "--sim-state", str(tmp_path / "root" / "sim.json")]


def test_missing_hooks_file_is_exit_2_from_the_cli_and_changes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hooks = tmp_path / "nope-hooks.yaml"
    args = ["--root", str(tmp_path / "root"), "mig", "apply", *sim_args(tmp_path), "-c", "all-balanced"]
    code, _, err = run(capsys, *args, "--hooks-file", str(hooks))
    assert code == 2
    assert err == f"error: {hooks}: MIG hooks file (--hooks-file) not found\n"
    # nothing was applied: the same node still asserts all-disabled
    assert run(capsys, "--root", str(tmp_path / "root"), "mig", "assert", *sim_args(tmp_path),
               "-c", "all-disabled")[0] == 0
    # also when the config is already applied (the file is read before anything is planned)
    code, _, err = run(capsys, "--root", str(tmp_path / "root"), "mig", "apply", *sim_args(tmp_path),
                       "-c", "all-disabled", "--hooks-file", str(hooks))
    assert code == 2 and "MIG hooks file (--hooks-file) not found" in err


def test_missing_config_file_is_exit_2_from_the_cli(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yaml"
    for command in ("plan", "apply", "assert"):
        code, _, err = run(capsys, "--root", str(tmp_path), "mig", command, *sim_args(tmp_path),
                           "-f", str(missing))
        assert (code, err) == (2, f"error: {missing}: MIG config file (-f) not found\n"), command


def _bootstrap_config(tmp_path: Path, **overrides: object) -> AgentConfig:
    return apply_overrides(AgentConfig(), {"simulate.machine": "a30x4",
                                           "simulate.state": str(tmp_path / "sim.json"), **overrides})


def test_missing_hooks_file_is_the_same_error_in_bootstrap_daemon_and_reconciler(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path / "root")
    cfg = _bootstrap_config(tmp_path, **{"mig.hooks_file": "/etc/nodeagent/hooks.yaml"})
    expected = f"{paths('/etc/nodeagent/hooks.yaml')}: MIG hooks file (mig.hooks_file) not found"
    # bootstrap --mig-config: the step fails with the input's exit code 2 (it used to differ by caller)
    parts = bootstrap.default_parts()
    with pytest.raises(ConfigError) as e:
        parts.apply_mig(cfg, paths, Inventory("0", 0, ()), "all-balanced")
    assert (str(e.value), e.value.exit_code) == (expected, 2)
    # the daemon reads the same files at start and on SIGHUP: the same line
    with pytest.raises(ConfigError) as e2:
        read_config_files(cfg, paths)
    assert (str(e2.value), e2.value.exit_code) == (expected, 2)
    # the reconciler, when it reads the files itself at each apply
    rec = MigReconciler(node=None, adapter=None, state_dir=tmp_path / "state",  # type: ignore[arg-type]
                        options=MigReconcilerOptions(hooks_file=paths("/etc/nodeagent/hooks.yaml")))
    with pytest.raises(ConfigError) as e3:
        rec._sources()
    assert (str(e3.value), e3.value.exit_code) == (expected, 2)


def test_bootstrap_through_the_pipeline_applies_and_then_is_unchanged(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path / "root")
    cfg = _bootstrap_config(tmp_path)
    parts = bootstrap.default_parts()
    first = parts.apply_mig(cfg, paths, Inventory("0", 0, ()), "all-balanced")
    assert first.outcome is bootstrap.Outcome.CHANGED and first.details["gpus"] == [0, 1, 2, 3]
    again = parts.apply_mig(cfg, paths, Inventory("0", 0, ()), "all-balanced")
    assert again.outcome is bootstrap.Outcome.UNCHANGED


@pytest.mark.parametrize(("text", "name", "unselected"), [
    (ONE_GPU, "first", "1, 2, 3"),
    (NONE_SELECTED, "nothing", "0, 1, 2, 3"),
])
def test_assert_fails_when_the_config_leaves_mig_gpus_unselected(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, name: str, unselected: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    code, out, err = run(capsys, "--root", str(tmp_path), "mig", "assert", *sim_args(tmp_path), "-f", str(f))
    assert code == 1 and out == ""
    assert err.splitlines()[-1] == f"config {name} does not select MIG-capable GPU {unselected}"
    assert f"not selected: GPU {unselected}" in err
    # a config that selects every GPU and is applied passes
    f.write_text(ALL_OFF)
    code, out, _ = run(capsys, "--root", str(tmp_path), "mig", "assert", *sim_args(tmp_path), "-f", str(f))
    assert (code, out.strip()) == (0, "config all-off is applied")


def test_an_index_the_node_lacks_is_refused_exit_2(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(MISSING_INDEX)
    for command in ("plan", "apply", "assert"):
        code, _, err = run(capsys, "--root", str(tmp_path), "mig", command, *sim_args(tmp_path), "-f", str(f))
        assert code == 2, command
        assert err == (f"error: {f}: config nine entry 0: GPU index 9 does not exist on this node "
                       "(GPUs: 0, 1, 2, 3)\n"), command


def test_pipeline_steps_on_the_simulator(tmp_path: Path) -> None:
    adapter = open_nvml("a30x4", tmp_path / "sim.json", HostPaths(tmp_path))
    try:
        sources = load_sources(None)
        assert sources == MigSources(digest=sources.digest) and sources.hooks is None
        pipeline = MigPipeline(adapter, sources)
        prepared = pipeline.prepare("all-balanced")
        assert prepared.recovery is None and not prepared.plan.applied  # no state file: nothing to recover
        pipeline.apply(prepared.plan, prepared.inventory)
        inv, after = pipeline.plan("all-balanced")
        assert after.applied and unselected_mig_gpus(after, inv) == ()
        one = plan_config(MigSources(load_sources(_write(tmp_path, ONE_GPU)).configs), "first", inv)
        assert unselected_mig_gpus(one, inv) == (1, 2, 3)
    finally:
        adapter.close()


def _write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "cfg.yaml"
    f.write_text(text)
    return f


HOOKS = "version: v1\nhooks:\n  apply-start:\n  - workdir: /\n    command: /bin/true\n"


def test_hooks_see_the_files_that_were_read(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path / "root")
    hooks = paths("/etc/nodeagent/hooks.yaml")
    hooks.parent.mkdir(parents=True)
    hooks.write_text(HOOKS)
    settings = apply_overrides(AgentConfig(), {"mig.hooks_file": "/etc/nodeagent/hooks.yaml"}).mig
    adapter = open_nvml("a30x4", tmp_path / "sim.json", paths)
    try:
        # the default config file is absent: generated configs, so no MIG_PARTED_CONFIG_FILE to read
        sources = load_configured_sources(settings, paths)
        pipeline = MigPipeline(adapter, sources)
        runner = pipeline.hook_runner(pipeline.plan("all-balanced")[1])
        assert runner is not None
        env = runner.env
        assert env["MIG_PARTED_CONFIG_FILE"] == "" and env["MIG_PARTED_HOOKS_FILE"] == str(hooks)
        assert env["NODEAGENT_MIG_GPUS"] == "0,1,2,3" and env["MIG_PARTED_SELECTED_CONFIG"] == "all-balanced"
        cfg = paths("/etc/nodeagent/mig-config.yaml")
        cfg.write_text(ALL_OFF)
        sources = load_configured_sources(settings, paths)
        assert sources.config_file == str(cfg) and sources.configs is not None
        assert sources.configs.names == ("all-off",)
    finally:
        adapter.close()
