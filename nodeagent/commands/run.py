"""``nodeagent run``: the long-running agent (systemd service or DaemonSet container)."""

from __future__ import annotations

from pathlib import Path

import click

from nodeagent.clicontext import settings_of, simulation_label
from nodeagent.config import AgentConfig, flag_path, load_config
from nodeagent.logs import setup_logging


def _refuse_mig_strategy(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        raise click.BadParameter(
            "nodeagent reads the MIG strategy from the device-plugin config file, as NVIDIA's device plugin "
            f"does from its own: put `flags: {{migStrategy: {value}}}` in the file given with "
            "--device-plugin-config FILE (or [device_plugin] config)", ctx=ctx, param=param)


@click.command()
@click.option("--config", "config_file", type=click.Path(path_type=Path), default=None,
              help="Config file (default: /etc/nodeagent/config.toml under --root; missing = defaults).")
@click.option("--simulate", metavar="MACHINE", default=None, help="Use the NVML simulator with this machine.")
@click.option("--sim-state", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Simulator state file (keeps MIG layouts across restarts).")
@click.option("--no-kube", is_flag=True, default=False, help="Never talk to the Kubernetes API.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="kubeconfig file (default: in-cluster service account).")
@click.option("--node-name", default=None, help="Node to publish to (default: $NODE_NAME, else host name).")
@click.option("--kubelet-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Kubelet root directory (default /var/lib/kubelet).")
@click.option("--pod-resources-socket", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Kubelet PodResources API socket "
                   "(default: pod-resources/kubelet.sock below the kubelet dir).")
@click.option("--device-plugin-config", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="NVIDIA device-plugin config file (version: v1).")
@click.option("--with-reboot", is_flag=True, default=None, help="Allow a reboot for MIG mode changes.")
@click.option("--metrics-address", metavar="HOST:PORT", default=None,
              help="Serve Prometheus metrics here (default 127.0.0.1:9400; \"\" = no listener).")
@click.option("--log-format", "run_log_format", type=click.Choice(["text", "json"]), default=None,
              help="Log lines for a terminal or JSON for collectors (same as the global option).")
@click.option("--log-level", "run_log_level", type=click.Choice(["debug", "info", "warning", "error"]),
              default=None, help="Least severe log lines shown (same as the global option).")
@click.option("--mig-strategy", "mig_strategy", default=None, hidden=True, expose_value=False,
              callback=_refuse_mig_strategy,
              help="NVIDIA's device-plugin flag: refused (the strategy is flags.migStrategy in the "
                   "device-plugin config file).")
@click.pass_context
def run(
    ctx: click.Context,
    config_file: Path | None,
    simulate: str | None,
    sim_state: Path | None,
    no_kube: bool,
    kubeconfig: Path | None,
    node_name: str | None,
    kubelet_dir: Path | None,
    pod_resources_socket: Path | None,
    device_plugin_config: Path | None,
    with_reboot: bool | None,
    metrics_address: str | None,
    run_log_format: str | None,
    run_log_level: str | None,
) -> int:
    """Run the agent until SIGTERM/SIGINT; SIGHUP reloads the config."""
    from nodeagent.daemon import build_daemon, run_daemon

    settings = settings_of(ctx)
    label = simulation_label(simulate, sim_state)
    if label is not None:
        settings.simulate(label)
    paths = settings.paths
    overrides: dict[str, object] = {
        "simulate.machine": simulate,
        "simulate.state": _str_or_none(settings.sim_state(sim_state)),
        "kube": False if no_kube else None,
        "kubeconfig": None if kubeconfig is None else str(kubeconfig.absolute()),
        "node_name": node_name,
        "kubelet.dir": flag_path(paths, kubelet_dir, "--kubelet-dir"),
        "kubelet.pod_resources_socket": flag_path(paths, pod_resources_socket, "--pod-resources-socket"),
        "device_plugin.config": flag_path(paths, device_plugin_config, "--device-plugin-config"),
        "mig.with_reboot": with_reboot,
        "metrics.address": metrics_address,
    }
    parent = ctx.parent
    if parent is not None:
        for key in ("log_format", "log_level"):
            if parent.get_parameter_source(key) is not click.core.ParameterSource.DEFAULT:
                overrides[key] = getattr(settings, key)
    if run_log_format is not None:
        overrides["log_format"] = run_log_format
    if run_log_level is not None:
        overrides["log_level"] = run_log_level

    def reload() -> AgentConfig:
        return load_config(settings.paths, config_file, overrides)

    config = reload()
    settings.simulated_by_config(config.simulate.machine, config.simulate.state)
    setup_logging(config.log_format, config.log_level)
    daemon = build_daemon(config, settings.paths, reload_config=reload)
    return run_daemon(daemon)


def _str_or_none(path: Path | None) -> str | None:
    return None if path is None else str(path)
