"""The README's test command is what CI runs, and the quick start names real commands and machines."""

from __future__ import annotations

import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _block_after(heading: str) -> str:
    text = (REPO / "README.md").read_text()
    return text.split(heading, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0].strip()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme_cmd = _block_after("## Run the tests")
    assert readme_cmd == "bash tests/run.sh"
    ci = (REPO / ".ci/run").read_text().splitlines()
    assert ci[0] == "#!/usr/bin/env bash"
    assert [ln for ln in ci if ln and not ln.startswith("#")][-1] == f"exec {readme_cmd}"
    run_sh = (REPO / "tests/run.sh").read_text()
    for step in ("python3 -m venv", "pip install", "ruff\" check", "mypy\"", "lint-imports\"", "pytest\""):
        assert step in run_sh, step


def test_quickstart_installs_then_runs_a_simulated_machine() -> None:
    cmd = _block_after("## Try it")
    steps = [shlex.split(s) for s in cmd.split("&&")]
    assert steps[0][:3] == ["python3", "-m", "venv"] and steps[1][:2] == [".venv/bin/pip", "install"]
    from nodeagent.simulator.machine import machine_names

    agent = steps[-1]
    assert agent[0] == ".venv/bin/nodeagent"
    assert agent[agent.index("--simulate") + 1] in machine_names()
