"""`nodeagent mig plan|apply|assert|export` on a simulator state file, through the real entry point."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from nodeagent.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str, stdin: str | None = None,
        monkeypatch: pytest.MonkeyPatch | None = None) -> tuple[int, str, str]:
    if stdin is not None:
        assert monkeypatch is not None
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


def test_plan_apply_assert_export(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    state = str(tmp_path / "root" / "sim.json")
    root = ["--root", str(tmp_path / "root")]
    sim = ["--simulate", "a30x4", "--sim-state", state]
    code, out, _ = run(capsys, *root, "mig", "plan", *sim, "-c", "all-balanced")
    assert code == 0
    assert "GPU 0 (NVIDIA A30): enable MIG mode; create 2g.12gb@0, 1g.6gb@2, 1g.6gb@3" in out
    assert run(capsys, *root, "mig", "assert", *sim, "-c", "all-balanced")[0] == 1
    code, out, _ = run(capsys, *root, "mig", "apply", *sim, "-c", "all-balanced")
    # idle A30s on bare metal: the driver switches MIG mode itself, no explicit reset
    assert code == 0 and "applied all-balanced to GPU 0, 1, 2, 3\n" in out and "reset" not in out
    assert (tmp_path / "root/var/lib/nodeagent/mig/mig-state.json").exists()
    assert run(capsys, *root, "mig", "assert", *sim, "-c", "all-balanced")[0] == 0
    code, exported, _ = run(capsys, *root, "mig", "export", *sim)
    assert code == 0 and "1g.6gb: 2" in exported
    # the export is a config file the same node asserts as applied (-f - reads stdin, -c optional)
    code, out, _ = run(capsys, *root, "mig", "assert", *sim, "-f", "-", stdin=exported, monkeypatch=monkeypatch)
    assert (code, out.strip()) == (0, "config current is applied")


def test_bad_input_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    sim = ["--simulate", "dgx-a100-40gb", "--sim-state", str(tmp_path / "s.json")]
    code, _, err = run(capsys, "--root", str(tmp_path), "mig", "plan", *sim, "-c", "nope")
    assert code == 2 and "no config named 'nope'" in err
    bad = "version: v1\nmig-configs:\n  x:\n    - devices: [0]\n      mig-enabled: true\n      mig-devices: {7g.40gb: 1, 1g.5gb: 1}\n"
    code, _, err = run(capsys, "--root", str(tmp_path), "mig", "apply", *sim, "-f", "-", stdin=bad,
                       monkeypatch=monkeypatch)
    assert code == 2
    assert err.strip() == ("error: <stdin>: config x entry 0: GPU 0: 1 x 7g.40gb (8 each) + 1 x 1g.5gb (1 each) "
                           "need 9 memory slices but NVIDIA A100-SXM4-40GB has 8")
    f = tmp_path / "two.yaml"
    f.write_text("version: v1\nmig-configs:\n  a: [{devices: all, mig-enabled: false}]\n"
                 "  b: [{devices: all, mig-enabled: true}]\n")
    code, _, err = run(capsys, "--root", str(tmp_path), "mig", "plan", *sim, "-f", str(f))
    assert code == 2 and "holds 2 configs (a, b); choose one with -c" in err


def test_busy_refusal_exit_1_and_reboot_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = str(tmp_path / "sim.json")
    sim = ["--simulate", "dgx-a100-80gb", "--sim-state", state]
    base = ["--root", str(tmp_path)]
    from nodeagent.simulator import inject
    from nodeagent.simulator.state import SimStore

    store = SimStore.open("dgx-a100-80gb", Path(state))
    inject.write_mig_layout(store, 0, ["7g.80gb"])
    inject.inject_process(store, 0, 999, "trainer")
    code, _, err = run(capsys, *base, "mig", "apply", *sim, "-c", "all-3g.40gb")
    assert code == 1 and "pid 999 (trainer)" in err
    assert store.read()["gpus"][1]["mig_current"] is False  # nothing changed anywhere
    inject.kill_process(store, 0)
    for i in range(8):  # held devices: the mode change waits for a reset, and the reset is impossible
        inject.hold_device(store, i, "nvidia-persistenced")
    inject.fail_next(store, "simResetGpu", 16)
    code, _, err = run(capsys, *base, "mig", "apply", *sim, "-c", "all-3g.40gb")
    assert code == 3 and "reboot" in err


def test_apply_on_a_simulated_machine_without_its_state_file_says_it_is_not_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Under --root without --sim-state the machine lives in the command's process: one warning line says the
    change is gone at the next command (without --root the default sandbox keeps it: tests/e2e/test_sandbox.py)."""
    code, out, err = run(capsys, "--root", str(tmp_path), "mig", "apply", "--simulate", "a30x4", "-c", "all-balanced")
    assert code == 0 and "applied all-balanced" in out, err
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert warnings == ["warning: the simulated machine is not kept without --sim-state FILE: this change is gone "
                        "at the next command"], err


def test_the_default_sandbox_keeps_the_simulated_machine_between_commands(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --root and --sim-state the machine's sandbox holds its state: an apply is there for the next
    command, whether --simulate is repeated or not (the file records the machine)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert run(capsys, "mig", "apply", "--simulate", "a30x4", "-c", "all-balanced")[0] == 0
    code, out, err = run(capsys, "mig", "assert", "--simulate", "a30x4", "-c", "all-balanced")
    assert (code, out.strip()) == (0, "config all-balanced is applied"), err
    assert (tmp_path / "nodeagent-sim/a30x4/sim-state.json").is_file()
