"""``nodeagent doctor``: one read-only command that explains a GPU node (see nodeagent/doctor/)."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import click

from nodeagent.clicontext import settings_of
from nodeagent.commands.common import gpu_options, gpu_opts, open_adapter

if TYPE_CHECKING:
    from nodeagent.gpu.inventory import Inventory


@click.command()
@gpu_options
@click.option("--config", "config_file", type=click.Path(path_type=Path), default=None,
              help="Agent config file (default: /etc/nodeagent/config.toml under --root; missing = defaults).")
@click.option("--no-kube", is_flag=True, default=False, help="Leave the Kubernetes API out (no Node checks).")
@click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="kubeconfig file (default: in-cluster service account, $KUBECONFIG, ~/.kube/config).")
@click.option("--node-name", default=None, help="Node to check (default: $NODE_NAME, else host name).")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option("--containerd-binary", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The containerd program asked whether its config loads (`containerd --config FILE config dump`; "
                   "default: containerd on PATH). On the host itself only: under --root nothing is executed.")
@click.pass_context
def doctor(ctx: click.Context, config_file: Path | None, no_kube: bool, kubeconfig: Path | None,
           node_name: str | None, as_json: bool, containerd_binary: Path | None) -> int:
    """Explain this GPU node: driver, GPUs and MIG, health, containerd, CDI, kubelet, Node, the agent.

    Read-only. Each finding is ok, warning or error on one line, with the command that fixes it.
    Exit 0 all ok, 1 a warning, 2 an error.
    """
    from nodeagent.config import AgentConfig, apply_overrides, load_config
    from nodeagent.doctor import HostChecks, Sources, diagnose
    from nodeagent.errors import ConfigError

    settings = settings_of(ctx)
    opts = gpu_opts(ctx)
    paths = settings.paths
    host = None
    if paths.root == Path("/"):  # the real host: systemd and containerd may be asked (read-only programs)
        from nodeagent import hostcommands as hc

        binary = str(containerd_binary.absolute()) if containerd_binary is not None else hc.find_containerd()
        host = HostChecks(unit_state=hc.unit_state,
                          containerd_loads=(lambda config: hc.containerd_loads(binary, config)) if binary else None,
                          containerd=binary or "")
    elif containerd_binary is not None:
        raise click.BadParameter(f"{containerd_binary} would be executed, and under --root {paths.root} nothing is: "
                                 "give it only on the host itself (no --root)", param_hint="--containerd-binary")
    overrides = {
        "kube": False if no_kube else None,
        "kubeconfig": None if kubeconfig is None else str(kubeconfig.absolute()),
        "node_name": node_name,
    }
    config_problem = ""
    try:
        config = load_config(paths, config_file, overrides)
    except ConfigError as e:
        if config_file is not None:  # the file asked for on the command line: a bad input of this command
            raise
        # the node's own config is broken: that is a finding, and the rest is checked with the defaults
        config_problem = str(e)
        config = apply_overrides(dataclasses.replace(AgentConfig(), source="defaults"), overrides)
    simulated = opts.simulate is not None or opts.sim_state is not None
    sim_fix = " ".join(
        ([f"--simulate {shlex.quote(opts.simulate)}"] if opts.simulate else [])
        + ([f"--sim-state {shlex.quote(str(opts.sim_state))}"] if opts.sim_state else []))

    def discover() -> Inventory:
        with open_adapter(ctx) as nvml:
            return nvml.discover()

    def recovery(indices: list[int]) -> dict[int, int]:
        with open_adapter(ctx) as nvml:
            return {i: int(nvml.recovery_action(i)) for i in indices}

    def kube() -> object:
        from nodeagent.kube.client import KubeClient, connect

        return KubeClient(connect(Path(config.kubeconfig) if config.kubeconfig else None))

    # the options in use that the printed run/bootstrap/doctor command lines need to run as printed
    agent_opts = [*(["--config", shlex.quote(str(config_file))] if config_file is not None else []),
                  *(["--no-kube"] if no_kube else []),
                  *(["--kubeconfig", shlex.quote(str(kubeconfig))] if kubeconfig is not None else []),
                  *(["--node-name", shlex.quote(node_name)] if node_name else [])]
    report = diagnose(Sources(
        paths=paths, config=config, discover=discover,
        command=lambda sub: f"{settings.command_prefix()} {sub}",
        kube=kube if config.kube else None, node_name=config.resolved_node_name(),
        recovery=recovery, simulated=simulated, sim_fix=sim_fix, config_problem=config_problem, host=host,
        agent_opts=" ".join(agent_opts),
        kubeconfig_opt=f"--kubeconfig {shlex.quote(str(kubeconfig))}" if kubeconfig is not None else "",
    ))
    click.echo(report.to_json() if as_json else report.render())
    return report.exit_code
