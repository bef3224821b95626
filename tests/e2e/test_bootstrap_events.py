"""``nodeagent bootstrap`` records the runtime step on the Node (real process, real kube-apiserver): a Normal
RuntimeConfigured Event when it wired containerd, a Warning RuntimeConfigureFailed Event when it could not,
none when nothing changed or the Node is not registered yet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_bootstrap_node import bootstrap, results
from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers


def node_events(server: KubeApiServer, node: str) -> list[tuple[str, str, str]]:
    status, body = server.get(f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{node}")
    assert status == 200, body
    return [(e["reason"], e["type"], e["message"]) for e in json.loads(body)["items"]
            if e["reason"].startswith("Runtime")]


def test_runtime_events_on_the_node(tmp_path: Path, kube_apiserver: KubeApiServer) -> None:
    node = "bootstrap-events-node"
    kube_apiserver.request("DELETE", f"/api/v1/nodes/{node}")
    status, body = kube_apiserver.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                                    "metadata": {"name": node}})
    assert status == 201, body
    root = tmp_path / "r"
    root.mkdir()
    args = ["--root", str(root), "bootstrap", "--simulate", "t4x1", "--sim-state", str(root / "sim.json"),
            "--kubeconfig", str(kube_apiserver.kubeconfig), "--node-name", node]
    try:
        code, report, err = bootstrap(*args)
        assert code == 0, err
        assert results(report)["runtime"] == "changed" and report["events"] == ["RuntimeConfigured"]
        ((reason, type_, message),) = node_events(kube_apiserver, node)
        assert (reason, type_) == ("RuntimeConfigured", "Normal")
        assert message.startswith("containerd wired for the NVIDIA runtime: wrote "), message
        assert "containerd not restarted (restart disabled" in message, message

        code, report, err = bootstrap(*args)  # nothing to do: no second Event
        assert code == 0 and "events" not in report, err
        assert len(node_events(kube_apiserver, node)) == 1

        # a containerd config that is not TOML: the step fails (nothing written) and the Node says so
        cfg = root / "etc/containerd/config.toml"
        cfg.write_text("version = 2\n[plugins\n")
        code, report, err = bootstrap(*args)
        assert code != 0 and results(report)["runtime"] == "failed", err
        assert report["events"] == ["RuntimeConfigureFailed"]
        failed = [e for e in node_events(kube_apiserver, node) if e[0] == "RuntimeConfigureFailed"]
        assert len(failed) == 1 and failed[0][1] == "Warning", failed
        assert failed[0][2].startswith("containerd NVIDIA runtime wiring failed: ") and "config.toml" in failed[0][2]
        assert cfg.read_text() == "version = 2\n[plugins\n"
    finally:
        kube_apiserver.request("DELETE", f"/api/v1/nodes/{node}")


def test_no_event_for_a_node_not_registered_yet(tmp_path: Path, kube_apiserver: KubeApiServer) -> None:
    root = tmp_path / "r"
    root.mkdir()
    code, report, err = bootstrap("--root", str(root), "bootstrap", "--simulate", "t4x1", "--kubeconfig",
                                  str(kube_apiserver.kubeconfig), "--node-name", "events-not-yet-registered")
    assert code == 0, err
    assert results(report)["runtime"] == "changed" and "events" not in report
    assert "could not record event" not in err and "no runtime event" not in err, err
