"""``nodeagent run`` against the real kube-apiserver and the real kubelet device manager: labels published,
a MIG label change reaching ``success`` end to end, an API outage the device plugin does not notice, and
SIGTERM leaving the labels in place."""

from __future__ import annotations

import json
import signal
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent.kube.resources import GPU_MEMORY
from tests.e2e._agent import node_root, running_agent
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


def cdi_names(root: Path) -> set[str]:
    spec = yaml.safe_load((root / "var/run/cdi/nvidia.yaml").read_text())
    return {d["name"] for d in spec["devices"]}


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


def agent_config(root: Path, kubeconfig: Path, extra: str = "") -> Path:
    """The agent's config file under ``root`` (its paths are host paths; the kubeconfig is never re-rooted)."""
    etc = root / "etc/nodeagent"
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "dp.yaml").write_text(MIXED)
    cfg = etc / "config.toml"
    cfg.write_text(f'kubeconfig = "{kubeconfig}"\nresync_interval = 2.0\n'
                   '[device_plugin]\nconfig = "/etc/nodeagent/dp.yaml"\n'
                   f'[runtime]\nenabled = false\n{extra}')
    return cfg


def proxied_kubeconfig(server: KubeApiServer, outage: Outage, dest: Path) -> Path:
    doc = yaml.safe_load(server.kubeconfig.read_text())
    url = urllib.parse.urlsplit(server.url)
    for c in doc["clusters"]:
        c["cluster"]["server"] = f"https://{url.hostname}:{outage.port}"
    dest.write_text(yaml.safe_dump(doc))
    return dest


@pytest.fixture
def root(kubelet_harness: KubeletHarness) -> Iterator[Path]:
    """The agent's --root, its kubelet paths pointing at the harness."""
    with node_root(kubelet_harness) as path:
        yield path


def test_labels_mig_change_to_success_and_labels_survive_stop(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness, root: Path
) -> None:
    node = "e2e-run-mig"
    make_node(kube_apiserver, node)
    cfg = agent_config(root, kube_apiserver.kubeconfig)
    args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", str(root / "sim.json"),
            "--node-name", node]
    with running_agent(tmp_path, root, args) as agent:
        agent.wait_notify("READY=1", timeout=20)
        kubelet_harness.wait("nvidia.com/gpu", registered=True, total=8)
        assert {str(g) for g in range(8)} | {"all"} <= cdi_names(root)  # written before the plugin served
        assert not any(":" in n for n in cdi_names(root))
        eventually(lambda: node_obj(kube_apiserver, node)["metadata"].get("labels", {}).get("nvidia.com/gpu.count")
                   == "8", 15, "gpu.count label")
        set_label(kube_apiserver, node, "nvidia.com/mig.config", "all-1g.10gb")
        def state() -> str | None:
            found: str | None = node_obj(kube_apiserver, node)["metadata"]["labels"].get("nvidia.com/mig.config.state")
            return found

        eventually(lambda: state() == "success", 60, "mig.config.state=success")
        _, res = kubelet_harness.wait("nvidia.com/mig-1g.10gb", registered=True, total=56, timeout=20)
        assert len(res.devices) == 56
        # the CDI spec named the new MIG devices before they were advertised, and no longer the whole GPUs'
        # MIG-less layout: every name the kubelet can now be handed resolves
        assert {f"{g}:{n}" for g in range(8) for n in range(7)} <= cdi_names(root)
        eventually(lambda: node_obj(kube_apiserver, node)["metadata"]["labels"].get("nvidia.com/mig-1g.10gb.count")
                   == "56", 15, "mig-1g.10gb.count label")
        before = node_obj(kube_apiserver, node)["metadata"]["labels"]
        code, took = agent.stop(signal.SIGTERM)
        assert code == 0 and took < 5.0, agent.log()
    labels = node_obj(kube_apiserver, node)["metadata"]["labels"]
    assert labels["nvidia.com/mig.config.state"] == "success"
    assert labels == before  # stopping leaves the labels as they are


OUTAGE_S = 60.0  # issue 8's drill: the API server unreachable for a full minute


def _agent_behind_outage(
    tmp_path: Path, kube_apiserver: KubeApiServer, root: Path, node: str
) -> tuple[Outage, list[str]]:
    """Register ``node``; return the (open) loopback forwarder to the apiserver and the ``run`` arguments of
    an agent on a simulated DGX H100 that reaches the API only through it."""
    make_node(kube_apiserver, node)
    url = urllib.parse.urlsplit(kube_apiserver.url)
    outage = Outage((url.hostname or "127.0.0.1", url.port or 443))
    outage.restore()
    kubeconfig = proxied_kubeconfig(kube_apiserver, outage, tmp_path / "kubeconfig")
    cfg = agent_config(root, kubeconfig)
    return outage, ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state",
                    str(root / "sim.json"), "--node-name", node]


def test_api_outage_device_plugin_keeps_serving_and_labels_catch_up(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness, root: Path
) -> None:
    """The agent reaches the API only through a loopback forwarder; cutting it refuses every connection, as a
    stopped apiserver process would (the session's apiserver itself keeps serving the other tests). For 60 s
    the device plugin must keep serving: the kubelet allocates every few seconds and restarts once. Behind
    the agent's back a label is removed, an extended resource is dropped from the node status and a MIG
    config is requested; once the API answers again all three are caught up."""
    node = "e2e-run-outage"
    outage, args = _agent_behind_outage(tmp_path, kube_apiserver, root, node)

    def labels() -> dict[str, str]:
        found: dict[str, str] = node_obj(kube_apiserver, node)["metadata"].get("labels", {})
        return found

    def capacity() -> dict[str, str]:
        found: dict[str, str] = node_obj(kube_apiserver, node).get("status", {}).get("capacity", {})
        return found

    try:
        with running_agent(tmp_path, root, args) as agent:
            agent.wait_notify("READY=1", timeout=20)
            eventually(lambda: labels().get("nvidia.com/gpu.count") == "8" and GPU_MEMORY in capacity(), 15,
                       "gpu.count label and gpu-memory capacity")
            memory = capacity()[GPU_MEMORY]
            fds0, threads0 = agent.fds(), agent.threads()
            outage.cut()
            t_cut = time.monotonic()
            # behind the agent's back: a label removed, a status value dropped, a MIG config requested
            set_label(kube_apiserver, node, "nvidia.com/gpu.count", None)
            status, body = kube_apiserver.request(
                "PATCH", f"/api/v1/nodes/{node}/status",
                {"status": {"capacity": {GPU_MEMORY: None}, "allocatable": {GPU_MEMORY: None}}},
                content_type="application/merge-patch+json")
            assert status == 200, body
            set_label(kube_apiserver, node, "nvidia.com/mig.config", "all-1g.10gb")
            allocations = 0
            while time.monotonic() - t_cut < OUTAGE_S:
                if allocations == 4:  # the kubelet restarts in the middle of the outage
                    restart_and_wait_registration(kubelet_harness, "nvidia.com/gpu")
                res = kubelet_harness.resource("nvidia.com/gpu")
                assert res.registered and res.capacity == 8, res
                alloc = kubelet_harness.allocate("nvidia.com/gpu", 2, pod=f"during-outage-{allocations}")
                assert len(alloc.device_ids) == 2
                kubelet_harness.release(alloc.pod_uid)
                allocations += 1
                assert agent.proc.poll() is None, agent.log()
                time.sleep(min(5.0, max(0.0, OUTAGE_S - (time.monotonic() - t_cut))))
            assert allocations >= 12
            assert capacity().get(GPU_MEMORY) is None and "nvidia.com/gpu.count" not in labels()  # not reachable
            outage.restore()
            t_back = time.monotonic()
            eventually(lambda: labels().get("nvidia.com/gpu.count") == "8", 30, "gpu.count label re-applied")
            labels_s = time.monotonic() - t_back
            eventually(lambda: capacity().get(GPU_MEMORY) == memory, 30, "gpu-memory capacity re-applied")
            status_s = time.monotonic() - t_back
            eventually(lambda: labels().get("nvidia.com/mig.config.state") == "success", 60,
                       "mig.config.state=success for the config requested during the outage")
            state_s = time.monotonic() - t_back
            _, res = kubelet_harness.wait("nvidia.com/mig-1g.10gb", registered=True, total=56, timeout=20)
            alloc = kubelet_harness.allocate("nvidia.com/mig-1g.10gb", 1, pod="after-outage")
            assert len(alloc.device_ids) == 1
            kubelet_harness.release(alloc.pod_uid)
            print(f"{OUTAGE_S:.0f}s API outage, {allocations} allocations during it; caught up after the API came "
                  f"back: labels {labels_s:.1f}s, status {status_s:.1f}s, MIG state {state_s:.1f}s; "
                  f"fds {fds0}->{agent.fds()}, threads {threads0}->{agent.threads()}")
            assert "Traceback" not in agent.log()  # nothing crashed through the outage
            code, took = agent.stop(signal.SIGTERM)
            assert code == 0 and took < 5.0, agent.log()
    finally:
        outage.cut()


def test_sigterm_during_api_outage_still_exits_within_5s(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness, root: Path
) -> None:
    node = "e2e-run-outage-stop"
    outage, args = _agent_behind_outage(tmp_path, kube_apiserver, root, node)
    try:
        with running_agent(tmp_path, root, args) as agent:
            agent.wait_notify("READY=1", timeout=20)
            time.sleep(1)
            outage.cut()
            time.sleep(2.5)  # a resync is now blocked on the unreachable API
            code, took = agent.stop(signal.SIGTERM)
            assert code == 0 and took < 5.0, agent.log()
            assert not list(kubelet_harness.plugin_dir.glob("nvidia-*.sock"))
    finally:
        outage.cut()
