"""``nodeagent mig plan|apply|assert|export``: mig-parted compatible MIG shaping from the command line.

``-f FILE`` is a mig-parted ``version: v1`` file (``-`` reads stdin); without it the standard configs
(all-disabled, all-enabled, all-balanced, all-<profile>) are generated for the node's GPUs. ``-c NAME``
picks the config (optional when the file holds one). The mig-parted environment variables
``MIG_PARTED_CONFIG_FILE``, ``MIG_PARTED_SELECTED_CONFIG`` and ``MIG_PARTED_HOOKS_FILE`` work too.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click

from nodeagent.commands.common import gpu_options, open_adapter
from nodeagent.errors import ConfigError
from nodeagent.gpu.inventory import Inventory
from nodeagent.mig.apply import Applier, MigAdapter, MigStateFile, recover_interrupted
from nodeagent.mig.hooks import HookRunner, parse_hooks
from nodeagent.mig.planner import Plan, plan
from nodeagent.mig.spec import MigConfigFile, dump, export_config, generate_standard, parse_config, resolve

F = TypeVar("F", bound=Callable[..., Any])


def _config_options(f: F) -> F:
    f = click.option("-c", "--selected-config", "selected", envvar="MIG_PARTED_SELECTED_CONFIG", default=None,
                     help="Name of the config in the file (optional when it holds one).")(f)
    return click.option("-f", "--config-file", "config_file", envvar="MIG_PARTED_CONFIG_FILE", default=None,
                        help="mig-parted v1 config file, '-' for stdin; default: generated standard configs.")(f)


@contextlib.contextmanager
def _adapter(ctx: click.Context) -> Iterator[MigAdapter]:
    with open_adapter(ctx) as nvml:
        yield nvml


def _load(config_file: str | None, inventory: Inventory) -> MigConfigFile:
    if config_file is None:
        return generate_standard(inventory)
    if config_file == "-":
        return parse_config(sys.stdin.read(), "<stdin>")
    try:
        text = Path(config_file).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read MIG config file {config_file}: {e.strerror or e}", subject=config_file) from e
    return parse_config(text, config_file)


def _plan(adapter: MigAdapter, config_file: str | None, selected: str | None,
          before_planning: Callable[[], bool] | None = None) -> tuple[Inventory, Plan]:
    """Read and check the config, then plan against the GPUs' current layout.

    ``before_planning`` runs once the input is known to be good (bad input changes nothing); when it
    returns True it changed the GPUs, and the plan is made again from what is there now.
    """
    inv = adapter.discover()
    cfg = _load(config_file, inv)
    name, entries = cfg.select(selected)
    the_plan = plan(inv, resolve(name, entries, inv, cfg.source))
    if before_planning is not None and before_planning():
        inv = adapter.discover()
        the_plan = plan(inv, resolve(name, entries, inv, cfg.source))
    return inv, the_plan


def _settings_paths(ctx: click.Context) -> Any:
    return getattr(ctx.find_root().obj, "paths", None)


@click.group("mig")
def mig() -> None:
    """Shape MIG layouts with mig-parted config files, minimal disruption and exact rollback."""


@mig.command("plan")
@_config_options
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.pass_context
def plan_cmd(ctx: click.Context, config_file: str | None, selected: str | None, as_json: bool) -> None:
    """Print what `apply` would do, GPU by GPU (nothing is changed)."""
    with _adapter(ctx) as adapter:
        _, the_plan = _plan(adapter, config_file, selected)
    click.echo(json.dumps(the_plan.to_dict(), indent=1) if as_json else the_plan.render())


@mig.command("apply")
@_config_options
@gpu_options
@click.option("--hooks-file", "hooks_file", envvar="MIG_PARTED_HOOKS_FILE", default=None,
              type=click.Path(dir_okay=False, path_type=Path), help="mig-parted hooks file.")
@click.pass_context
def apply_cmd(ctx: click.Context, config_file: str | None, selected: str | None, hooks_file: Path | None) -> None:
    """Apply a config: only GPUs that differ change; on failure every touched GPU is restored.

    A MIG apply interrupted earlier (an agent or command killed midway) is resolved first: every GPU it
    left half-changed is put back to its previous layout, then the plan is made from what is there.
    """
    paths = _settings_paths(ctx)
    state = MigStateFile(paths.mig_state_dir) if paths is not None else None
    with _adapter(ctx) as adapter:

        def recover() -> bool:
            recovery = recover_interrupted(adapter, state) if state is not None else None
            if recovery is not None:
                click.echo(recovery.describe())
            return recovery is not None

        inv, the_plan = _plan(adapter, config_file, selected, before_planning=recover)
        click.echo(the_plan.render())
        if the_plan.applied:
            click.echo("nothing to do")
            return
        runner = None
        if hooks_file is not None:
            try:
                hooks = parse_hooks(hooks_file.read_text(), str(hooks_file))
            except OSError as e:
                raise ConfigError(f"cannot read hooks file {hooks_file}: {e.strerror or e}",
                                  subject=str(hooks_file)) from e
            env = HookRunner.environment(config_file=config_file or "", hooks_file=str(hooks_file),
                                         selected=the_plan.config, gpus=[g.index for g in the_plan.touched])
            runner = HookRunner(hooks, env)
        proc_root = paths.proc if paths is not None else Path("/proc")
        result = Applier(adapter, hooks=runner, state=state, proc_root=proc_root).apply(the_plan, inv)
    resets = f"; reset GPU {', '.join(str(i) for i in result.resets)}" if result.resets else ""
    click.echo(f"applied {the_plan.config} to GPU {', '.join(str(i) for i in result.touched)}{resets}")


@mig.command("assert")
@_config_options
@gpu_options
@click.pass_context
def assert_cmd(ctx: click.Context, config_file: str | None, selected: str | None) -> None:
    """Exit 0 when the config is applied, 1 (listing the differences) when it is not."""
    with _adapter(ctx) as adapter:
        _, the_plan = _plan(adapter, config_file, selected)
    if the_plan.applied:
        click.echo(f"config {the_plan.config} is applied")
        return
    click.echo(the_plan.render(), err=True)
    ctx.exit(1)


@mig.command("export")
@gpu_options
@click.option("-c", "--name", default="current", show_default=True, help="Name of the exported config.")
@click.pass_context
def export_cmd(ctx: click.Context, name: str) -> None:
    """Print the current MIG layout as a mig-parted config file."""
    with _adapter(ctx) as adapter:
        inv = adapter.discover()
    click.echo(dump(export_config(inv, name)), nl=False)
