"""Options and helpers shared by commands that talk to GPUs (real or simulated)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from nodeagent.clicontext import settings_of, simulation_label

if TYPE_CHECKING:
    from nodeagent.gpu.nvml import NvmlAdapter

F = TypeVar("F", bound=Callable[..., Any])

_META_KEY = "nodeagent.gpu_options"


@dataclass(frozen=True)
class GpuOptions:
    simulate: str | None = None
    sim_state: Path | None = None


def _store(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    opts: GpuOptions = ctx.meta.get(_META_KEY, GpuOptions())
    opts = GpuOptions(value, opts.sim_state) if param.name == "simulate" else GpuOptions(opts.simulate, value)
    ctx.meta[_META_KEY] = opts
    label = simulation_label(opts.simulate, opts.sim_state)
    if label is not None:
        settings_of(ctx).simulate(label)
    return value


def gpu_options(f: F) -> F:
    """Add ``--simulate MACHINE`` and ``--sim-state FILE`` to a command (read them with ``gpu_opts``). The
    state file is checked (inside ``--root``) before the command does anything else."""
    command = f

    @functools.wraps(command)
    def checked(*args: Any, **kwargs: Any) -> Any:
        gpu_opts(click.get_current_context())
        return command(*args, **kwargs)

    f = cast(F, checked)
    f = click.option(
        "--sim-state",
        type=click.Path(dir_okay=False, path_type=Path),
        envvar="NODEAGENT_SIM_STATE",
        expose_value=False,
        callback=_store,
        help="Simulator state file shared between processes (created on first use). "
        "Implies the simulator; the machine is recorded in the file.",
    )(f)
    f = click.option(
        "--simulate",
        metavar="MACHINE",
        envvar="NODEAGENT_SIMULATE",
        expose_value=False,
        callback=_store,
        help="Use the NVML simulator for MACHINE instead of the driver (see `nodeagent sim machines`).",
    )(f)
    return f


def gpu_opts(ctx: click.Context) -> GpuOptions:
    """The --simulate/--sim-state values of this command, the state file as ``Settings.sim_state`` makes it
    (inside ``--root``; the default sandbox's own when none is given)."""
    opts: GpuOptions = ctx.meta.get(_META_KEY, GpuOptions())
    return GpuOptions(opts.simulate, settings_of(ctx).sim_state(opts.sim_state))


def open_adapter(ctx: click.Context) -> NvmlAdapter:
    """The NVML adapter for this command: simulator or driver, host paths from the global --root."""
    from nodeagent.nvmlsource import open_nvml

    opts = gpu_opts(ctx)
    return open_nvml(opts.simulate, opts.sim_state, settings_of(ctx).paths)
