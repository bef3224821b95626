"""``nodeagent adopt`` against a real kube-apiserver: the GPU Operator's operands are switched off on the
node through its own nvidia.com/gpu.deploy.* labels, the command waits until their pods are gone (deleted
here by hand, as the operator's DaemonSet controller does), a running GPU pod is left alone; --release
switches back exactly what was switched off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers
REPO = Path(__file__).resolve().parents[2]
NS = "gpu-operator"


def _ok(result: tuple[int, Any], *codes: int) -> Any:
    status, body = result
    assert status in (codes or (200, 201)), body
    return body


def _pod(server: KubeApiServer, ns: str, name: str, node: str, app: str) -> None:
    _ok(
        server.request(
            "POST",
            f"/api/v1/namespaces/{ns}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "labels": {"app": app}},
                "spec": {
                    "nodeName": node,
                    "automountServiceAccountToken": False,
                    "containers": [{"name": "c", "image": "registry.invalid/x:1"}],
                },
            },
        )
    )


def _labels(server: KubeApiServer, node: str) -> dict[str, str]:
    status, body = server.get(f"/api/v1/nodes/{node}")
    assert status == 200, body
    return dict(json.loads(body)["metadata"].get("labels") or {})


def _adopt(server: KubeApiServer, node: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "KUBECONFIG"))}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "nodeagent",
            "adopt",
            "--node-name",
            node,
            "--kubeconfig",
            str(server.kubeconfig),
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_hand_over_and_release(kube_apiserver: KubeApiServer) -> None:
    server, node = kube_apiserver, "adopt-node"
    server.request("DELETE", f"/api/v1/nodes/{node}")
    operator_labels = {
        f"nvidia.com/gpu.deploy.{op}": "true"
        for op in (
            "driver",
            "device-plugin",
            "gpu-feature-discovery",
            "mig-manager",
            "container-toolkit",
            "dcgm-exporter",
        )
    }
    _ok(
        server.request(
            "POST",
            "/api/v1/nodes",
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": operator_labels}},
        )
    )
    for ns in (NS, "ml"):
        server.request(
            "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
        )
        server.request(
            "POST",
            f"/api/v1/namespaces/{ns}/serviceaccounts",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}},
        )
    operand_pods = {
        "nvidia-device-plugin-daemonset-x1": "nvidia-device-plugin-daemonset",
        "gpu-feature-discovery-x1": "gpu-feature-discovery",
        "nvidia-dcgm-exporter-x1": "nvidia-dcgm-exporter",
    }
    for name, app in operand_pods.items():
        _pod(server, NS, name, node, app)
    _pod(server, "ml", "train-0", node, "train")  # a running GPU workload
    try:
        done: list[subprocess.CompletedProcess[str]] = []
        runner = threading.Thread(target=lambda: done.append(_adopt(server, node, "--timeout", "60")))
        runner.start()
        deadline = time.monotonic() + 30
        while _labels(server, node).get("nvidia.com/gpu.deploy.device-plugin") != "false":
            assert time.monotonic() < deadline, _labels(server, node)
            time.sleep(0.2)
        labels = _labels(server, node)
        assert labels["nvidia.com/gpu.deploy.driver"] == "true"  # the driver stays NVIDIA's
        assert labels["nvidia.com/gpu.deploy.dcgm-exporter"] == "true"  # not asked for
        assert runner.is_alive()  # waiting for the operand pods to leave
        for name in ("nvidia-device-plugin-daemonset-x1", "gpu-feature-discovery-x1"):
            _ok(server.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}?gracePeriodSeconds=0"))
        runner.join(60)
        (result,) = done
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert out["labels"] == {
            f"nvidia.com/gpu.deploy.{op}": "false"
            for op in ("container-toolkit", "device-plugin", "gpu-feature-discovery", "mig-manager")
        }, out
        assert out["pods_left"] == []
        assert server.get("/api/v1/namespaces/ml/pods/train-0")[0] == 200  # the GPU pod is untouched

        again = _adopt(server, node, "--timeout", "5")  # nothing left to switch: at once, no change
        assert again.returncode == 0 and json.loads(again.stdout)["labels"] == {}, again.stderr

        back = _adopt(server, node, "--release")
        assert back.returncode == 0, back.stderr
        labels = _labels(server, node)
        assert {k: v for k, v in labels.items() if k.startswith("nvidia.com/gpu.deploy.")} == operator_labels
        body = _ok(server.get(f"/api/v1/nodes/{node}"), 200)
        assert "nodeagent.io/handed-over" not in (json.loads(body)["metadata"].get("annotations") or {})
    finally:
        for name in operand_pods:
            server.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}?gracePeriodSeconds=0")
        server.request("DELETE", "/api/v1/namespaces/ml/pods/train-0?gracePeriodSeconds=0")
        server.request("DELETE", f"/api/v1/nodes/{node}")


def test_pods_that_stay_are_named_after_the_timeout(kube_apiserver: KubeApiServer) -> None:
    server, node = kube_apiserver, "adopt-stuck"
    server.request("DELETE", f"/api/v1/nodes/{node}")
    _ok(
        server.request(
            "POST",
            "/api/v1/nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": node, "labels": {"nvidia.com/gpu.deploy.device-plugin": "true"}},
            },
        )
    )
    server.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    )
    server.request(
        "POST",
        f"/api/v1/namespaces/{NS}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}},
    )
    _pod(server, NS, "nvidia-device-plugin-daemonset-y1", node, "nvidia-device-plugin-daemonset")
    try:
        r = _adopt(server, node, "--timeout", "2")
        assert r.returncode == 1, r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        assert f"{NS}/nvidia-device-plugin-daemonset-y1 are still on the node after 2s" in r.stderr, r.stderr
    finally:
        server.request(
            "DELETE", f"/api/v1/namespaces/{NS}/pods/nvidia-device-plugin-daemonset-y1?gracePeriodSeconds=0"
        )
        server.request("DELETE", f"/api/v1/nodes/{node}")
