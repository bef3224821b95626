"""``nodeagent bootstrap``: prepare a node once (provisioning pipelines, image builds) and report in JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from nodeagent.clicontext import settings_of, simulation_label
from nodeagent.config import RestartMode, load_config


@click.command()
@click.option("--config", "config_file", type=click.Path(path_type=Path), default=None,
              help="Config file (default: /etc/nodeagent/config.toml under --root; missing = defaults).")
@click.option("--simulate", metavar="MACHINE", default=None, help="Use the NVML simulator with this machine.")
@click.option("--sim-state", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Simulator state file.")
@click.option("--mig-config", metavar="NAME", default=None,
              help="Apply this named config from the MIG config file (default: leave MIG alone).")
@click.option("--no-restart", is_flag=True, default=False,
              help="Never restart containerd (the default under --root other than /).")
@click.option("--restart", "restart_mode", type=click.Choice(["systemd", "signal", "none"]), default=None,
              help="How to restart containerd when its config changed [default: [runtime] restart; under "
                   "--root other than /: none unless given, systemd refused]. The DaemonSet, whose --root "
                   "/host is the node itself, gives signal.")
@click.option("--no-kube", is_flag=True, default=False, help="Skip RuntimeClass and labels.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="kubeconfig file (default: in-cluster service account, $KUBECONFIG, ~/.kube/config).")
@click.option("--node-name", default=None, help="Node to label (default: $NODE_NAME, else host name).")
@click.option("--with-reboot", is_flag=True, default=None, help="Allow a reboot for MIG mode changes.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the JSON report to this file.")
@click.pass_context
def bootstrap(
    ctx: click.Context,
    config_file: Path | None,
    simulate: str | None,
    sim_state: Path | None,
    mig_config: str | None,
    no_restart: bool,
    restart_mode: RestartMode | None,
    no_kube: bool,
    kubeconfig: Path | None,
    node_name: str | None,
    with_reboot: bool | None,
    output: Path | None,
) -> int:
    """Discover, shape MIG, wire containerd, publish RuntimeClass and labels; print a JSON report.

    Exit code 0 all steps fine, 1 a step failed, 2 bad input, 3 a reboot is required.
    """
    from nodeagent import bootstrap as bs

    settings = settings_of(ctx)
    label = simulation_label(simulate, sim_state)
    if label is not None:
        settings.simulate(label)
    config = load_config(
        settings.paths,
        config_file,
        {
            "simulate.machine": simulate,
            "simulate.state": _str_or_none(settings.sim_state(sim_state)),
            "kube": False if no_kube else None,
            "kubeconfig": None if kubeconfig is None else str(kubeconfig.absolute()),
            "node_name": node_name,
            "mig.with_reboot": with_reboot,
        },
    )
    settings.simulated_by_config(config.simulate.machine, config.simulate.state)
    if config.kube and not no_kube and config.kubeconfig:  # a malformed one is refused before any step runs
        from nodeagent.kube.kubeconfig import read_kubeconfig

        read_kubeconfig(Path(config.kubeconfig))
    under_root = settings.paths.root != Path("/")
    if restart_mode == "systemd" and under_root:
        raise click.UsageError(f"--restart systemd restarts this host's containerd, not the one of --root "
                               f"{settings.paths.root}; use --restart signal or none")
    if restart_mode is not None:
        config = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, restart=restart_mode))
    # a root (an image, a sandbox) is never acted on from outside unless --restart says how
    restart = not no_restart and (restart_mode is not None or not under_root)
    options = bs.Options(mig_config=mig_config, restart_containerd=restart, kube=not no_kube,
                         restart_off="--no-restart" if no_restart else f"under --root {settings.paths.root} nothing "
                         "is restarted unless --restart says how")
    report = bs.bootstrap(config, settings.paths, options, bs.default_parts())
    text = json.dumps(report.to_dict(), indent=2)
    click.echo(text)
    if output is not None:
        output.write_text(text + "\n", encoding="utf-8")
    return report.exit_code


def _str_or_none(path: Path | None) -> str | None:
    return None if path is None else str(path)
