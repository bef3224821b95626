"""``nodeagent run`` against the real kube-apiserver and the real kubelet device manager: labels published,
a MIG label change reaching ``success`` end to end, an API outage the device plugin does not notice, and
SIGTERM leaving the labels in place."""

from __future__ import annotations

import json
import signal
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e._agent import running_agent
from tests.e2e._proxy import Outage
from tests.e2e.test_run import restart_and_wait_registration
from tests.peers.apiserver import KubeApiServer
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

MIXED = "version: v1\nflags:\n  migStrategy: mixed\n"


def node_obj(server: KubeApiServer, name: str) -> dict[str, Any]:
    status, body = server.get(f"/api/v1/nodes/{name}")
    assert status == 200, body
    doc: dict[str, Any] = json.loads(body)
    return doc


def make_node(server: KubeApiServer, name: str) -> None:
    server.request("DELETE", f"/api/v1/nodes/{name}")
    status, body = server.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                            "metadata": {"name": name}})
    assert status == 201, body


def set_label(server: KubeApiServer, name: str, key: str, value: str | None) -> None:
    status, body = server.request("PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": {key: value}}},
                                  content_type="application/merge-patch+json")
    assert status == 200, body


def eventually(cond: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout}s")


def agent_config(tmp_path: Path, kubeconfig: Path, extra: str = "") -> Path:
    dp = tmp_path / "dp.yaml"
    dp.write_text(MIXED)
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'kubeconfig = "{kubeconfig}"\nresync_interval = 2.0\n[device_plugin]\nconfig = "{dp}"\n'
                   f'[runtime]\nenabled = false\n{extra}')
    return cfg


def proxied_kubeconfig(server: KubeApiServer, outage: Outage, dest: Path) -> Path:
    doc = yaml.safe_load(server.kubeconfig.read_text())
    url = urllib.parse.urlsplit(server.url)
    for c in doc["clusters"]:
        c["cluster"]["server"] = f"https://{url.hostname}:{outage.port}"
    dest.write_text(yaml.safe_dump(doc))
    return dest


def test_labels_mig_change_to_success_and_labels_survive_stop(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    node = "e2e-run-mig"
    make_node(kube_apiserver, node)
    cfg = agent_config(tmp_path, kube_apiserver.kubeconfig)
    args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", str(tmp_path / "sim.json"),
            "--node-name", node, "--kubelet-dir", str(kubelet_harness.plugin_dir.parent)]
    with running_agent(tmp_path, args) as agent:
        agent.wait_notify("READY=1", timeout=20)
        kubelet_harness.wait("nvidia.com/gpu", registered=True, total=8)
        eventually(lambda: node_obj(kube_apiserver, node)["metadata"].get("labels", {}).get("nvidia.com/gpu.count")
                   == "8", 15, "gpu.count label")
        set_label(kube_apiserver, node, "nvidia.com/mig.config", "all-1g.10gb")
        state = lambda: node_obj(kube_apiserver, node)["metadata"]["labels"].get("nvidia.com/mig.config.state")  # noqa: E731
        eventually(lambda: state() == "success", 60, "mig.config.state=success")
        _, res = kubelet_harness.wait("nvidia.com/mig-1g.10gb", registered=True, total=56, timeout=20)
        assert len(res.devices) == 56
        eventually(lambda: node_obj(kube_apiserver, node)["metadata"]["labels"].get("nvidia.com/mig-1g.10gb.count")
                   == "56", 15, "mig-1g.10gb.count label")
        before = node_obj(kube_apiserver, node)["metadata"]["labels"]
        code, took = agent.stop(signal.SIGTERM)
        assert code == 0 and took < 5.0, agent.log()
    labels = node_obj(kube_apiserver, node)["metadata"]["labels"]
    assert labels["nvidia.com/mig.config.state"] == "success"
    assert labels == before  # stopping leaves the labels as they are


def test_api_outage_device_plugin_keeps_serving_and_labels_catch_up(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    node = "e2e-run-outage"
    make_node(kube_apiserver, node)
    url = urllib.parse.urlsplit(kube_apiserver.url)
    outage = Outage((url.hostname or "127.0.0.1", url.port or 443))
    outage.restore()
    kubeconfig = proxied_kubeconfig(kube_apiserver, outage, tmp_path / "kubeconfig")
    cfg = agent_config(tmp_path, kubeconfig)
    args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", str(tmp_path / "sim.json"),
            "--node-name", node, "--kubelet-dir", str(kubelet_harness.plugin_dir.parent)]
    try:
        with running_agent(tmp_path, args) as agent:
            agent.wait_notify("READY=1", timeout=20)
            count = lambda: node_obj(kube_apiserver, node)["metadata"].get("labels", {}).get("nvidia.com/gpu.count")  # noqa: E731
            eventually(lambda: count() == "8", 15, "gpu.count label")
            outage.cut()
            # while the agent cannot reach the API: somebody removes a label, and the kubelet restarts
            set_label(kube_apiserver, node, "nvidia.com/gpu.count", None)
            time.sleep(3)
            restart_and_wait_registration(kubelet_harness, "nvidia.com/gpu")
            kubelet_harness.wait("nvidia.com/gpu", registered=True, healthy=8, timeout=15)
            alloc = kubelet_harness.allocate("nvidia.com/gpu", 2, pod="during-outage")
            assert len(alloc.device_ids) == 2
            assert agent.proc.poll() is None
            outage.restore()
            took = eventually(lambda: count() == "8", 30, "gpu.count label re-applied after the outage")
            print(f"labels caught up {took:.1f}s after the API came back")
            assert "Traceback" not in agent.log()  # nothing crashed through the outage
            code, took = agent.stop(signal.SIGTERM)
            assert code == 0 and took < 5.0, agent.log()
    finally:
        outage.cut()


def test_sigterm_during_api_outage_still_exits_within_5s(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    node = "e2e-run-outage-stop"
    make_node(kube_apiserver, node)
    url = urllib.parse.urlsplit(kube_apiserver.url)
    outage = Outage((url.hostname or "127.0.0.1", url.port or 443))
    outage.restore()
    kubeconfig = proxied_kubeconfig(kube_apiserver, outage, tmp_path / "kubeconfig")
    cfg = agent_config(tmp_path, kubeconfig)
    args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", str(tmp_path / "sim.json"),
            "--node-name", node, "--kubelet-dir", str(kubelet_harness.plugin_dir.parent)]
    try:
        with running_agent(tmp_path, args) as agent:
            agent.wait_notify("READY=1", timeout=20)
            time.sleep(1)
            outage.cut()
            time.sleep(2.5)  # a resync is now blocked on the unreachable API
            code, took = agent.stop(signal.SIGTERM)
            assert code == 0 and took < 5.0, agent.log()
            assert not list(kubelet_harness.plugin_dir.glob("nvidia-*.sock"))
    finally:
        outage.cut()
