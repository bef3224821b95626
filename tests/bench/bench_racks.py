"""NVLink racks on the several-node cluster (tests/peers/multinode.py): what the host-managed IMEX daemon and a
ComputeDomain cost with nodeagent, beside the steps NVIDIA's DRA driver takes for the same.

1. Agents switched to [imex] (the DaemonSet's ConfigMap and the packaged patch file
   packaging/kubernetes/daemonset-imex.patch.yaml, every agent replaced) → IMEX READY with every rack node in
   every daemon's nodes file; then the rack nodes' agent pods deleted (a restart: the daemon is the agent's child)
   → the new agents' daemons answer READY again. The rack is the nodes the simulator lets into one:
   gb200-nvl and gb300-nvl (nodes 2 and 3); dgx-h100 and hgx-h200 have no fabric cluster (no rack_nodes), so
   2 rack nodes whatever --nodes.
2. ComputeDomain created → its ResourceClaimTemplate, both pods Running, the domain Ready.
3. Channel prepare: NodePrepareResources of the IMEX channel device (channel-0, ComputeDomainChannelConfig
   Single) over the driver's socket, in-process on a private kube-apiserver (claim GET, the channel device,
   CDI spec, checkpoint), p50/p99 over --claims; and the real kubelets' own figure for the domain's pods
   (their dra_grpc_operations_duration_seconds sum/count for NodePrepareResources).

    source tests/testbin/setup.sh && .venv/bin/python tests/bench/bench_racks.py [--nodes 3] [--claims 60]

Prints the figures and one JSON line. Needs root and the host paths the cluster owns (no other kubelet)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cluster.test_several_nodes import (
    CLIQUE_ID,
    CLIQUE_LABEL,
    DOMAIN,
    IMEX_CONFIG,
    RACK,
    RESYNC_S,
    TEMPLATE,
    _agent_logs,
    _domain_pod,
    _imex_ok,
    _in_agent,
    _internal_ip,
    _labels,
    _rack_nodes,
    _sim,
    deploy_agents,
    restart_agents,
)
from tests.cluster.test_whole_node import _packaged_configmap
from tests.peers.hostlock import host_owned
from tests.peers.multinode import MACHINES, SeveralNodes, running_nodes

PATCH_FILE = "packaging/kubernetes/daemonset-imex.patch.yaml"
CTL = ("/host/usr/bin/nvidia-imex-ctl", "-c", "/host/etc/nvidia-imex/config.cfg", "-q")
PREPARE_METRIC = "dra_grpc_operations_duration_seconds"

# What NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu, its compute-domain parts) does for the same,
# from the driver's sources as the project's reference notes them, step for step beside nodeagent's.
NVIDIA_STEPS = """\
NVIDIA's DRA driver for the same (its default mode, REFERENCE.md 13.A), beside nodeagent:
  IMEX ready on the rack's nodes
    NVIDIA:    per ComputeDomain, a DaemonSet of IMEX daemon pods (image pulled, started on the domain's nodes, the
               nodes labelled resource.nvidia.com/computeDomain), each pod with its own daemon claim (request
               "daemon", class compute-domain-daemon.nvidia.com, device daemon-0) prepared by the kubelet plugin;
               in the pod /imexd/imexd.cfg rendered, the nodes file of DNS names compute-domain-daemon-%04d with
               the IPs in /etc/hosts (SIGUSR1 on changes; in IP mode a restart), members tracked in a
               ComputeDomainClique object; ready when the startup/readiness/liveness probe
               `nvidia-imex-ctl -c /imexd/imexd.cfg -q` prints READY.
    nodeagent: no per-domain objects: the agent already on each node runs one nvidia-imex for its clique as its
               child, peers = the Nodes carrying the same nvidia.com/gpu.clique (one list by label); ready before
               any domain exists; a membership change rewrites the nodes file + SIGUSR1.
  ComputeDomain created -> pods Running
    NVIDIA:    controller: the workload ResourceClaimTemplate (class compute-domain-default-channel.nvidia.com)
               + the daemon DaemonSet and its claim template; the daemon pods scheduled, pulled, started, probed;
               with IMEXDaemonsWithDNSNames off the workload pods wait in ContainerCreating until numNodes daemons
               joined; status.nodes/status.status from the daemons.
    nodeagent: controller: the ResourceClaimTemplate only (clique-pinned channel request); the scheduler places
               the pods on one clique's channel-0 devices; the kubelet prepares the claim; the containers start.
  channel prepare
    NVIDIA:    compute-domain kubelet plugin: the channel device node in the CDI spec (Single: channel 0, All:
               0..2047); hostManaged mode asks `nvidia-imex-ctl -q --u=<socket>` for READY at prepare time.
    nodeagent: gpu.nodeagent.io: claim GET, the channel device made as nvidia-modprobe would, CDI spec,
               checkpoint."""


def _wait_ready(several_nodes: SeveralNodes, rack: list[Any], clique: str, peers: set[str], what: str) -> None:
    first = several_nodes.first
    try:
        for node in rack:
            first.wait_for(f"{node.node_name}: {what}", lambda n=node: _imex_ok(first, n, clique, peers)
                           and _in_agent(first, n, *CTL).strip() == "READY", timeout=300)
    except AssertionError:
        _agent_logs(first, several_nodes.nodes)
        raise


def _kubelet_prepare(first: Any, node: str) -> tuple[float, int]:
    """The kubelet's own NodePrepareResources seconds (sum) and calls (count) on ``node``, from its metrics."""
    text = first.kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/metrics", check=False).stdout
    total, count = 0.0, 0
    for line in text.splitlines():
        if line.startswith(PREPARE_METRIC) and "NodePrepareResources" in line:
            name, value = line.rsplit(" ", 1)
            if name.startswith(PREPARE_METRIC + "_sum"):
                total += float(value)
            elif name.startswith(PREPARE_METRIC + "_count"):
                count += int(float(value))
    return total, count


def cluster_figures(args: argparse.Namespace) -> dict[str, Any]:
    with host_owned("bench_racks"), running_nodes(args.nodes) as nodes:
        first = nodes.first
        deploy_agents(nodes)
        rack = _rack_nodes(nodes)
        for slot, node in enumerate(rack, start=1):
            _sim(node, nodes.machines[node.node_name], "fabric", "--rack", RACK, "--node", str(slot),
                 "--clique", str(CLIQUE_ID))
        from nodeagent.simulator.nvml_fabric import cluster_uuid
        from tests.integration._computedomain import CRD_NAME, crd_file

        first.kubectl("apply", "-f", str(crd_file()))
        first.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
        first.kubectl("apply", "-f", "packaging/kubernetes/rbac-dra.yaml")
        first.kubectl("apply", "-f", "packaging/kubernetes/computedomain-controller.yaml")
        configmap = _packaged_configmap()
        configmap["data"]["config.toml"] = (f"resync_interval = {RESYNC_S}\n" + configmap["data"]["config.toml"]
                                            + IMEX_CONFIG)
        first.kubectl("apply", "-f", "-", input_text=json.dumps(configmap))
        first.kubectl("patch", "daemonset", "-n", "nodeagent", "nodeagent", "--type", "merge", "-p", json.dumps(
            {"spec": {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}}}}))
        clique = f"{cluster_uuid(RACK)}.{CLIQUE_ID}"
        peers = {_internal_ip(n) for n in rack}
        began = time.monotonic()
        first.kubectl("patch", "daemonset", "-n", "nodeagent", "nodeagent", "--patch-file", PATCH_FILE)
        _wait_ready(nodes, rack, clique, peers, "IMEX READY with every rack node")
        switched_s = time.monotonic() - began

        # a restart of the rack nodes' agents: the pods deleted, their daemons die with them
        began = time.monotonic()
        restart_agents(first, rack, "a new agent")
        _wait_ready(nodes, rack, clique, peers, "IMEX READY again after the restart")
        restart_s = time.monotonic() - began
        assert all(_labels(n).get(CLIQUE_LABEL) == clique for n in rack)

        # a ComputeDomain across the rack
        before = {n.node_name: _kubelet_prepare(first, n.node_name) for n in rack}
        domain = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
                  "metadata": {"name": DOMAIN, "namespace": "default"},
                  "spec": {"numNodes": len(rack), "channel": {"resourceClaimTemplate": {"name": TEMPLATE}}}}
        names = [f"imex-worker-{i}" for i in range(len(rack))]
        began = time.monotonic()
        first.kubectl("apply", "-f", "-", input_text=json.dumps(domain))
        first.wait_for("the domain's ResourceClaimTemplate", lambda: first.kubectl(
            "get", "resourceclaimtemplate", TEMPLATE, check=False).returncode == 0, timeout=60)
        template_s = time.monotonic() - began
        for name in names:
            first.kubectl("apply", "-f", "-", input_text=json.dumps(_domain_pod(name)))
        for name in names:
            first.wait_for(f"{name} Running", lambda n=name: first.get_json("pod", n)["status"].get(
                "phase") == "Running", timeout=180)
        running_s = time.monotonic() - began
        first.wait_for("the domain Ready", lambda: (first.get_json("computedomain", DOMAIN).get("status") or {}).get(
            "status") == "Ready", timeout=60)
        ready_s = time.monotonic() - began
        placed = sorted(first.get_json("pod", n)["spec"]["nodeName"] for n in names)
        kubelet_ms = {}
        for node in rack:
            total, count = _kubelet_prepare(first, node.node_name)
            t0, c0 = before[node.node_name]
            if count > c0:
                kubelet_ms[node.node_name] = round(1000 * (total - t0) / (count - c0), 1)
        return {"nodes": args.nodes, "machines": [nodes.machines[n.node_name] for n in rack],
                "rack_nodes": len(rack), "switch_to_imex_ready_s": round(switched_s, 1),
                "agent_restart_to_imex_ready_s": round(restart_s, 1),
                "domain_to_template_s": round(template_s, 1), "domain_to_pods_running_s": round(running_s, 1),
                "domain_to_ready_s": round(ready_s, 1), "pods_on": placed,
                "kubelet_channel_prepare_ms_mean": kubelet_ms}


async def channel_prepare(claims: int) -> list[float]:
    """NodePrepareResources of channel-0 over the driver's socket, ``claims`` times (private apiserver)."""
    import grpc

    from nodeagent.dra import DRIVER_NAME
    from nodeagent.dra.api import v1_pb2, v1_pb2_grpc
    from nodeagent.dra.channels import CHANNEL_CLASS, CHANNEL_DEVICE, CONFIG_API_VERSION, CONFIG_KIND
    from nodeagent.dra.component import DraComponent
    from nodeagent.gpu.inventory import Fabric
    from nodeagent.hostpaths import HostPaths
    from nodeagent.kube.client import KubeClient, connect
    from tests.peers.apiserver import start_apiserver
    from tests.unit._dp_inventories import nvswitch_box

    server = start_apiserver()
    root = Path(tempfile.mkdtemp(prefix="rackb-", dir="/tmp"))  # socket paths stay under 108 bytes
    (root / "proc").mkdir()
    (root / "proc/devices").write_text("Character devices:\n511 nvidia-caps-imex-channels\n")
    kube = KubeClient(connect(server.kubeconfig))
    node = "bench-racks"
    fabric = Fabric(state=3, status=0, cluster_uuid="7b968a6d-c8aa-45e1-9e07-e1e51be99c31", clique_id=1,
                    health_mask=None, health_summary=1)
    box = nvswitch_box(4)
    inv = dataclasses.replace(box, gpus=tuple(dataclasses.replace(g, fabric=fabric) for g in box.gpus))
    dra = DraComponent(paths=HostPaths(root), kube=kube, node_name=node, verify_interval_s=60)
    base = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
    out: list[float] = []
    try:
        await dra.start(inv)
        await dra.wait_published()
        with grpc.insecure_channel(f"unix://{dra.server.dra_path if dra.server else ''}") as ch:
            stub = v1_pb2_grpc.DRAPluginStub(ch)
            for i in range(claims):
                name = f"channel-{i}"
                created = await asyncio.to_thread(kube.request, "POST", base, body={
                    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
                    "spec": {"devices": {"requests": [{"name": "channel",
                                                       "exactly": {"deviceClassName": CHANNEL_CLASS}}]}}})
                created["status"] = {"allocation": {"devices": {
                    "results": [{"request": "channel", "driver": DRIVER_NAME, "pool": node, "device": CHANNEL_DEVICE}],
                    "config": [{"source": "FromClaim", "requests": ["channel"], "opaque": {
                        "driver": DRIVER_NAME, "parameters": {
                            "apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "domainID": str(uuid.uuid4()),
                            "allocationMode": "Single"}}}]}},
                    "reservedFor": [{"resource": "pods", "name": f"worker-{i}", "uid": str(uuid.uuid4())}]}
                await asyncio.to_thread(kube.request, "PUT", f"{base}/{name}/status", body=created)
                uid = created["metadata"]["uid"]
                req = v1_pb2.NodePrepareResourcesRequest(
                    claims=[v1_pb2.Claim(namespace="default", uid=uid, name=name)])
                t0 = time.perf_counter()
                resp = await asyncio.to_thread(stub.NodePrepareResources, req)
                out.append((time.perf_counter() - t0) * 1000)
                assert resp.claims[uid].error == "", resp.claims[uid].error
                assert [d.device_name for d in resp.claims[uid].devices] == [CHANNEL_DEVICE]
                await asyncio.to_thread(stub.NodeUnprepareResources,
                                        v1_pb2.NodeUnprepareResourcesRequest(claims=req.claims))
    finally:
        await dra.stop()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3, choices=range(3, len(MACHINES) + 1),
                        help="cluster nodes (the rack is nodes 2 and 3 whatever the count)")
    parser.add_argument("--claims", type=int, default=60, help="channel claims prepared in-process")
    args = parser.parse_args()
    prepare_ms = asyncio.run(channel_prepare(args.claims))
    figures = cluster_figures(args)
    figures["channel_prepare_ms_p50"] = round(statistics.median(prepare_ms), 2)
    figures["channel_prepare_ms_p99"] = round(pct(prepare_ms, 0.99), 2)
    figures["channel_claims"] = len(prepare_ms)
    print(f"cluster of {figures['nodes']} nodes; the rack: {figures['rack_nodes']} nodes "
          f"({', '.join(figures['machines'])}; the other machines have no fabric cluster)")
    print(f"agents switched to [imex] (ConfigMap + {PATCH_FILE}) -> IMEX READY on the rack's nodes: "
          f"{figures['switch_to_imex_ready_s']} s")
    print(f"rack nodes' agent pods deleted (restart) -> IMEX READY again: {figures['agent_restart_to_imex_ready_s']} s")
    print(f"ComputeDomain created -> ResourceClaimTemplate {figures['domain_to_template_s']} s, "
          f"all {figures['rack_nodes']} pods Running {figures['domain_to_pods_running_s']} s (on "
          f"{', '.join(figures['pods_on'])}), domain Ready {figures['domain_to_ready_s']} s")
    print(f"channel prepare (NodePrepareResources over the driver's socket, in-process, {len(prepare_ms)} claims): "
          f"p50 {figures['channel_prepare_ms_p50']} ms, p99 {figures['channel_prepare_ms_p99']} ms; the real "
          f"kubelets' mean for the domain's pods: {figures['kubelet_channel_prepare_ms_mean'] or 'not reported'} ms")
    print(NVIDIA_STEPS)
    print(json.dumps({"bench": "racks", **figures}))


if __name__ == "__main__":
    main()
