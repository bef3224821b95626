"""Command line: parse arguments, call one function, print, map errors to exit codes.

Exit codes for every command: 0 ok, 1 the operation failed and nothing was changed, 2 bad input or usage,
3 a reboot is required. Subcommands live in ``nodeagent/commands/`` and are imported only when used, so
``nodeagent discover`` does not pay for the Kubernetes client.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import Any

import click

from nodeagent import __version__
from nodeagent.errors import NodeAgentError
from nodeagent.hostpaths import HostPaths

# command name -> "module:attribute" of its click command
COMMANDS: dict[str, str] = {
    "discover": "nodeagent.commands.discover:discover",
    "sim": "nodeagent.commands.sim:sim",
    "mig": "nodeagent.commands.mig:mig",
    "runtime": "nodeagent.commands.runtime:runtime",
    "run": "nodeagent.commands.run:run",
    "bootstrap": "nodeagent.commands.bootstrap:bootstrap",
    "cdi": "nodeagent.commands.cdi:cdi",
}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module only when that subcommand is used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS:
            module_name, attr = COMMANDS[cmd_name].split(":")
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as e:
                if e.name == module_name:
                    return None
                raise
            cmd = getattr(module, attr)
            assert isinstance(cmd, click.Command)
            _accept_root(cmd)
            return cmd
        return super().get_command(ctx, cmd_name)


class Settings:
    """Global options shared with every subcommand through ``ctx.obj``.

    ``paths`` is built from the absolute, symlink-resolved root (``HostPaths`` does that once), so a
    relative ``--root ./demo`` never reaches a socket address or a file name below it.
    """

    def __init__(self, root: Path, log_format: str, log_level: str, *, root_given: bool = False) -> None:
        self.paths = HostPaths(root)
        self.log_format = log_format
        self.log_level = log_level
        self.root_given = root_given


_ROOT_HELP = "Resolve every host path (/etc, /sys, /var/lib/kubelet, /run) under this directory."


def _subcommand_root(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """``--root`` given after the subcommand (``nodeagent runtime configure --root R``): the same as before
    it; both places with different directories is a usage error."""
    if value is None:
        return None
    settings = ctx.find_object(Settings)
    if settings is None:
        return value
    new = HostPaths(value)
    if settings.root_given and settings.paths.root != new.root:
        raise click.UsageError(
            f"--root given twice with different directories: {settings.paths.root} and {new.root}", ctx=ctx)
    settings.paths = new
    settings.root_given = True
    return value


def _accept_root(cmd: click.Command) -> None:
    """Give ``cmd`` (and every subcommand of a group) its own ``--root`` that sets the global one."""
    if not any(isinstance(p, click.Option) and "--root" in p.opts for p in cmd.params):
        cmd.params.append(click.Option(
            ["--root"], type=click.Path(file_okay=False, path_type=Path), default=None, expose_value=False,
            callback=_subcommand_root, help=_ROOT_HELP + " (also accepted before the command)",
        ))
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            _accept_root(sub)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="nodeagent")
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/"),
    envvar="NODEAGENT_ROOT",
    show_default=True,
    help=_ROOT_HELP,
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Log lines for a terminal or JSON for collectors.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.pass_context
def cli(ctx: click.Context, root: Path, log_format: str, log_level: str) -> None:
    """nodeagent: discover, shape and publish the GPUs of a Kubernetes node."""
    from nodeagent.logs import setup_logging

    setup_logging(log_format, log_level)
    given = ctx.get_parameter_source("root") == click.core.ParameterSource.COMMANDLINE
    ctx.obj = Settings(root, log_format, log_level, root_given=given)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the CLI and turn nodeagent errors into one line and an exit code."""
    try:
        rv: Any = cli.main(args=argv, prog_name="nodeagent", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.ClickException as e:
        e.show()
        sys.exit(2 if isinstance(e, click.UsageError | click.BadParameter) else e.exit_code)
    except NodeAgentError as e:
        logging.getLogger("nodeagent").debug("failure", exc_info=True)
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
