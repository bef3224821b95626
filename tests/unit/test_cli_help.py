"""`--help` reads as written: every command and option explains itself, command lists show whole
sentences, no markup leaks into the terminal."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from nodeagent.cli import cli

CTX = click.Context(cli)


def _walk(cmd: click.Command, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(CTX):
            sub = cmd.get_command(CTX, name)
            assert sub is not None, name
            yield from _walk(sub, (*path, name))


COMMANDS = list(_walk(cli, ()))


def test_the_tree_is_whole() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {
        "run",
        "bootstrap",
        "discover",
        "mig apply",
        "runtime configure",
        "cdi show",
        "sim inject xid",
        "sim show",
    } <= names


@pytest.mark.parametrize(("path", "cmd"), COMMANDS, ids=[" ".join(p) or "nodeagent" for p, _ in COMMANDS])
def test_command_help(path: tuple[str, ...], cmd: click.Command) -> None:
    assert cmd.help, path
    assert "``" not in cmd.help, (path, cmd.help)
    for param in cmd.params:
        if isinstance(param, click.Option) and param.name != "help":
            assert param.help, (path, param.opts)
    out = CliRunner().invoke(cli, [*path, "--help"], terminal_width=80)
    assert out.exit_code == 0, out.output
    if isinstance(cmd, click.Group):
        listing = out.output.split("Commands:", 1)[1]
        assert "..." not in listing, listing  # never a summary cut mid-word


def test_run_takes_both_log_options() -> None:
    for option, value in (("--log-format", "json"), ("--log-level", "debug")):
        out = CliRunner().invoke(cli, ["run", option, value, "--help"])
        assert out.exit_code == 0, out.output


def test_nvidia_habits_mean_what_they_mean_there_or_are_refused(tmp_path: Path) -> None:
    """nvidia-ctk's --runtime and --config, `cdi list`, the device plugin's --mig-strategy: their meaning
    or a refusal naming nodeagent's spelling, never a different meaning."""
    root = tmp_path / "r"
    (root / "etc/containerd").mkdir(parents=True)
    config = root / "etc/containerd/config.toml"
    config.write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n')
    runner = CliRunner()
    done = runner.invoke(
        cli,
        [
            "--root",
            str(root),
            "runtime",
            "configure",
            "--runtime=containerd",
            "--config",
            str(config),
            "--json",
        ],
    )
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["changed"] is True
    assert "nvidia" in (root / "etc/containerd/conf.d/99-nvidia.toml").read_text()
    docker = runner.invoke(cli, ["--root", str(root), "runtime", "configure", "--runtime", "docker"])
    assert docker.exit_code == 2 and "nodeagent wires containerd only" in docker.output, docker.output
    strategy = runner.invoke(cli, ["--root", str(root), "run", "--mig-strategy", "mixed"])
    assert strategy.exit_code == 2 and "flags: {migStrategy: mixed}" in strategy.output, strategy.output
    assert runner.invoke(cli, ["--root", str(root), "cdi", "generate", "--simulate", "t4x1"]).exit_code == 0
    listed = runner.invoke(cli, ["--root", str(root), "cdi", "list"])
    assert listed.exit_code == 0, listed.output
    assert listed.stdout.splitlines()[0] == "nvidia.com/gpu=0" and "nvidia.com/gpu=all" in listed.stdout
