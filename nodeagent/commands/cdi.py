"""``nodeagent cdi``: the node's CDI spec (``/var/run/cdi/nvidia.yaml``) for people and provisioning.

``generate`` writes it from the current GPU inventory (atomically, only when it changed) or prints it;
``show`` prints what the file on disk names and, with ``--check``, whether it still matches the GPUs.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import click

from nodeagent.clicontext import Group, settings_of
from nodeagent.commands.common import gpu_options, gpu_opts, open_adapter
from nodeagent.errors import InputError, OperationError
from nodeagent.hostpaths import HostPaths

_DRIVER_ROOT_HELP = "Where the driver's libraries and tools are (under --root), e.g. /run/nvidia/driver."


def _paths(ctx: click.Context) -> HostPaths:
    return settings_of(ctx).paths


def _driver_root(value: str) -> str:
    if not value.startswith("/"):
        raise InputError(f"--driver-root must be an absolute path, got {value!r}", subject=value)
    return value


def _load_spec(writer: Any, text: str | None) -> Any:
    """The CDI spec file's document (``None`` when there is no file); one error when it is not a spec."""
    import yaml

    from nodeagent.boundedyaml import BoundedYamlError, load

    if text is None:
        return None
    try:
        spec = load(text)  # no aliases, bounded depth and size
    except (BoundedYamlError, yaml.YAMLError) as e:
        raise OperationError(f"{writer.file}: not valid YAML: {e}", subject=writer.file) from e
    if not isinstance(spec, dict) or "kind" not in spec:
        raise OperationError(f"{writer.file}: not a CDI spec (no kind)", subject=writer.file)
    return spec


@click.group(cls=Group)
def cdi() -> None:
    """The node's CDI spec for nvidia.com/gpu (GPUs by index and UUID, MIG devices, all)."""


@cdi.command("generate")
@gpu_options
@click.option("--driver-root", default="/", show_default=True, help=_DRIVER_ROOT_HELP)
@click.option("--stdout", "to_stdout", is_flag=True, help="Print the spec instead of writing the file.")
@click.option(
    "--sim-host-files",
    is_flag=True,
    help="With the simulator: first lay out its /proc and /dev files and a fake driver under --root.",
)
@click.pass_context
def generate(ctx: click.Context, driver_root: str, to_stdout: bool, sim_host_files: bool) -> None:
    """Write /var/run/cdi/nvidia.yaml for the GPUs as they are now (nothing when it is already current)."""
    from nodeagent.cdi.writer import CdiWriter

    paths = _paths(ctx)
    driver_root = _driver_root(driver_root)
    opts = gpu_opts(ctx)
    if sim_host_files and opts.simulate is None and opts.sim_state is None:
        raise InputError("--sim-host-files needs the simulator (--simulate MACHINE or --sim-state FILE)")
    with open_adapter(ctx) as nvml:
        inventory = nvml.discover()
    if sim_host_files:
        from nodeagent.cdi import simhost

        simhost.materialise(paths, inventory)
        simhost.make_driver_root(paths, inventory.driver_version, driver_root=driver_root)
    writer = CdiWriter(paths, driver_root=driver_root)
    if to_stdout:
        text = writer.render(inventory)
        if text is None:
            raise OperationError("no GPU on this node: there is no CDI spec to print")
        click.echo(text, nl=False)
        return
    result = writer.write(inventory)
    if result.action == "written":
        click.echo(f"wrote {result.path} ({len(result.devices)} device names)")
    elif result.action == "removed":
        click.echo(f"removed {result.path}: no GPU on this node")
    elif result.action == "absent":
        click.echo("no GPU on this node: no CDI spec written")
    else:
        click.echo(f"{result.path} is up to date ({len(result.devices)} device names)")


@cdi.command("show")
@gpu_options
@click.option("--check", is_flag=True, help="Also compare with the GPUs now; exit 1 when the file is stale.")
@click.option("--driver-root", default="/", show_default=True, help=_DRIVER_ROOT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@click.pass_context
def show(ctx: click.Context, check: bool, driver_root: str, as_json: bool) -> None:
    """Print the device names /var/run/cdi/nvidia.yaml resolves (and with --check whether it is current)."""

    from nodeagent import fileio
    from nodeagent.cdi.spec import device_names
    from nodeagent.cdi.writer import CdiWriter

    paths = _paths(ctx)
    writer = CdiWriter(paths, driver_root=_driver_root(driver_root))
    text = fileio.read_text(paths(writer.spec_path))
    spec = _load_spec(writer, text)
    out: dict[str, Any] = {
        "path": writer.file,
        "exists": text is not None,
        "cdiVersion": spec.get("cdiVersion") if spec else None,
        "kind": spec.get("kind") if spec else None,
        "devices": device_names(spec),
    }
    if check:
        with open_adapter(ctx) as nvml:
            inventory = nvml.discover()
        out["current"] = writer.render(inventory) == text
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        if text is None:
            click.echo(f"no CDI spec at {writer.file}")
        else:
            click.echo(f"{writer.file}: cdiVersion {out['cdiVersion']}, kind {out['kind']}, "
                       f"{len(out['devices'])} device names")
            for name in out["devices"]:
                click.echo(f"  {name}")
        if check:
            opts = gpu_opts(ctx)
            flags = (f" --simulate {shlex.quote(opts.simulate)}" if opts.simulate else "") + (
                f" --sim-state {shlex.quote(str(opts.sim_state))}" if opts.sim_state else "")
            click.echo("current: matches the GPUs" if out["current"] else
                       f"STALE: differs from the GPUs now; run `{paths.command('cdi generate' + flags)}`")
    if check and not out["current"]:
        ctx.exit(1)


@cdi.command("list")
@click.option("--driver-root", default="/", show_default=True, help=_DRIVER_ROOT_HELP)
@click.pass_context
def list_cmd(ctx: click.Context, driver_root: str) -> None:
    """Print the device names the CDI spec on disk resolves, one a line (as nvidia-ctk cdi list)."""
    from nodeagent import fileio
    from nodeagent.cdi.spec import device_names
    from nodeagent.cdi.writer import CdiWriter

    paths = _paths(ctx)
    writer = CdiWriter(paths, driver_root=_driver_root(driver_root))
    text = fileio.read_text(paths(writer.spec_path))
    if text is None:  # no device names: nothing on stdout, and why on stderr (exit 0, as `cdi show`)
        click.echo(f"no CDI spec at {writer.file}", err=True)
        return
    names = device_names(_load_spec(writer, text))
    if names:
        click.echo("\n".join(names))
