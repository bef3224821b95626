"""The README's Kubernetes section on a cluster of several real nodes (tests/peers/multinode.py): one control
plane, each node its own kubelet, containerd, CNI network and simulated machine (MACHINES), the agent's
DaemonSet from the README's lines with every node labelled. Proven: every node Ready with its agent Running;
each agent publishes its own node's GPUs and labels and nothing of another node's; a pod on one node talks
TCP to a pod on another; a GPU pod placed on a chosen node gets that node's GPUs."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from nodeagent.simulator.machine import load_machine
from tests.cluster.test_whole_node import (
    RESOURCE,
    _gpu_pod,
    imported_registry,
    readme_args,
    readme_manifest_commands,
    run_pod,
)
from tests.peers.cluster import Cluster, node_ready
from tests.peers.multinode import SeveralNodes

pytestmark = pytest.mark.timeout(900)

CLUSTER_NODES = 4
AGENT_IMAGE = "docker.io/library/nodeagent:0.1.0"
PYTHON = "/opt/nodeagent/bin/python"  # the agent image's interpreter
PORT = 8080


def _machine_uuids(machine: str) -> set[str]:
    return {g.uuid for g in load_machine(machine).gpus}


def _agent_on(first: Cluster, node: str) -> dict[str, Any] | None:
    for pod in first.get_json("pods", "-n", "nodeagent", "-l", "app.kubernetes.io/name=nodeagent",
                              "--field-selector", f"spec.nodeName={node}")["items"]:
        statuses = pod.get("status", {}).get("containerStatuses", [])
        if pod["metadata"].get("deletionTimestamp") is None and statuses and all(s.get("ready") for s in statuses):
            result: dict[str, Any] = pod
            return result
    return None


def deploy_agents(several_nodes: SeveralNodes) -> dict[str, dict[str, Any]]:
    """The README's "Without Helm" lines run once, their ``kubectl label node`` line for every node; each node's
    agent Running and ready with its node's GPUs allocatable. Node name -> its agent pod."""
    first = several_nodes.first
    registry = imported_registry(first)
    for command in readme_manifest_commands():
        for node in several_nodes.nodes if command[:3] == ["kubectl", "label", "node"] else [first]:
            first.kubectl(*readme_args(command, node, registry))
    pods = {}
    for node in several_nodes.nodes:
        want = len(load_machine(several_nodes.machines[node.node_name]).gpus)
        pods[node.node_name] = first.wait_for(f"the agent Running and ready on {node.node_name}",
                                              lambda n=node.node_name: _agent_on(first, n), timeout=240)
        first.wait_for(f"{node.node_name}: allocatable {RESOURCE} {want}", lambda n=node, want=want: int(
            n.node()["status"].get("allocatable", {}).get(RESOURCE, "0")) == want, timeout=90)
    return pods


@pytest.fixture(scope="module")
def agents(several_nodes: SeveralNodes) -> Iterator[dict[str, dict[str, Any]]]:
    yield deploy_agents(several_nodes)
    # what each further node cost while the agents ran (its kubelet, containerd, shims and containers)
    hz = os.sysconf("SC_CLK_TCK")
    for node in several_nodes.others:
        rss, ticks = several_nodes.usage(node.node_name)
        print(json.dumps({"node": node.node_name, "machine": several_nodes.machines[node.node_name],
                          "start_s": round(several_nodes.started[node.node_name], 1), "rss_mib": rss // 1024,
                          "cpu_s": round(ticks / hz, 1)}))


def test_every_node_ready_with_its_agent(several_nodes: SeveralNodes, agents: dict[str, dict[str, Any]]) -> None:
    names = {n["metadata"]["name"] for n in several_nodes.first.get_json("nodes")["items"]}
    assert names == {n.node_name for n in several_nodes.nodes}, names
    for node in several_nodes.nodes:
        assert node_ready(node), node.node_name
        pod = agents[node.node_name]
        assert pod["spec"]["nodeName"] == node.node_name
        assert pod["status"]["phase"] == "Running", pod["status"]
        # each node's kubelet registered the node's own address: distinct addresses, the further nodes' in
        # their own network namespaces
        addresses = {a["type"]: a["address"] for a in node.node()["status"]["addresses"]}
        assert addresses["InternalIP"] == (node.node_ip or node.host_ip), addresses
    ips = [a["address"] for n in several_nodes.nodes for a in n.node()["status"]["addresses"]
           if a["type"] == "InternalIP"]
    assert len(set(ips)) == len(several_nodes.nodes), ips


def test_each_agent_publishes_only_its_own_node(several_nodes: SeveralNodes, agents: dict[str, dict[str, Any]]) -> None:
    first = several_nodes.first
    gpus = first.get_json("gpus")["items"]
    products = {name: load_machine(m).gpus[0].name.split()[-1] for name, m in several_nodes.machines.items()}
    assert len(set(products.values())) == len(products), products  # the machines differ by their model
    for node in several_nodes.nodes:
        machine = several_nodes.machines[node.node_name]
        uuids = _machine_uuids(machine)
        own = {g["spec"]["uuid"] for g in gpus if g["spec"]["nodeName"] == node.node_name}
        assert own == uuids, (node.node_name, machine, own)
        obj = node.node()
        labels = obj["metadata"]["labels"]
        assert labels["nvidia.com/gpu.count"] == str(len(uuids)), labels
        product = labels["nvidia.com/gpu.product"]
        assert products[node.node_name] in product, (node.node_name, product)
        assert not any(p in product for n, p in products.items() if n != node.node_name), (node.node_name, product)
        assert obj["status"]["capacity"][RESOURCE] == str(len(uuids))
    # one GPU object per card of the cluster: none written twice, none for a card of another node
    assert len(gpus) == sum(len(_machine_uuids(m)) for m in several_nodes.machines.values()), len(gpus)


def _pod(name: str, node: str, image: str, command: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": node, "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                                     "command": ["/bin/sh", "-c", command]}]}}


SERVER = (f"{PYTHON} -c \"import socket, os\n"
          f"s = socket.create_server(('0.0.0.0', {PORT}))\n"
          "while True:\n"
          "    c, peer = s.accept()\n"
          "    c.sendall(('hello from ' + os.environ['HOSTNAME'] + ' to ' + c.recv(100).decode()).encode())\n"
          "    c.close()\"")


def test_pods_on_different_nodes_talk_tcp(several_nodes: SeveralNodes, agents: dict[str, dict[str, Any]]) -> None:
    """A server pod on node 2 (in its own network namespace) answers clients on the first node (the host's
    network) and on the last node: pod to pod, across the nodes' links and the host's routes."""
    first = several_nodes.first
    server_node = several_nodes.others[0].node_name
    first.kubectl("apply", "-f", "-", input_text=json.dumps(_pod("tcp-server", server_node, AGENT_IMAGE, SERVER)))
    server = first.wait_for("the server pod Running with an address", lambda: (
        lambda p: p if p["status"].get("phase") == "Running" and p["status"].get("podIP") else None)(
        first.get_json("pod", "tcp-server")), timeout=90)
    ip = server["status"]["podIP"]
    assert ip.startswith("10.244.78."), ip  # node 2's pod network
    clients = {several_nodes.first.node_name, several_nodes.nodes[-1].node_name}
    try:
        for client_node in sorted(clients):
            name = f"tcp-client-{client_node.rsplit('-', 1)[-1]}"
            client = (f"{PYTHON} -c \"import socket\n"
                      f"c = socket.create_connection(('{ip}', {PORT}), timeout=20)\n"
                      f"c.sendall(b'{client_node}')\n"
                      "print(c.recv(200).decode())\"")
            obj, log = run_pod(first, _pod(name, client_node, AGENT_IMAGE, client))
            assert obj["status"]["phase"] == "Succeeded", (obj["status"], log)
            assert log.strip() == f"hello from tcp-server to {client_node}", log
            assert obj["spec"]["nodeName"] == client_node
            first.kubectl("delete", "pod", name, "--wait=false")
    finally:
        first.kubectl("delete", "pod", "tcp-server", "--wait=false", check=False)


def test_gpu_pod_on_a_chosen_node_gets_that_nodes_gpus(several_nodes: SeveralNodes,
                                                      agents: dict[str, dict[str, Any]]) -> None:
    """Two GPUs asked for by a pod the scheduler must place on the last node (by its hostname label): the
    kubelet's device plugin there hands over two of that node's GPUs, none of another node's."""
    first = several_nodes.first
    chosen = several_nodes.nodes[-1].node_name
    pod = _gpu_pod("gpus-on-chosen", 2, "echo $NVIDIA_VISIBLE_DEVICES",
                   {"nodeSelector": {"kubernetes.io/hostname": chosen}})
    obj, log = run_pod(first, pod)
    try:
        assert obj["status"]["phase"] == "Succeeded", (obj["status"], log)
        assert obj["spec"]["nodeName"] == chosen
        uuids = set(log.strip().split(","))
        assert len(uuids) == 2 and uuids <= _machine_uuids(several_nodes.machines[chosen]), (log, chosen)
        others = set().union(*(_machine_uuids(m) for n, m in several_nodes.machines.items() if n != chosen))
        assert not uuids & others, log
    finally:
        first.kubectl("delete", "pod", "gpus-on-chosen", "--wait=false", check=False)
