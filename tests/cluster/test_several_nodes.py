"""The README's Kubernetes section on a cluster of several real nodes (tests/peers/multinode.py): one control
plane, each node its own kubelet, containerd, CNI network and simulated machine (MACHINES), the agent's
DaemonSet from the README's lines with every node labelled. Proven: every node Ready with its agent Running;
each agent publishes its own node's GPUs and labels and nothing of another node's; a pod on one node talks
TCP to a pod on another; a GPU pod placed on a chosen node gets that node's GPUs. Then NVLink racks on the same
cluster (docs/racks.md, docs/computedomains.md): two nodes of one clique, their host-managed IMEX daemons, a
ComputeDomain across them, a daemon killed, a fabric fault and a node removed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from nodeagent.simulator.machine import load_machine
from tests.cluster.test_whole_node import (
    RESOURCE,
    _gpu_pod,
    _packaged_configmap,
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


def restart_agents(first: Cluster, nodes: Sequence[Cluster], what: str,
                   ready: Callable[[Cluster], bool] = lambda _: True, timeout: float = 240) -> dict[str, dict[str, Any]]:
    """Delete the agent pod of each of ``nodes`` (the DaemonSet's new pod mounts its ConfigMap as it is now) and
    wait, node by node, for a new ready agent there and for ``ready(node)``; node name -> the new agent pod."""
    old = {n.node_name: _agent_on(first, n.node_name) for n in nodes}
    first.kubectl("delete", "pod", "-n", "nodeagent", "--wait=false",
                  *(p["metadata"]["name"] for p in old.values() if p is not None))

    def restarted(node: Cluster) -> dict[str, Any] | None:
        pod, before = _agent_on(first, node.node_name), old[node.node_name]
        if pod is None or (before is not None and pod["metadata"]["uid"] == before["metadata"]["uid"]):
            return None
        return pod if ready(node) else None

    return {n.node_name: first.wait_for(f"{n.node_name}: {what}", lambda n=n: restarted(n), timeout=timeout)
            for n in nodes}


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


# --- the fleet's disruption budget (docs/fleet.md) on two real nodes ---------------------------------------
# Nodes 1 and 4 (dgx-h100, hgx-h200: no rack) form one pool with one slot; both are relabelled with a MIG config
# in one kubectl command. Everything the run writes is watched (the fleet's Leases and the two Nodes through
# the API server's watch, each node's simulated GPUs sampled from its driver state file): the slot never has two
# holders, the GPUs of the second node change only after the first node's are done, and the second node says it
# waits (its state label pending, its GpuChangeSlot condition with the reason) until it holds the slot.

FLEET_NS = "nodeagent"
FLEET_POOL = "mig-pair"
FLEET_MIG = "all-balanced"  # generated for every MIG-capable model: 2 x 1g, 1 x 2g, 1 x 3g on each GPU
BALANCED_SIZES = [1, 1, 2, 4]  # the placements' sizes of those GPU instances (a 3g instance spans 4 slots)
MIG_CONFIG_LABEL, MIG_STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
HOLD_LABEL = "nodeagent.io/fleet-test"  # the pool's blockingPods: a pod labelled <this>=hold holds its node back


class _Watch:
    """``kubectl get ARGS --watch`` in the background: every version of the objects, in the API server's order,
    with the monotonic time it arrived."""

    def __init__(self, first: Cluster, *args: str) -> None:
        self.events: list[tuple[float, str, dict[str, Any]]] = []
        self.proc = subprocess.Popen(
            [str(first.kubectl_bin), f"--kubeconfig={first.apiserver.kubeconfig}", "get", *args, "--watch",
             "--output-watch-events", "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        decoder, text = json.JSONDecoder(), ""
        for line in self.proc.stdout:  # one JSON document per event (a line each, or indented over several)
            text += line
            while text.strip():
                try:
                    event, end = decoder.raw_decode(text.lstrip())
                except json.JSONDecodeError:
                    break  # the rest of the document is still to come
                text = text.lstrip()[end:]
                self.events.append((time.monotonic(), event["type"], event["object"]))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.thread.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _sim_store(node: Cluster, machine: str) -> Any:
    """The node's simulated GPUs as its driver stand-in holds them (``.read()["gpus"]``, re-read on change)."""
    from nodeagent.simulator.state import SimStore
    from tests.peers.cluster import SIM_STATE

    return SimStore.open(machine, node.host_path(SIM_STATE))


def _mig_changed(store: Any) -> int:
    """How many of the node's GPUs are in MIG mode."""
    return sum(1 for g in store.read()["gpus"] if g["mig_current"])


def _without_server_fields(obj: dict[str, Any]) -> dict[str, Any]:
    copy: dict[str, Any] = json.loads(json.dumps(obj))
    for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
        copy["metadata"].pop(key, None)
    return copy


def _sleeper_name(node: str) -> str:
    return f"fleet-gpu-{node}"


def _fleet_condition(obj: dict[str, Any]) -> dict[str, Any] | None:
    from nodeagent.fleet.report import CONDITION

    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == CONDITION), None)


@pytest.fixture
def fleet_budget(several_nodes: SeveralNodes, agents: dict[str, dict[str, Any]]) -> Iterator[list[Cluster]]:
    """The budget on for nodes 1 and 4: the fleet's Role (rbac-fleet.yaml), the pool's ConfigMap, ``[mig]
    fleet_namespace`` in the agents' ConfigMap and the two agents restarted with it. Afterwards: the budget gone
    (the agents then hold nothing back), MIG off on both nodes and their label removed, the agents' ConfigMap as
    it was (the Role stays: the agents still running read the budget until they restart)."""
    first = several_nodes.first
    pair = [several_nodes.nodes[0], several_nodes.nodes[-1]]
    names = [n.node_name for n in pair]
    before = first.get_json("configmap", "-n", FLEET_NS, "nodeagent-config")
    budget = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "nodeagent-fleet", "namespace": FLEET_NS},
              "data": {"budget.yaml": (f"leaseDurationSeconds: 15\npools:\n  - name: {FLEET_POOL}\n"
                                       f"    nodeSelector: \"kubernetes.io/hostname in ({','.join(names)})\"\n"
                                       f"    maxUnavailable: 1\n    blockingPods: {HOLD_LABEL}=hold\n")}}
    first.kubectl("apply", "-f", "packaging/kubernetes/rbac-fleet.yaml")
    first.kubectl("apply", "-f", "-", input_text=json.dumps(budget))
    configmap = _without_server_fields(before)
    configmap["data"]["config.toml"] += f'[mig]\nfleet_namespace = "{FLEET_NS}"\n'
    first.kubectl("apply", "-f", "-", input_text=json.dumps(configmap))
    restart_agents(first, pair, "the agent restarted with the fleet's budget, its GPUs allocatable",
                   lambda n: int(n.node()["status"].get("allocatable", {}).get(RESOURCE, "0")) == len(
                       load_machine(several_nodes.machines[n.node_name]).gpus), timeout=120)
    try:
        yield pair
    finally:
        first.kubectl("delete", "pod", *(_sleeper_name(n) for n in names), "fleet-hold", "--ignore-not-found",
                      "--wait=false")
        first.kubectl("delete", "configmap", "-n", FLEET_NS, "nodeagent-fleet", "--ignore-not-found")
        first.kubectl("label", "node", *names, f"{MIG_CONFIG_LABEL}=all-disabled", "--overwrite")
        for node in pair:
            machine = several_nodes.machines[node.node_name]
            store, want = _sim_store(node, machine), len(load_machine(machine).gpus)
            first.wait_for(f"{node.node_name}: MIG off again, allocatable {RESOURCE} {want}", lambda n=node, s=store,
                           w=want: _mig_changed(s) == 0 and _labels(n).get(MIG_STATE) == "success" and int(
                               n.node()["status"].get("allocatable", {}).get(RESOURCE, "0")) == w, timeout=120)
        first.kubectl("label", "node", *names, f"{MIG_CONFIG_LABEL}-")
        first.kubectl("delete", "lease", "-n", FLEET_NS, "-l", f"nodeagent.io/fleet-pool={FLEET_POOL}",
                      "--ignore-not-found")
        first.kubectl("apply", "-f", "-", input_text=json.dumps(_without_server_fields(before)))


def test_two_nodes_relabelled_at_once_change_one_after_the_other(several_nodes: SeveralNodes,
                                                                 fleet_budget: list[Cluster]) -> None:
    """Budget ``maxUnavailable: 1`` for a pool of two GPU nodes, both labelled ``nvidia.com/mig.config`` in one
    command: one node changes its GPUs while holding the pool's slot, the other waits (state pending, condition
    ``GpuChangeSlot`` False ``WaitingForSlot`` with the reason, one Event) and changes after the first gave the
    slot back; both end ``success`` with the config's layout on every GPU. Then back to MIG off with a pod of
    the pool's ``blockingPods`` selector running on the node that went first: it waits naming the pod (found
    through its node's container runtime: the agent's token may not list pods) while the other changes, and
    changes once the pod is gone."""
    first = several_nodes.first
    pair = fleet_budget
    names = [n.node_name for n in pair]
    machines = {n.node_name: several_nodes.machines[n.node_name] for n in pair}
    counts = {n: len(load_machine(m).gpus) for n, m in machines.items()}
    stores = {n.node_name: _sim_store(n, machines[n.node_name]) for n in pair}
    leases = _Watch(first, "leases", "-n", FLEET_NS, "-l", f"nodeagent.io/fleet-pool={FLEET_POOL}")
    nodes = _Watch(first, "nodes", "-l", f"kubernetes.io/hostname in ({','.join(names)})")
    samples: list[tuple[float, dict[str, int]]] = []  # (time, node -> GPUs in MIG mode)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.monotonic(), {n: _mig_changed(s) for n, s in stores.items()}))
            stop.wait(0.1)

    # one GPU of each node held by a pod: the node holding the slot changes its other GPUs and keeps the slot
    # until its pod is gone, so the other node is seen waiting however fast the simulated GPUs change
    sleepers = {n: _sleeper_name(n) for n in names}
    for n, pod in sleepers.items():
        first.kubectl("apply", "-f", "-", input_text=json.dumps(_gpu_pod(pod, 1, "sleep 600", {
            "nodeSelector": {"kubernetes.io/hostname": n}, "terminationGracePeriodSeconds": 0})))
    for pod in sleepers.values():
        first.wait_for(f"{pod} Running", lambda p=pod: first.get_json("pod", p)["status"].get("phase") == "Running",
                       timeout=60)

    def holder() -> str:
        slots = {o["metadata"]["name"]: o["spec"].get("holderIdentity") or "" for _, _, o in leases.events
                 if o["metadata"]["labels"].get("nodeagent.io/fleet-role") == "slot"}
        return ",".join(sorted(h for h in slots.values() if h))

    def waiting(node: Cluster) -> bool:
        obj = node.node()
        condition = _fleet_condition(obj)
        return (condition is not None and condition["reason"] == "WaitingForSlot"
                and obj["metadata"]["labels"].get(MIG_STATE) == "pending")

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.monotonic()
    try:
        first.kubectl("label", "node", *names, f"{MIG_CONFIG_LABEL}={FLEET_MIG}", "--overwrite")
        head = first.wait_for("one node holding the slot, the other waiting for it", lambda: (
            lambda h: h if h in names and waiting(pair[1 - names.index(h)]) else "")(holder()), timeout=60, poll=0.3)
        other = names[1 - names.index(head)]
        first.wait_for(f"{head}: its free GPUs changed", lambda: _mig_changed(stores[head]) == counts[head] - 1,
                       timeout=60, poll=0.3)
        assert _mig_changed(stores[other]) == 0 and waiting(pair[names.index(other)])
        contended = time.monotonic()
        first.kubectl("delete", "pod", sleepers[head], "--wait=false")
        for n in (head, other):
            first.wait_for(f"{n}: {MIG_STATE}=success", lambda n=n: _labels(pair[names.index(n)]).get(MIG_STATE)
                           == "success" and _mig_changed(stores[n]) == counts[n], timeout=90, poll=0.3)
            if n == head:
                first.kubectl("delete", "pod", sleepers[other], "--wait=false")
        done = time.monotonic()
    except AssertionError:
        _agent_logs(first, pair)
        print(first.kubectl("get", "leases", "-n", FLEET_NS, "-o", "yaml", check=False).stdout)
        raise
    finally:
        stop.set()
        sampler.join(timeout=5)
    try:  # the watch delivers the second node's release (and its condition Done) soon after
        first.wait_for("the second release seen by the watch", lambda: [
            o["spec"].get("holderIdentity") or "" for _, _, o in leases.events
            if o["metadata"]["labels"].get("nodeagent.io/fleet-role") == "slot"].count("") >= 2, timeout=20, poll=0.2)
    except AssertionError:
        print(json.dumps([(round(at - began, 2), kind, o["metadata"]["name"], o["spec"].get("holderIdentity"))
                          for at, kind, o in leases.events]))
        _agent_logs(first, pair)
        raise
    finally:
        leases.stop()
        nodes.stop()

    # the slot Leases as the API server stored them: never two live holders, one node after the other
    holders: dict[str, str] = {}
    held_at: list[tuple[float, str]] = []  # (time, holder) each time the set of holders changed
    most = 0
    for at, _, obj in leases.events:
        if obj["metadata"]["labels"].get("nodeagent.io/fleet-role") != "slot":
            continue
        holders[obj["metadata"]["name"]] = obj["spec"].get("holderIdentity") or ""
        live = sorted(h for h in holders.values() if h)
        most = max(most, len(live))
        if not held_at or held_at[-1][1] != ",".join(live):
            held_at.append((at, ",".join(live)))
    order = [h for _, h in held_at if h]
    assert most == 1, held_at
    assert sorted(order) == sorted(names) and len(order) == 2, held_at
    head, second = order
    # the GPUs: every GPU of the first node changed before the first GPU of the second
    head_done = min(t for t, s in samples if s[head] == counts[head])
    second_began = min(t for t, s in samples if s[second] > 0)
    assert head_done <= second_began, (head_done, second_began)
    assert not any(0 < s[head] < counts[head] and s[second] > 0 for _, s in samples)
    # in the watch: the first holder's release, then the second's take
    took = [h for _, h in held_at]
    assert took[took.index(head) + 1] == "" and took.index(second) > took.index(head) + 1, held_at
    second_took = held_at[took.index(second)][0]

    # the second node said it waited, while its state label said pending
    waited = [(at, obj["metadata"]["labels"].get(MIG_STATE), _fleet_condition(obj)) for at, _, obj in nodes.events
              if obj["metadata"]["name"] == second]
    saying = [(at, state, c) for at, state, c in waited if c is not None and c["reason"] == "WaitingForSlot"
              and c["status"] == "False" and c["message"].startswith("waiting: ")]
    assert saying and all(state == "pending" for _, state, _ in saying), waited
    assert FLEET_POOL in saying[0][2]["message"], saying[0][2]
    first.wait_for(f"{second}: GpuChangeSlot Done", lambda: (lambda c: c is not None and (
        c["status"], c["reason"]) == ("False", "Done"))(_fleet_condition(pair[names.index(second)].node())), timeout=20)
    events = first.get_json("events", "--field-selector", f"involvedObject.name={second},reason=GpuChangeWaiting")
    assert len(events["items"]) == 1, events["items"]

    # both nodes in the config's layout: every GPU in MIG mode with 2 x 1g, 1 x 2g, 1 x 3g instances
    for node in pair:
        assert _labels(node)[MIG_STATE] == "success"
        gpus = stores[node.node_name].read()["gpus"]
        assert all(g["mig_current"] and sorted(gi["size"] for gi in g["gis"]) == BALANCED_SIZES for g in gpus), (
            node.node_name, [(g["mig_current"], [gi["size"] for gi in g["gis"]]) for g in gpus])

    # back to MIG off, a pod of the blocking selector running on the node that went first
    hold = _pod("fleet-hold", head, AGENT_IMAGE, "sleep 600")
    hold["metadata"]["labels"] = {HOLD_LABEL: "hold"}
    first.kubectl("apply", "-f", "-", input_text=json.dumps(hold))
    head_node, second_node = pair[names.index(head)], pair[names.index(second)]
    try:
        first.wait_for("the blocking pod Running", lambda: first.get_json("pod", "fleet-hold")["status"].get(
            "phase") == "Running", timeout=60)
        back = time.monotonic()
        first.kubectl("label", "node", *names, f"{MIG_CONFIG_LABEL}=all-disabled", "--overwrite")
        first.wait_for(f"{second}: MIG off", lambda: _mig_changed(stores[second]) == 0 and _labels(
            second_node).get(MIG_STATE) == "success", timeout=90)
        blocked = _fleet_condition(head_node.node())
        assert blocked is not None and blocked["reason"] == "WaitingForSlot" and blocked["message"] == (
            "waiting: pods blocking changes run on this node (default/fleet-hold)"), blocked
        assert _labels(head_node)[MIG_STATE] == "pending" and _mig_changed(stores[head]) == counts[head]
    except AssertionError:
        _agent_logs(first, pair)
        raise
    finally:
        first.kubectl("delete", "pod", "fleet-hold", "--wait=false")
    first.wait_for(f"{head}: MIG off once the blocking pod is gone", lambda: _mig_changed(stores[head]) == 0
                   and _labels(head_node).get(MIG_STATE) == "success", timeout=90)
    print(json.dumps({"fleet_order": order, "fleet_relabel_to_both_done_s": round(done - began, 1),
                      "fleet_seen_contending_s": round(contended - began, 1),
                      "fleet_first_done_s": round(head_done - began, 1),
                      "fleet_second_took_slot_s": round(second_took - began, 1),
                      "fleet_second_waiting_reason": saying[0][2]["message"][:160],
                      "fleet_most_holders": most, "fleet_gpu_samples": len(samples),
                      "fleet_back_with_a_blocking_pod_s": round(time.monotonic() - back, 1),
                      "fleet_blocked_reason": blocked["message"]}))


# --- NVLink racks: the clique, the host-managed IMEX daemon, a ComputeDomain across two nodes ---------------
# Nodes 2 and 3 (gb200-nvl, gb300-nvl: compute trays of an NVL72) are placed by the simulator in one rack and
# clique; node 1 (dgx-h100) and node 4 (hgx-h200) have no fabric cluster. The agents switch to the DRA plane with
# [imex] through the DaemonSet's ConfigMap; NVIDIA's ComputeDomain CRD and the controller's manifest as
# docs/computedomains.md installs them.

RACK, CLIQUE_ID = "rack-a", 3
CLIQUE_LABEL = "nvidia.com/gpu.clique"
IMEX_READY = "nodeagent.io/imex.ready"
NODES_FILE = "/host/etc/nvidia-imex/nodes_config.cfg"  # the agent's view of the node's /etc/nvidia-imex
DOMAIN, TEMPLATE = "imex-job", "imex-job-channel"
IMEX_CONFIG = '[device_plugin]\nplane = "dra"\n[imex]\nenabled = true\n'
CHANNELS = "/dev/nvidia-caps-imex-channels"
RESYNC_S = 5


def _sim(node: Cluster, machine: str, *args: str) -> str:
    """``nodeagent sim ...`` on the node's own state file (the one its stand-in driver library works on)."""
    from tests.peers.cluster import SIM_STATE

    return subprocess.run([sys.executable, "-m", "nodeagent", "sim", *args, "--simulate", machine,
                           "--sim-state", str(node.host_path(SIM_STATE))],
                          check=True, capture_output=True, text=True, timeout=60).stdout


def _rack_nodes(several_nodes: SeveralNodes) -> list[Cluster]:
    return [n for n in several_nodes.nodes if load_machine(several_nodes.machines[n.node_name]).rack_nodes]


def _labels(node: Cluster) -> dict[str, str]:
    labels: dict[str, str] = node.node()["metadata"]["labels"]
    return labels


def _netns(proc: Path) -> str | None:
    try:
        return os.readlink(proc / "ns" / "net")
    except OSError:
        return None


def _imex_daemons(several_nodes: SeveralNodes, node: Cluster) -> list[int]:
    """The pids of the IMEX stand-in daemons in the node's network namespace (the agent's pod is on it)."""
    found = []
    if node is several_nodes.first:  # the host's own network
        own = os.readlink("/proc/self/ns/net")
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                and _netns(p) == own]
    else:
        pids = several_nodes._spaces[node.node_name].members()
    for pid in pids:
        with contextlib.suppress(OSError):
            if b"nodeagent.simulator.imex_daemon" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                found.append(pid)
    return found


def _in_agent(first: Cluster, node: Cluster, *command: str) -> str:
    """What ``command`` prints in the node's ready agent ("" while there is none or when it fails)."""
    pod = _agent_on(first, node.node_name)
    if pod is None:
        return ""
    proc = first.kubectl("exec", "-n", "nodeagent", pod["metadata"]["name"], "-c", "nodeagent", "--", *command,
                         check=False)
    return str(proc.stdout) if proc.returncode == 0 else ""


def _agent_logs(first: Cluster, nodes: list[Cluster]) -> None:
    """The agents' log tails (printed when a wait on them failed)."""
    for node in nodes:
        pod = _agent_on(first, node.node_name)
        if pod is not None:
            print(f"--- agent on {node.node_name}\n" + first.kubectl(
                "logs", "-n", "nodeagent", pod["metadata"]["name"], "-c", "nodeagent", "--tail=60",
                check=False).stdout)


def _imex_ok(first: Cluster, node: Cluster, clique: str, peers: set[str]) -> bool:
    labels = _labels(node)
    if labels.get(CLIQUE_LABEL) != clique or labels.get(IMEX_READY) != "true":
        return False
    listed = {line.strip() for line in _in_agent(first, node, "cat", NODES_FILE).splitlines()
              if line.strip() and not line.startswith("#")}
    return listed == peers


def _internal_ip(node: Cluster) -> str:
    return str(next(a["address"] for a in node.node()["status"]["addresses"] if a["type"] == "InternalIP"))


@pytest.fixture(scope="module")
def imex_plane(several_nodes: SeveralNodes, agents: dict[str, dict[str, Any]]) -> Iterator[tuple[str, float]]:
    """Nodes 2 and 3 in one rack and clique; every agent restarted on the DRA plane with [imex] (the pod on the
    node's network: the daemon binds to the node's InternalIP); the CRD and the controller. (the clique, the
    seconds from the agents' restart to IMEX READY on both nodes)"""
    first = several_nodes.first
    rack = _rack_nodes(several_nodes)
    assert len(rack) == 2, [n.node_name for n in rack]
    for slot, node in enumerate(rack, start=1):
        out = _sim(node, several_nodes.machines[node.node_name], "fabric", "--rack", RACK, "--node", str(slot),
                   "--clique", str(CLIQUE_ID))
        assert f"node {slot}, clique {CLIQUE_ID}" in out, out
    from tests.integration._computedomain import CRD_NAME, crd_file

    first.kubectl("apply", "-f", str(crd_file()))
    first.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    first.kubectl("apply", "-f", "packaging/kubernetes/rbac-dra.yaml")
    configmap = _packaged_configmap()
    # a short resync: the peers of a node's daemon and its clique label (a fabric change is no NVML event) follow
    # the Nodes and the fabric at each rediscovery
    configmap["data"]["config.toml"] = f"resync_interval = {RESYNC_S}\n" + configmap["data"]["config.toml"] + IMEX_CONFIG
    first.kubectl("apply", "-f", "-", input_text=json.dumps(configmap))
    began = time.monotonic()
    # every node's agent replaced at once (test speed only: the template does not change, no rollout), then what
    # [imex] asks of the DaemonSet, by the packaged patch file and the kubectl line of docs/racks.md
    first.kubectl("patch", "daemonset", "-n", "nodeagent", "nodeagent", "--type", "merge", "-p", json.dumps(
        {"spec": {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}}}}))
    first.kubectl("patch", "daemonset", "-n", "nodeagent", "nodeagent", "--patch-file",
                  "packaging/kubernetes/daemonset-imex.patch.yaml")
    first.kubectl("apply", "-f", "packaging/kubernetes/computedomain-controller.yaml")
    from nodeagent.simulator.nvml_fabric import cluster_uuid

    clique = f"{cluster_uuid(RACK)}.{CLIQUE_ID}"  # the rack's cluster UUID and the clique, as GFD writes it
    peers = {_internal_ip(n) for n in rack}
    try:
        for node in rack:
            first.wait_for(f"{node.node_name}: the clique label {clique}",
                           lambda n=node: _labels(n).get(CLIQUE_LABEL) == clique, timeout=240)
        for node in rack:
            first.wait_for(f"{node.node_name}: IMEX READY with both nodes in its nodes file",
                           lambda n=node: _imex_ok(first, n, clique, peers), timeout=120)
    except AssertionError:
        _agent_logs(first, several_nodes.nodes)
        raise
    yield clique, time.monotonic() - began
    first.kubectl("delete", "computedomain", DOMAIN, "--ignore-not-found", "--wait=false", check=False)


def test_same_clique_nodes_get_the_label_and_imex_ready(several_nodes: SeveralNodes,
                                                       imex_plane: tuple[str, float]) -> None:
    clique, took = imex_plane
    rack = _rack_nodes(several_nodes)
    peers = {_internal_ip(n) for n in rack}
    assert len(peers) == 2, peers
    for node in several_nodes.nodes:
        labels = _labels(node)
        if node in rack:
            assert labels[CLIQUE_LABEL] == clique and labels[IMEX_READY] == "true", labels
            assert _imex_ok(several_nodes.first, node, clique, peers)
            conditions = {c["type"]: c for c in node.node()["status"]["conditions"]}
            assert conditions["nodeagent.io/IMEXReady"]["status"] == "True", conditions
            assert len(_imex_daemons(several_nodes, node)) == 1, node.node_name
        else:  # no fabric cluster: no label, no daemon
            assert CLIQUE_LABEL not in labels and not _imex_daemons(several_nodes, node), (node.node_name, labels)
    print(json.dumps({"agents_restarted_to_imex_ready_s": round(took, 1)}))


def _domain_pod(name: str) -> dict[str, Any]:
    """NVIDIA's pattern: a pod of the domain takes a claim from the domain's template and runs its worker."""
    pod = _pod(name, "", AGENT_IMAGE, f"ls -1 {CHANNELS}; sleep 600")
    del pod["spec"]["nodeName"]
    pod["spec"]["resourceClaims"] = [{"name": "imex", "resourceClaimTemplateName": TEMPLATE}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "imex"}]}
    return pod


def test_compute_domain_across_two_nodes(several_nodes: SeveralNodes, imex_plane: tuple[str, float]) -> None:
    """A ComputeDomain of two nodes, two pods: each lands on one of the clique's nodes and sees channel 0 and no
    other IMEX channel; the domain Ready with both nodes. Then the IMEX daemon killed on one node is started
    again (a new pid, READY again); a fabric fault on the other withdraws its clique label and stops its daemon,
    so the domain becomes NotReady and the first daemon's nodes file shrinks to itself (no restart); a new pod
    of the domain then lands on the first node, never on the faulty one."""
    first = several_nodes.first
    clique, _ = imex_plane
    rack = _rack_nodes(several_nodes)
    began = time.monotonic()
    domain = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
              "metadata": {"name": DOMAIN, "namespace": "default"},
              "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": TEMPLATE}}}}
    first.kubectl("apply", "-f", "-", input_text=json.dumps(domain))
    first.wait_for("the domain's ResourceClaimTemplate", lambda: first.kubectl(
        "get", "resourceclaimtemplate", TEMPLATE, check=False).returncode == 0, timeout=60)
    names = ("imex-worker-0", "imex-worker-1")
    try:
        for name in names:
            first.kubectl("apply", "-f", "-", input_text=json.dumps(_domain_pod(name)))
        pods = {name: first.wait_for(f"{name} Running", lambda n=name: (
            lambda p: p if p["status"].get("phase") == "Running" else None)(first.get_json("pod", n)), timeout=120)
            for name in names}
        assert {p["spec"]["nodeName"] for p in pods.values()} == {n.node_name for n in rack}, pods
        for name in names:
            log = first.wait_for(f"{name}'s listing", lambda n=name: first.kubectl("logs", n).stdout.strip(),
                                 timeout=30)
            assert log.splitlines() == ["channel0"], (name, log)
        status = first.wait_for("the domain Ready with both nodes", lambda: (
            lambda s: s if s.get("status") == "Ready" else None)(
            first.get_json("computedomain", DOMAIN).get("status") or {}), timeout=60)
        assert {n["name"] for n in status["nodes"]} == {n.node_name for n in rack}, status
        assert all(n["status"] == "Ready" and n["cliqueID"] == clique for n in status["nodes"]), status
        print(json.dumps({"computedomain_created_to_ready_s": round(time.monotonic() - began, 1)}))

        # the daemon killed on one node: the agent starts it again, READY again with both nodes
        victim = rack[0]
        (old,) = _imex_daemons(several_nodes, victim)
        os.kill(old, signal.SIGKILL)
        peers = {_internal_ip(n) for n in rack}
        new = first.wait_for(f"{victim.node_name}: a new IMEX daemon", lambda: [
            p for p in _imex_daemons(several_nodes, victim) if p != old], timeout=60)
        assert len(new) == 1, new
        first.wait_for(f"{victim.node_name}: IMEX READY again", lambda: _imex_ok(first, victim, clique, peers)
                       and _in_agent(first, victim, "/host/usr/bin/nvidia-imex-ctl", "-c", "/host/etc/nvidia-imex/config.cfg",
                                     "-q").strip() == "READY", timeout=60)
        # the node reported the domain NotReady while its daemon was down: Ready again once it answers READY
        first.wait_for("the domain Ready again", lambda: (first.get_json("computedomain", DOMAIN).get(
            "status") or {}).get("status") == "Ready", timeout=30)

        # a fabric fault on the other node while the pods run: its clique label is withdrawn at the agent's next
        # rediscovery, its daemon stopped, so it reports the domain NotReady: the domain is NotReady
        faulty = rack[1]
        _sim(faulty, several_nodes.machines[faulty.node_name], "inject", "fabric", "--state", "not-started")
        first.wait_for(f"{faulty.node_name}: the clique label withdrawn",
                       lambda: CLIQUE_LABEL not in _labels(faulty), timeout=60)
        first.wait_for(f"{faulty.node_name}: NVLinkCliqueReady False, FabricNotStarted", lambda: any(
            c["type"] == "nodeagent.io/NVLinkCliqueReady" and c["status"] == "False"
            and c["reason"] == "FabricNotStarted" for c in faulty.node()["status"]["conditions"]), timeout=30)
        first.wait_for(f"{faulty.node_name}: no IMEX daemon without a clique",
                       lambda: not _imex_daemons(several_nodes, faulty), timeout=30)
        status = first.wait_for(f"the domain NotReady, {faulty.node_name} NotReady in it", lambda: (
            lambda s: s if s.get("status") == "NotReady" and {n["name"]: n["status"] for n in s["nodes"]} == {
                rack[0].node_name: "Ready", faulty.node_name: "NotReady"} else None)(
            first.get_json("computedomain", DOMAIN).get("status") or {}), timeout=60)
        # the other node keeps its clique; its daemon's nodes file shrinks to itself (read again, not restarted)
        assert _labels(rack[0])[CLIQUE_LABEL] == clique
        first.wait_for(f"{rack[0].node_name}: its daemon's nodes file without {faulty.node_name}",
                       lambda: _imex_ok(first, rack[0], clique, {_internal_ip(rack[0])}), timeout=60)
        assert _imex_daemons(several_nodes, rack[0]) == new, "the daemon was restarted for a membership change"
    except AssertionError:
        _agent_logs(first, rack)
        print(first.kubectl("get", "pods,resourceclaims,resourceslices,computedomains", "-A", "-o", "wide",
                            check=False).stdout)
        print(first.kubectl("logs", "-n", "nodeagent", "deployment/nodeagent-controller", "--tail=40",
                            check=False).stdout)
        raise
    finally:
        first.kubectl("delete", "pod", *names, "--ignore-not-found", "--wait=false", check=False)

    # a new pod of the domain does not land on the node out of the clique: it takes the channel of the other
    # one once the first pods are gone
    try:
        first.kubectl("apply", "-f", "-", input_text=json.dumps(_domain_pod("imex-worker-2")))
        late = first.wait_for("imex-worker-2 Running", lambda: (
            lambda p: p if p["status"].get("phase") == "Running" else None)(first.get_json("pod", "imex-worker-2")),
            timeout=90)
        assert late["spec"]["nodeName"] == rack[0].node_name, late["spec"]
    finally:
        first.kubectl("delete", "pod", "imex-worker-2", "--ignore-not-found", "--wait=false", check=False)


def test_a_node_removed_leaves_the_domain(several_nodes: SeveralNodes, imex_plane: tuple[str, float]) -> None:
    """Node 3 healed back into the clique and the domain's two pods running again on nodes 2 and 3, the domain
    Ready; then node 3 removed from the cluster (its kubelet, containerd, agent and pods gone, its Node deleted):
    the domain NotReady with node 2 alone, node 2's daemon's nodes file shrinks to itself without a restart.
    (Last in the module: the cluster has three nodes after it.)"""
    first = several_nodes.first
    clique, _ = imex_plane
    rack = _rack_nodes(several_nodes)
    stays, gone = rack
    _sim(gone, several_nodes.machines[gone.node_name], "inject", "fabric", "--heal")
    peers = {_internal_ip(n) for n in rack}
    for node in rack:
        first.wait_for(f"{node.node_name}: IMEX READY with both nodes again",
                       lambda n=node: _imex_ok(first, n, clique, peers), timeout=60)
    names = ("imex-worker-3", "imex-worker-4")
    try:
        for name in names:
            first.kubectl("apply", "-f", "-", input_text=json.dumps(_domain_pod(name)))
        for name in names:
            first.wait_for(f"{name} Running", lambda n=name: first.get_json("pod", n)["status"].get(
                "phase") == "Running", timeout=120)
        first.wait_for("the domain Ready with both nodes", lambda: (
            lambda s: s.get("status") == "Ready" and {n["name"] for n in s.get("nodes", [])} == {
                n.node_name for n in rack})(first.get_json("computedomain", DOMAIN).get("status") or {}), timeout=60)
        (daemon,) = _imex_daemons(several_nodes, stays)
        assert several_nodes.remove(gone.node_name) == []
        first.wait_for(f"the domain NotReady with {stays.node_name} alone", lambda: (
            lambda s: s.get("status") == "NotReady" and [n["name"] for n in s.get("nodes", [])] == [
                stays.node_name])(first.get_json("computedomain", DOMAIN).get("status") or {}), timeout=60)
        first.wait_for(f"{stays.node_name}: its daemon's nodes file without {gone.node_name}",
                       lambda: _imex_ok(first, stays, clique, {_internal_ip(stays)}), timeout=60)
        assert _imex_daemons(several_nodes, stays) == [daemon], "the daemon was restarted for a membership change"
    except AssertionError:
        _agent_logs(first, [stays])
        print(first.kubectl("get", "pods,resourceclaims,computedomains", "-A", "-o", "wide", check=False).stdout)
        raise
    finally:
        first.kubectl("delete", "pod", *names, "--ignore-not-found", "--wait=false", check=False)
