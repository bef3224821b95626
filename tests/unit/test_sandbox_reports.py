"""What a sandbox's commands tell about themselves: ``bootstrap`` names the real reason containerd was not
restarted (``--root``, or ``--no-restart``) and lists every file it wrote as the shell names it (under the
root, as the CDI step names its spec); ``cdi list`` and ``cdi show`` without a spec say so in the same words
(``list`` on stderr, its stdout left to device names), exit 0 both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from nodeagent.cli import cli


def _steps(output: str) -> dict[str, dict[str, Any]]:
    return {s["step"]: s for s in json.loads(output)["steps"]}


def test_bootstrap_says_why_containerd_was_not_restarted_and_names_files_alike(tmp_path: Path) -> None:
    runner = CliRunner()
    root = tmp_path / "demo"
    r = runner.invoke(cli, ["--root", str(root), "bootstrap", "--simulate", "t4x1", "--no-kube"])
    assert r.exit_code == 0, r.output
    steps = _steps(r.stdout)
    assert steps["containerd-restart"]["reason"] == (
        f"restart disabled (under --root {root} nothing is restarted unless --restart says how)")
    assert steps["runtime"]["details"]["files"] == [
        f"{root}/etc/containerd/config.toml (create)", f"{root}/etc/containerd/conf.d/99-nvidia.toml (create)",
        f"{root}/etc/nvidia-container-runtime/config.toml (create)"]
    assert steps["runtime"]["reason"].startswith(f"wrote {root}/etc/containerd/config.toml (create), ")
    assert steps["cdi"]["details"]["path"] == f"{root}/var/run/cdi/nvidia.yaml"

    other = tmp_path / "other"
    r = runner.invoke(cli, ["--root", str(other), "bootstrap", "--simulate", "t4x1", "--no-kube", "--no-restart"])
    assert r.exit_code == 0, r.output
    assert _steps(r.stdout)["containerd-restart"]["reason"] == "restart disabled (--no-restart)"


def test_no_cdi_spec_said_alike_by_list_and_show(tmp_path: Path) -> None:
    runner = CliRunner()
    root = tmp_path / "empty"
    spec = f"{root}/var/run/cdi/nvidia.yaml"
    listed = runner.invoke(cli, ["--root", str(root), "cdi", "list"])
    assert (listed.exit_code, listed.stdout, listed.stderr) == (0, "", f"no CDI spec at {spec}\n")
    shown = runner.invoke(cli, ["--root", str(root), "cdi", "show"])
    assert (shown.exit_code, shown.stdout) == (0, f"no CDI spec at {spec}\n")
