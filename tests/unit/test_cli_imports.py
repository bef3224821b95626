"""The quick commands import only what they need: each runs as its own process, and the modules it loaded
are read from ``python -X importtime``."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from nodeagent.cli import COMMANDS, SUMMARIES, cli
from nodeagent.clicontext import Group

HEAVY = ("kubernetes", "grpc", "apscheduler", "prometheus_client", "pyroute2", "watchdog")


def _loaded(args: list[str], cwd: Path) -> set[str]:
    """The modules a ``nodeagent ARGS`` process imported (it must succeed)."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(cwd), "NO_COLOR": "1"}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "nodeagent", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and not line.rstrip().endswith("package")
    }


def _under(modules: set[str], package: str) -> list[str]:
    return sorted(m for m in modules if m == package or m.startswith(package + "."))


def _containerd_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "etc/containerd").mkdir(parents=True)
    (root / "etc/containerd/config.toml").write_text("version = 2\n")
    return root


def test_help_imports_no_command_module(tmp_path: Path) -> None:
    loaded = _loaded(["--help"], tmp_path)
    assert _under(loaded, "nodeagent.commands") == []
    assert [p for p in HEAVY if _under(loaded, p)] == []


def test_discover_simulate_needs_no_cluster_client(tmp_path: Path) -> None:
    loaded = _loaded(["--root", str(tmp_path / "sb"), "discover", "--simulate", "dgx-h100"], tmp_path)
    assert [p for p in HEAVY if _under(loaded, p)] == []
    assert _under(loaded, "nodeagent.kube") == [] and _under(loaded, "nodeagent.daemon") == []


@pytest.mark.parametrize("command", [["runtime", "show"], ["runtime", "configure", "--dry-run"]])
def test_runtime_under_a_root_needs_no_grpc(tmp_path: Path, command: list[str]) -> None:
    loaded = _loaded(["--root", str(_containerd_root(tmp_path)), *command], tmp_path)
    assert [p for p in HEAVY if _under(loaded, p)] == []
    assert _under(loaded, "nodeagent.grpcadapter") == []


def test_the_listed_summaries_are_the_commands_own() -> None:
    """``nodeagent --help`` lists ``SUMMARIES`` instead of importing every command: they must stay the first
    paragraph of each command's help, and the listing the one click would make from the commands."""
    assert set(SUMMARIES) == set(COMMANDS)
    real: dict[str, click.Command] = {}
    for name, target in COMMANDS.items():
        module, attr = target.split(":")
        real[name] = getattr(importlib.import_module(module), attr)
        assert SUMMARIES[name] == inspect.cleandoc(real[name].help or "").split("\n\n")[0], name
    with click.Context(cli, info_name="nodeagent") as ctx:
        formatter = ctx.make_formatter()
        cli.format_commands(ctx, formatter)
        listed = formatter.getvalue()
        formatter = ctx.make_formatter()
        eager = Group(commands=real)
        eager.format_commands(ctx, formatter)
        assert listed == formatter.getvalue()
