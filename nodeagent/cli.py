"""Command line: parse arguments, call one function, print, map errors to exit codes.

Exit codes for every command: 0 ok, 1 the operation failed and nothing was changed, 2 bad input or usage,
3 a reboot is required. Subcommands live in ``nodeagent/commands/`` and are imported only when used, so
``nodeagent discover`` does not pay for the Kubernetes client.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from nodeagent import __version__
from nodeagent.clicontext import Group, Settings, settings_of
from nodeagent.errors import NodeAgentError, RebootRequired

# command name -> "module:attribute" of its click command
COMMANDS: dict[str, str] = {
    "discover": "nodeagent.commands.discover:discover",
    "sim": "nodeagent.commands.sim:sim",
    "mig": "nodeagent.commands.mig:mig",
    "runtime": "nodeagent.commands.runtime:runtime",
    "run": "nodeagent.commands.run:run",
    "bootstrap": "nodeagent.commands.bootstrap:bootstrap",
    "cdi": "nodeagent.commands.cdi:cdi",
    "doctor": "nodeagent.commands.doctor:doctor",
    "adopt": "nodeagent.commands.adopt:adopt",
    "fleet": "nodeagent.commands.fleet:fleet",
    "controller": "nodeagent.commands.controller:controller",
}

# command name -> the first paragraph of its help: all that ``nodeagent --help`` lists of it, so the listing
# imports no command module (a test keeps these equal to the commands' own help)
SUMMARIES: dict[str, str] = {
    "discover": "Show the node's GPUs (real, or simulated with --simulate), MIG devices and topology.",
    "sim": "The NVML simulator: machines, MIG layouts, reboots and fault injection.",
    "mig": "Shape MIG layouts with mig-parted config files, minimal disruption and exact rollback.",
    "runtime": "Wire the nvidia runtime into containerd, undo it, show what containerd loads.",
    "run": "Run the agent until SIGTERM/SIGINT; SIGHUP reloads the config.",
    "bootstrap": "Discover, shape MIG, wire containerd, publish RuntimeClass and labels; print a JSON report.",
    "cdi": "The node's CDI spec for nvidia.com/gpu (GPUs by index and UUID, MIG devices, all).",
    "doctor": "Explain this GPU node: driver, GPUs and MIG, health, containerd, CDI, kubelet, Node, the agent.",
    "adopt": "Take a node over from the GPU Operator through its nvidia.com/gpu.deploy.* labels.",
    "fleet": "Fleet-wide changes under a disruption budget: status per pool, clear a brake.",
    "controller": "Keep ComputeDomains' templates and status, and execute GPU remediation's eviction requests; leader-elected.",
}
_LISTING = "nodeagent.cli.listing"  # ctx.meta key: the group's help is listing its commands


class LazyGroup(Group):
    """A click group that imports a subcommand's module only when that subcommand is used (its help
    listing shows the summaries of ``SUMMARIES`` instead)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        ctx.meta[_LISTING] = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            ctx.meta.pop(_LISTING, None)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if ctx.meta.get(_LISTING) and cmd_name in SUMMARIES:
            return click.Command(cmd_name, help=SUMMARIES[cmd_name])
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


_ROOT_HELP = "Resolve every host path (/etc, /sys, /var/lib/kubelet, /run) under this directory."


def _subcommand_root(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """``--root`` given after the subcommand (``nodeagent runtime configure --root R``): the same as before
    it; both places with different directories is a usage error."""
    if value is None:
        return None
    settings_of(ctx).set_root(value)
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
    "--root-on-host",
    default=None,
    envvar="NODEAGENT_ROOT_ON_HOST",
    metavar="PATH",
    help="Where the node's container runtime and kubelet see --root, for the paths nodeagent writes for them "
         "(CDI specs, device-plugin mounts). Default: --root itself. In a container that mounts the node's "
         "filesystem at /host: --root /host --root-on-host /.",
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
    help="Least severe log lines shown.",
)
@click.pass_context
def cli(ctx: click.Context, root: Path, root_on_host: str | None, log_format: str, log_level: str) -> None:
    """nodeagent: discover, shape and publish the GPUs of a Kubernetes node."""
    from nodeagent.logs import setup_logging

    setup_logging(log_format, log_level)
    given = ctx.get_parameter_source("root") in (click.core.ParameterSource.COMMANDLINE,
                                                 click.core.ParameterSource.ENVIRONMENT)
    ctx.obj = Settings(root, log_format, log_level, root_given=given, root_on_host=root_on_host)


def _json_requested(argv: list[str]) -> bool:
    """``--log-format json`` (or ``--log-format=json``) anywhere on the command line: errors found before
    logging is set up (usage, configuration) are JSON too."""
    for i, arg in enumerate(argv):
        if arg == "--log-format=json" or (arg == "--log-format" and argv[i + 1:i + 2] == ["json"]):
            return True
    return False


def _fail(message: str, code: int, argv: list[str], *, prefix: str = "error: ",
          usage: click.ClickException | None = None) -> NoReturn:
    """Print a failure as one line (a JSON object with ``--log-format json``) and exit with ``code``."""
    if _json_requested(argv):
        level = "error" if prefix else "warning"
        click.echo(json.dumps({"level": level, "logger": "nodeagent", "msg": message, "exit_code": code}),
                   err=True)
    elif usage is not None:
        usage.show()
    else:
        click.echo(prefix + message, err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the CLI and turn nodeagent errors into one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    try:
        rv: Any = cli.main(args=args, prog_name="nodeagent", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        _fail("aborted", 1, args, prefix="")
    except click.ClickException as e:
        code = 2 if isinstance(e, click.UsageError | click.BadParameter) else e.exit_code
        _fail(e.format_message(), code, args, usage=e)
    except NodeAgentError as e:
        logging.getLogger("nodeagent").debug("failure", exc_info=True)
        from nodeagent.logs import one_line

        # a change that waits for a reboot was accepted: said as what to do, not as an error
        _fail(one_line(str(e)), e.exit_code, args, prefix="" if isinstance(e, RebootRequired) else "error: ")
    except OSError as e:  # the file system said no (rights, space, a read-only mount): one line, not a traceback
        logging.getLogger("nodeagent").debug("failure", exc_info=True)
        where = f"{e.filename}: " if e.filename else ""
        _fail(f"{where}{e.strerror or e} (nothing more was changed)", 1, args)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
