"""``nodeagent controller``: the cluster-wide part of ComputeDomains and of GPU remediation (the evictions node
agents request), as a leader-elected Deployment."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="kubeconfig file (default: in-cluster service account, $KUBECONFIG, ~/.kube/config).")
@click.option("--lease-namespace", default=None,
              help="Namespace of the Lease (default: $POD_NAMESPACE, else nodeagent).")
@click.option("--lease-name", default="nodeagent-controller", show_default=True, help="Name of the Lease.")
@click.option("--identity", default=None, help="This candidate's name in the Lease (default: $POD_NAME, "
              "else host name and process id).")
@click.option("--lease-duration", type=click.FloatRange(min=1), default=15.0, show_default=True,
              help="Seconds a Lease not renewed stays taken.")
@click.option("--renew-deadline", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds the leader keeps leading while renewals fail.")
@click.option("--retry-period", type=click.FloatRange(min=0.05), default=2.0, show_default=True,
              help="Seconds between tries to take or renew the Lease.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=2.0, show_default=True,
              help="Seconds between passes while work is outstanding (an eviction a PodDisruptionBudget refuses) "
              "or after a failed pass; changes are acted on as the watches report them.")
@click.option("--resync", type=click.FloatRange(min=1, max=3600), default=300.0, show_default=True,
              help="Seconds between full passes whatever the watches report (a safety net).")
@click.option("--computedomains/--no-computedomains", default=True, show_default=True,
              help="Keep ComputeDomains' templates and status (needs NVIDIA's ComputeDomain CRD).")
@click.option("--remediation/--no-remediation", default=False, show_default=True,
              help="Execute the pod evictions node agents request on their own Nodes for GPU remediation.")
def controller(kubeconfig: Path | None, lease_namespace: str | None, lease_name: str, identity: str | None,
               lease_duration: float, renew_deadline: float, retry_period: float, interval: float,
               resync: float, computedomains: bool, remediation: bool) -> None:
    """Keep ComputeDomains' templates and status, and execute GPU remediation's eviction requests; leader-elected.

    For every ComputeDomain (resource.nvidia.com/v1beta1) it keeps the ResourceClaimTemplate the domain
    names, asking nodeagent's DRA driver for an IMEX channel in one NVLink clique, and the domain's status
    from what the node agents report on their own Nodes. Runs until SIGTERM/SIGINT.
    """
    import os
    import signal
    import socket
    import threading

    from nodeagent.computedomain.controller import Duty, run
    from nodeagent.computedomain.lease import LeaderElector, LeaseConfig
    from nodeagent.kube.client import KubeClient, connect

    if not computedomains and not remediation:
        raise click.UsageError("nothing to do: --no-computedomains without --remediation")
    if renew_deadline >= lease_duration:
        raise click.BadParameter("must be less than --lease-duration", param_hint="--renew-deadline")
    if retry_period >= renew_deadline:
        raise click.BadParameter("must be less than --renew-deadline", param_hint="--retry-period")
    cfg = LeaseConfig(
        namespace=lease_namespace or os.environ.get("POD_NAMESPACE") or "nodeagent",
        name=lease_name,
        identity=identity or os.environ.get("POD_NAME") or f"{socket.gethostname()}_{os.getpid()}",
        lease_duration=lease_duration, renew_deadline=renew_deadline, retry_period=retry_period,
    )
    kube = KubeClient(connect(kubeconfig))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        duties = []
        if remediation:
            from nodeagent.remediation.broker import EvictionBroker
            from nodeagent.remediation.evictreq import node_relevance

            broker = EvictionBroker(kube)
            duties.append(Duty("evictions", lambda nodes: broker.pass_once(nodes).outstanding, node_relevance))
        run(kube, LeaderElector(kube, cfg), stop, interval=interval, resync=resync, computedomains=computedomains,
            duties=duties)
    finally:
        kube.close()
