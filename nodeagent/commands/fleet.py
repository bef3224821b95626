"""``nodeagent fleet status|clear-brake``: the disruption budget as the operator sees and steers it."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from nodeagent.clicontext import Group
from nodeagent.errors import ConfigError
from nodeagent.fleet.budget import SOURCE, FleetBudget, parse_budget
from nodeagent.fleet.leases import FleetApi
from nodeagent.fleet.status import clear_brake, render, tally
from nodeagent.kube.client import KubeClient, connect

DEFAULT_NAMESPACE = "nodeagent"


def _api(kubeconfig: Path | None, namespace: str) -> FleetApi:
    return FleetApi(KubeClient(connect(kubeconfig)), namespace)


def _budget(api: FleetApi) -> FleetBudget:
    text = api.read_budget()
    if text is None:
        raise ConfigError(f"no budget: {SOURCE} does not exist in namespace {api.namespace}", subject=SOURCE)
    return parse_budget(text, f"{SOURCE} (namespace {api.namespace})")


@click.group("fleet", cls=Group)
def fleet() -> None:
    """Fleet-wide changes under a disruption budget: status per pool, clear a brake."""


_kubeconfig = click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path), default=None,
                           help="kubeconfig file (default: in-cluster service account, $KUBECONFIG, "
                                "~/.kube/config).")
_namespace = click.option("-n", "--namespace", default=DEFAULT_NAMESPACE, show_default=True,
                          help="The agents' namespace (the budget ConfigMap and the Leases).")


@fleet.command("status")
@_kubeconfig
@_namespace
@click.option("--json", "as_json", is_flag=True, help="One JSON document instead of the table.")
def status(kubeconfig: Path | None, namespace: str, as_json: bool) -> None:
    """Per pool: nodes done, changing, waiting, failed (with why), and the brake."""
    api = _api(kubeconfig, namespace)
    tallies = tally(api, _budget(api))
    click.echo(json.dumps([asdict(t) for t in tallies], indent=1) if as_json else render(tallies))


@fleet.command("clear-brake")
@_kubeconfig
@_namespace
@click.argument("pool")
def clear(kubeconfig: Path | None, namespace: str, pool: str) -> None:
    """Turn POOL's brake off (its failure count starts again at zero); waiting nodes go on."""
    api = _api(kubeconfig, namespace)
    if _budget(api).pool(pool) is None:
        raise ConfigError(f"pool {pool!r} is not in the budget ({SOURCE})", subject=pool)
    state = clear_brake(api, pool)
    click.echo(f"pool {pool}: brake off" + ("" if state.exists else " (it had never been on)"))
