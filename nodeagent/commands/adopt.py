"""``nodeagent adopt``: hand a node over from NVIDIA's GPU Operator (or back with ``--release``)."""

from __future__ import annotations

import json
from pathlib import Path

import click

NO_KUBE_ADVICE = "Give --kubeconfig FILE, or --no-kube to run without the API"
ADOPT_ADVICE = ("Give --kubeconfig FILE (adopt works only through the API: run it where the cluster's credentials "
                "are, or in the agent's pod)")


@click.command()
@click.option("--node-name", default=None, help="Node to hand over (default: $NODE_NAME, else host name).")
@click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="kubeconfig file (default: in-cluster service account, $KUBECONFIG, ~/.kube/config).")
@click.option("--release", is_flag=True, help="Give the operands back to the GPU Operator.")
@click.option("--with-dcgm-exporter", is_flag=True,
              help="Also take over from dcgm-exporter (nodeagent's metrics carry the DCGM_FI_* names).")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True,
              help="Seconds to wait for the operator's pods to leave the node.")
def adopt(node_name: str | None, kubeconfig: Path | None, release: bool, with_dcgm_exporter: bool,
          timeout_s: float) -> None:
    """Take a node over from the GPU Operator through its nvidia.com/gpu.deploy.* labels.

    The device plugin, GPU feature discovery, MIG manager and container toolkit operands are switched off
    on this node and nodeagent waits until their pods are gone; the driver stays NVIDIA's. Running GPU pods
    keep their devices. --release switches back exactly what a hand-over switched off.
    """
    import os
    import socket

    from nodeagent import adopt as ad
    from nodeagent.errors import KubeError
    from nodeagent.kube.client import KubeClient, connect

    node = node_name or os.environ.get("NODE_NAME") or socket.gethostname()
    try:
        api = connect(kubeconfig)
    except KubeError as e:
        # the client's advice names --no-kube, which the commands that can do without the API take; adopt
        # works only through the API
        text = str(e)
        if NO_KUBE_ADVICE not in text:
            raise
        raise KubeError(text.replace(NO_KUBE_ADVICE, ADOPT_ADVICE), subject=e.subject) from None
    kube = KubeClient(api)
    try:
        result = ad.release(kube, node) if release else ad.hand_over(
            kube, node, with_dcgm_exporter=with_dcgm_exporter, timeout_s=timeout_s)
    finally:
        kube.close()
    click.echo(json.dumps(result.to_dict(), indent=2, sort_keys=True))
