"""``nodeagent mig plan|apply|assert|export``: mig-parted compatible MIG shaping from the command line.

``-f FILE`` is a mig-parted ``version: v1`` file (``-`` reads stdin); without it the standard configs
(all-disabled, all-enabled, all-balanced, all-<profile>) are generated for the node's GPUs. ``-c NAME``
picks the config (optional when the file holds one). The mig-parted environment variables
``MIG_PARTED_CONFIG_FILE``, ``MIG_PARTED_SELECTED_CONFIG`` and ``MIG_PARTED_HOOKS_FILE`` work too.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click

from nodeagent.clicontext import Group, settings_of
from nodeagent.commands.common import gpu_options, gpu_opts, open_adapter
from nodeagent.errors import RebootRequired
from nodeagent.gpu.inventory import Inventory
from nodeagent.gpu.ports import MigAdministration
from nodeagent.mig.apply import MigStateFile
from nodeagent.mig.pipeline import MigPipeline, MigSources, load_sources, unselected_mig_gpus
from nodeagent.mig.planner import Plan
from nodeagent.mig.spec import dump, export_config

F = TypeVar("F", bound=Callable[..., Any])


def _config_options(f: F) -> F:
    f = click.option("-c", "--selected-config", "selected", envvar="MIG_PARTED_SELECTED_CONFIG", default=None,
                     help="Name of the config in the file (optional when it holds one).")(f)
    return click.option("-f", "--config-file", "config_file", envvar="MIG_PARTED_CONFIG_FILE", default=None,
                        help="mig-parted v1 config file, '-' for stdin; "
                             "default: generated standard configs.")(f)


@contextlib.contextmanager
def _adapter(ctx: click.Context) -> Iterator[MigAdministration]:
    with open_adapter(ctx) as nvml:
        yield nvml


def _plan(adapter: MigAdministration, sources: MigSources, selected: str | None) -> tuple[Inventory, Plan]:
    return MigPipeline(adapter, sources).plan(selected)




@click.group("mig", cls=Group)
def mig() -> None:
    """Shape MIG layouts with mig-parted config files, minimal disruption and exact rollback."""


@mig.command("plan")
@_config_options
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.pass_context
def plan_cmd(ctx: click.Context, config_file: str | None, selected: str | None, as_json: bool) -> None:
    """Print what `apply` would do, GPU by GPU (nothing is changed)."""
    sources = load_sources(config_file)
    with _adapter(ctx) as adapter:
        _, the_plan = _plan(adapter, sources, selected)
    click.echo(json.dumps(the_plan.to_dict(), indent=1) if as_json else the_plan.render())


@mig.command("apply")
@_config_options
@gpu_options
@click.option("--hooks-file", "hooks_file", envvar="MIG_PARTED_HOOKS_FILE", default=None,
              type=click.Path(dir_okay=False, path_type=Path), help="mig-parted hooks file.")
@click.pass_context
def apply_cmd(ctx: click.Context, config_file: str | None, selected: str | None,
              hooks_file: Path | None) -> None:
    """Apply a config: only GPUs that differ change; on failure every touched GPU is restored.

    Exit 3 when a MIG mode change waits for a reboot (a VM, a GPU that cannot be reset): reboot, then apply
    again (`nodeagent run` and `bootstrap` reboot by themselves with --with-reboot).

    A MIG apply interrupted earlier (an agent or command killed midway) is resolved first: every GPU it
    left half-changed is put back to its previous layout, then the plan is made from what is there.
    """
    paths = settings_of(ctx).paths
    state = MigStateFile(paths.mig_state_dir, paths)
    sources = load_sources(config_file, hooks_file)  # a missing or broken file stops here: nothing changed
    with _adapter(ctx) as adapter:
        pipeline = MigPipeline(adapter, sources, state=state, proc_root=paths.proc)
        prepared = pipeline.prepare(selected)
        if prepared.recovery is not None:
            click.echo(prepared.recovery.describe())
        the_plan = prepared.plan
        click.echo(the_plan.render())
        if the_plan.applied:
            click.echo("nothing to do")
            return
        try:
            result = pipeline.apply(the_plan, prepared.inventory)
        except RebootRequired as e:
            raise RebootRequired(f"reboot required: {e}; {_after_reboot(ctx)}", subject=e.subject) from e
    resets = f"; reset GPU {', '.join(str(i) for i in result.resets)}" if result.resets else ""
    click.echo(f"applied {the_plan.config} to GPU {', '.join(str(i) for i in result.touched)}{resets}")
    if gpu_opts(ctx).sim_state is None and gpu_opts(ctx).simulate is not None:
        # under --root without --sim-state the simulated machine lived in this process only
        click.echo("warning: the simulated machine is not kept without --sim-state FILE: this change is gone "
                   "at the next command", err=True)


def _after_reboot(ctx: click.Context) -> str:
    """What to do when a MIG mode change waits for a reboot (exit 3)."""
    opts = gpu_opts(ctx)
    again = "then run the same `nodeagent mig apply` again to create the instances"
    if opts.sim_state is not None:
        return f"run `nodeagent sim reboot --sim-state {shlex.quote(str(opts.sim_state))}` (the simulated host), {again}"
    if opts.simulate is not None:
        return "the simulator keeps no state between commands without --sim-state FILE: give one to reboot it"
    return f"reboot the host, {again}"


@mig.command("assert")
@_config_options
@gpu_options
@click.pass_context
def assert_cmd(ctx: click.Context, config_file: str | None, selected: str | None) -> None:
    """Exit 0 when the config is applied to every MIG-capable GPU; 1 (listing the differences) when it
    is not, or when the config leaves MIG-capable GPUs unselected (as mig-parted's assert)."""
    sources = load_sources(config_file)
    with _adapter(ctx) as adapter:
        inv, the_plan = _plan(adapter, sources, selected)
    unselected = unselected_mig_gpus(the_plan, inv)
    if the_plan.applied and not unselected:
        click.echo(f"config {the_plan.config} is applied")
        return
    click.echo(the_plan.render(), err=True)
    if unselected:
        click.echo(f"config {the_plan.config} does not select MIG-capable GPU "
                   f"{', '.join(str(i) for i in unselected)}", err=True)
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
