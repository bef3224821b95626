"""``nodeagent doctor`` findings the other doctor tests do not reach, each on a simulated node that has it: a
recovery the driver asks for after an XID, processes on a GPU, the agent running or not with its last
bootstrap, a kubelet that is not running or has nothing registered, and the agent's Node conditions."""

from __future__ import annotations

import json
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.simulator.inject import set_recovery_action
from nodeagent.simulator.machine import load_machine
from nodeagent.simulator.state import SimStore
from tests.e2e.test_doctor import _doctor, _na, _one
from tests.peers.apiserver import KubeApiServer
from tests.peers.hostlock import host_owned


@pytest.fixture
def root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="nadoc-", dir="/tmp") as d:  # short: sockets live below it
        yield Path(d) / "node"


def test_recovery_action_and_processes(root: Path) -> None:
    state = root / "a100.json"  # the simulated node's state, inside its root
    sim = ["--simulate", "dgx-a100-80gb", "--sim-state", str(state)]
    assert (
        _na(
            root, "sim", "inject", "process", *sim, "--gpu", "1", "--pid", "4242", "--name", "train.py"
        ).returncode
        == 0
    )
    store = SimStore(load_machine("dgx-a100-80gb"), state)
    set_recovery_action(store, 2, 1)  # the driver asks for a GPU reset (after an XID)
    set_recovery_action(store, 5, 2)  # ... and a node reboot
    code, findings = _doctor(root, *sim)
    assert code == 2
    reset = _one(findings, "health", "error", "GPU 2: the driver asks for a recovery: GPU reset")
    assert reset["fix"] == "drain the node, then nvidia-smi -r -i 2"
    reboot = _one(findings, "health", "error", "GPU 5: the driver asks for a recovery: node reboot")
    assert reboot["fix"] == "drain the node, then reboot it"
    _one(findings, "gpus", "ok", "GPU 1: 1 process(es): 4242 (train.py)")
    set_recovery_action(store, 2, 0)
    set_recovery_action(store, 5, 0)
    code, findings = _doctor(root, *sim)
    _one(findings, "health", "ok", "every GPU answers NVML, no recovery asked for")


def test_agent_and_kubelet_states(root: Path) -> None:
    sim = ["--simulate", "t4x1"]
    plugins = root / "var/lib/kubelet/device-plugins"
    plugins.mkdir(parents=True)
    (root / "proc/1").mkdir(parents=True)
    (root / "proc/1/cmdline").write_bytes(b"/sbin/init\0")
    code, findings = _doctor(root, *sim)
    _one(
        findings,
        "kubelet",
        "warning",
        "no /var/lib/kubelet/device-plugins/kubelet.sock: the kubelet is not running",
    )
    agent = _one(findings, "agent", "warning", "nodeagent run is not running on this host")
    assert agent["fix"] == f"nodeagent --root {root} run --simulate t4x1 --no-kube"

    kubelet = socket.socket(socket.AF_UNIX)
    kubelet.bind(str(plugins / "kubelet.sock"))
    (root / "proc/777").mkdir()
    (root / "proc/777/cmdline").write_bytes(b"/usr/bin/python3\0/usr/bin/nodeagent\0run\0")
    (root / "proc/777/cgroup").write_text("0::/system.slice/nodeagent.service\n")
    (root / "run/nodeagent").mkdir(parents=True)
    (root / "run/nodeagent/bootstrap.json").write_text(
        json.dumps(
            {
                "exit_code": 1,
                "steps": [{"step": "mig", "result": "ok"}, {"step": "runtime", "result": "failed"}],
            }
        )
    )
    try:
        code, findings = _doctor(root, *sim)
    finally:
        kubelet.close()
    assert code == 1  # warnings only
    none = _one(findings, "kubelet", "warning", "the kubelet has no GPU resource registered")
    assert none["fix"] == f"nodeagent --root {root} run --simulate t4x1 --no-kube"
    _one(findings, "agent", "ok", "nodeagent run is running (pid 777) in unit nodeagent.service")
    # the DaemonSet's container instead (cgroup v2, systemd driver): named by its pod's UID
    (root / "proc/777/cgroup").write_text(
        "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f5e8a3c_2b1d_4e6f_9a7b_"
        "3c2d1e0f9a8b.slice/cri-containerd-51e0.scope\n"
    )
    code, findings = _doctor(root, *sim)
    _one(
        findings,
        "agent",
        "ok",
        "nodeagent run is running (pid 777) in pod 0f5e8a3c-2b1d-4e6f-9a7b-3c2d1e0f9a8b",
    )
    last = _one(findings, "agent", "warning", "last bootstrap: exit 1, failed: runtime")
    assert last["fix"] == f"nodeagent --root {root} bootstrap --simulate t4x1 --no-kube --output {root}/run/nodeagent/bootstrap.json"


def test_the_agents_node_conditions_and_an_unreachable_api(root: Path, kube_apiserver: KubeApiServer) -> None:
    node = "doctor-conditions"
    kube_apiserver.request("DELETE", f"/api/v1/nodes/{node}")
    status, body = kube_apiserver.request(
        "POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
    )
    assert status == 201, body
    cond = {
        "type": "nodeagent.io/GPUHealthy",
        "status": "False",
        "reason": "XidError",
        "message": "1 of 1 GPU(s) unhealthy: GPU 0: XID 48, recovery: none",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
        "lastHeartbeatTime": "2026-01-01T00:00:00Z",
    }
    status, body = kube_apiserver.request(
        "PATCH",
        f"/api/v1/nodes/{node}/status",
        {
            "status": {
                "conditions": [cond],
                "capacity": {"nvidia.com/gpu": "1"},
                "allocatable": {"nvidia.com/gpu": "0"},
            }
        },
        content_type="application/strategic-merge-patch+json",
    )
    assert status == 200, body
    try:
        r = _na(
            root,
            "doctor",
            "--simulate",
            "t4x1",
            "--kubeconfig",
            str(kube_apiserver.kubeconfig),
            "--node-name",
            node,
            "--json",
        )
        findings = json.loads(r.stdout)["findings"]
        _one(
            findings,
            "node",
            "warning",
            "nodeagent.io/GPUHealthy False: XidError 1 of 1 GPU(s) unhealthy: GPU 0: XID 48",
        )
        _one(findings, "node", "warning", "nvidia.com/gpu: 0 of 1 device(s) healthy at the kubelet")
    finally:
        kube_apiserver.request("DELETE", f"/api/v1/nodes/{node}")
    bad = root.parent / "bad-kubeconfig"
    bad.write_text(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:1'}\n"
        "users:\n- name: u\n  user: {token: x}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\n"
        "current-context: x\n"
    )
    r = _na(root, "doctor", "--simulate", "t4x1", "--kubeconfig", str(bad), "--node-name", node, "--json")
    _one(json.loads(r.stdout)["findings"], "node", "error", f"Node {node} cannot be read")


def test_no_driver(root: Path) -> None:
    """Without the NVIDIA driver (this machine has none; the simulator not asked for): NVML is an error with
    what to do, and the checks that need no GPU still run."""
    root.mkdir(parents=True)
    # the whole-node cluster installs a driver library on this host while it runs: wait until no test does
    with host_owned("a host without an NVIDIA driver"):
        code, findings = _doctor(root)
    assert code == 2
    nvml = _one(findings, "driver", "error", "NVML cannot be used")
    assert (
        nvml["fix"]
        == f"install or load the NVIDIA driver, or try nodeagent --root {root} doctor --simulate dgx-h100 --no-kube"
    )
    assert {f["area"] for f in findings} >= {"driver", "containerd", "kubelet", "node", "agent"}
