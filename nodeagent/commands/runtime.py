"""``nodeagent runtime``: wire the nvidia runtime into containerd, undo it, show what containerd loads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from nodeagent.clicontext import Group, Settings, settings_of
from nodeagent.config import flag_path
from nodeagent.errors import RestartError
from nodeagent.runtime import configure as rc
from nodeagent.runtime.containerd import DEFAULT_BINARY, DEFAULT_CONFIG, DEFAULT_DROPIN
from nodeagent.runtime.restart import DEFAULT_SOCKET, RESTART_MODES, RestartMode, restart_containerd

F = TypeVar("F", bound=Callable[..., Any])


def _settings(ctx: click.Context) -> Settings:
    return settings_of(ctx)


def _echo_result(result: rc.Result, as_json: bool, extra: dict[str, Any]) -> None:
    if as_json:
        click.echo(json.dumps({**result.to_dict(), **extra}, indent=2, sort_keys=True))
        return
    for f in result.files:
        if result.dry_run and f.diff:
            click.echo(f.diff, nl=False)
        elif not result.dry_run:
            backup = f" (backup {f.backup})" if f.backup else ""
            click.echo(f"{f.action:9} {f.path}{backup}")
    if result.dry_run:
        click.echo("dry run: nothing written" if result.changed else "dry run: already configured")
    elif not result.changed:
        click.echo("unchanged")
    for key, value in extra.items():
        click.echo(f"{key}: {value}")
    for note in result.notes:
        click.echo(note)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)


def _restart_mode(settings: Settings, given: RestartMode | None) -> RestartMode:
    """``--restart`` as given; by default ``systemd`` on the host and ``none`` under another ``--root``
    (a root is a sandbox or an image: nothing outside it is restarted unless asked). ``systemd`` under a
    root is refused: ``systemctl`` would restart this host's containerd, not the root's."""
    under_root = settings.paths.root != Path("/")
    if given is None:
        return "none" if under_root else "systemd"
    if given == "systemd" and under_root:
        raise click.UsageError(
            f"--restart systemd restarts this host's containerd, not the one of --root {settings.paths.root}; "
            "use --restart signal (signals the process serving the root's containerd socket) or none")
    return given


def _restart(settings: Settings, result: rc.Result, mode: RestartMode, socket: str, timeout: float) -> dict[str, Any]:
    if result.dry_run or not result.restart_needed:
        return {}
    if mode == "none":
        return {"restart": "needed (--restart none): restart containerd to load the change"}
    try:
        took = restart_containerd(mode, settings.paths(socket), timeout=timeout)
    except RestartError as e:
        written = ", ".join(f.path for f in result.files if f.action != "unchanged")
        raise RestartError(f"{e} (written: {written}; containerd loads it at its next start)",
                           subject=e.subject) from e
    return {"restart": f"containerd answered after {took:.1f}s" if took is not None else "skipped"}


def _host_flag(settings: Settings, value: str | None, default: str, flag: str) -> str:
    """A path flag (a path as the shell sees it, inside ``--root``) as the host path nodeagent uses;
    ``default`` (a host path) when the flag was not given."""
    return default if value is None else (flag_path(settings.paths, value, flag) or default)


@click.group(cls=Group)
def runtime() -> None:
    """Wire the nvidia runtime into containerd, undo it, show what containerd loads."""


_restart_option = click.option(
    "--restart",
    "restart_mode",
    type=click.Choice(RESTART_MODES),
    default=None,
    help="How to restart containerd when its config changed [default: systemd; none under --root "
         "other than /, where systemd is refused].",
)
_socket_option = click.option(
    "--socket", default=None, help=f"containerd's socket [default: {DEFAULT_SOCKET} under --root]."
)
_timeout_option = click.option(
    "--restart-timeout", type=float, default=60.0, show_default=True, help="Seconds to wait for containerd."
)


def _change_options(command: F) -> F:
    """The options of every command that may rewrite containerd's files: how to restart it, dry run, JSON."""
    for option in reversed((
        _restart_option,
        _socket_option,
        _timeout_option,
        click.option("--dry-run", is_flag=True, help="Print a unified diff of every change; write nothing."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON."),
    )):
        command = option(command)
    return command


def _runtime_type(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """nvidia-ctk's ``--runtime`` (the container engine): containerd is the one nodeagent wires."""
    if value is not None and value != "containerd":
        raise click.BadParameter(
            f"{value!r}: nodeagent wires containerd only (the name of the runtime table is --runtime-name)",
            ctx=ctx, param=param)
    return value


_runtime_option = click.option(
    "--runtime", "runtime_type", default=None, callback=_runtime_type, expose_value=False, metavar="containerd",
    help="The container engine, as nvidia-ctk's flag: containerd (the only one nodeagent wires).")
_config_option = click.option(
    "--containerd-config", "--config", "containerd_config", default=None,
    help=f"containerd's root config, as nvidia-ctk's --config [default: {DEFAULT_CONFIG} under --root].")


@runtime.command("configure")
@_runtime_option
@_config_option
@click.option("--drop-in", "dropin", default=None,
              help=f"Write a drop-in here and import it [default mode for version >= 2; "
                   f"{DEFAULT_DROPIN} under --root].")
@click.option("--in-place", is_flag=True, help="Edit the root config itself instead of writing a drop-in.")
@click.option("--set-as-default", is_flag=True, help="Make the nvidia runtime containerd's default runtime.")
@click.option("--cdi", is_flag=True, help="Enable CDI in containerd and add the nvidia-cdi runtime.")
@click.option("--leak-guard/--no-leak-guard", default=True, show_default=True,
              help="Stop unprivileged pods from getting GPUs through NVIDIA_VISIBLE_DEVICES.")
@click.option("--runtime-name", default="nvidia", show_default=True,
              help="Name of the runtime table (and RuntimeClass handler) to write.")
@click.option("--binary", "binary_path", default=DEFAULT_BINARY, show_default=True,
              help="The nvidia-container-runtime binary (BinaryName).")
@click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Also create/update the RuntimeClass objects through this kubeconfig.")
@_change_options
@click.pass_context
def configure_cmd(
    ctx: click.Context,
    containerd_config: str | None,
    dropin: str | None,
    in_place: bool,
    set_as_default: bool,
    cdi: bool,
    leak_guard: bool,
    runtime_name: str,
    binary_path: str,
    kubeconfig: Path | None,
    restart_mode: RestartMode | None,
    socket: str | None,
    restart_timeout: float,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Add the nvidia runtime to containerd, keeping everything else in its files byte for byte."""
    if dropin is not None and in_place:
        raise click.UsageError("--drop-in and --in-place exclude each other")
    settings = _settings(ctx)
    mode = _restart_mode(settings, restart_mode)
    socket_path = _host_flag(settings, socket, DEFAULT_SOCKET, "--socket")  # checked before anything is written
    opts = rc.Options(
        containerd_config=_host_flag(settings, containerd_config, DEFAULT_CONFIG, "--containerd-config"),
        mode="in-place" if in_place else "drop-in" if dropin is not None else "auto",
        dropin=_host_flag(settings, dropin, DEFAULT_DROPIN, "--drop-in"),
        runtime_name=runtime_name,
        binary_path=binary_path,
        set_as_default=set_as_default,
        cdi=cdi,
        leak_guard=leak_guard,
        dry_run=dry_run,
    )
    kube = None
    if kubeconfig is not None and not dry_run:  # bad credentials fail before any file is written
        from nodeagent.kube.client import KubeClient, connect

        kube = KubeClient(connect(kubeconfig))
    try:
        result = rc.configure(settings.paths, opts)
        extra = _restart(settings, result, mode, socket_path, restart_timeout)
        if kube is not None:
            from nodeagent.kube.runtimeclass import desired_classes, ensure_runtime_classes

            done = ensure_runtime_classes(kube, desired_classes(name=runtime_name, handler=runtime_name, cdi=cdi))
            extra["runtimeclasses"] = done if as_json else ", ".join(f"{k} {v}" for k, v in done.items())
    finally:
        if kube is not None:
            kube.close()
    _echo_result(result, as_json, extra)


@runtime.command("unconfigure")
@_change_options
@click.pass_context
def unconfigure_cmd(
    ctx: click.Context, restart_mode: RestartMode | None, socket: str | None, restart_timeout: float,
    dry_run: bool, as_json: bool,
) -> None:
    """Put back the files `runtime configure` changed (exact previous bytes when untouched since)."""
    settings = _settings(ctx)
    mode = _restart_mode(settings, restart_mode)
    socket_path = _host_flag(settings, socket, DEFAULT_SOCKET, "--socket")  # checked before anything changes
    result = rc.unconfigure(settings.paths, dry_run=dry_run)
    extra = _restart(settings, result, mode, socket_path, restart_timeout)
    _echo_result(result, as_json, extra)


@runtime.command("show")
@_runtime_option
@_config_option
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@click.pass_context
def show_cmd(ctx: click.Context, containerd_config: str | None, as_json: bool) -> None:
    """What containerd will load: runtimes, the default runtime, and the files they come from."""
    settings = _settings(ctx)
    info = rc.show(settings.paths,
                   _host_flag(settings, containerd_config, DEFAULT_CONFIG, "--containerd-config"))
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    click.echo(f"sources:          {', '.join(info['sources']) or '(no config file: built-in defaults)'}")
    click.echo(f"config version:   {info['config_version']}")
    click.echo(f"containerd:       {info['containerd_version'] or 'not found'}")
    click.echo(f"default runtime:  {info['default_runtime']}")
    click.echo(f"CDI:              {'on' if info['enable_cdi'] else 'off'}")
    lg = info["leak_guard"]
    click.echo(f"leak guard:       {'no toolkit config' if lg is None else 'on' if lg else 'off'}")
    click.echo(f"{'RUNTIME':16} {'TYPE':24} {'SYSTEMD':8} BINARY")
    for name, rt in info["runtimes"].items():
        sc = rt["systemd_cgroup"]
        click.echo(f"{name:16} {rt['runtime_type']:24} {'-' if sc is None else str(sc).lower():8} {rt['binary']}")
    for warning in info["warnings"]:
        click.echo(f"warning: {warning}", err=True)
