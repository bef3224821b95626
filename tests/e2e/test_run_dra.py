"""``nodeagent run`` with the DRA plane (``[device_plugin] plane``) against the real kube-apiserver: the node's
ResourceSlices appear, the device plugin serves only what DRA does not, and SIGHUP switches planes (the old
one withdrawn, the new one published). Each test runs once per Kubernetes release."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from nodeagent.dra.api import reg_pb2, reg_pb2_grpc
from nodeagent.dra.slices import UNHEALTHY_TAINT_KEY
from nodeagent.kube.client import KubeClient, connect
from tests.e2e._agent import ROOT, Agent, eventually, node_root, running_agent
from tests.e2e.test_run import plugin_sockets
from tests.e2e.test_run_cluster import make_node
from tests.integration._releases import shared_release_apiserver
from tests.peers.apiserver import KubeApiServer
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

release_server = shared_release_apiserver  # the API server of each release, shared with other modules

DRIVER = "gpu.nodeagent.io"


def slice_devices(server: KubeApiServer, node: str) -> dict[str, dict[str, Any]] | None:
    """Device name → device of every ResourceSlice of ``node`` (None when there is no slice)."""
    status, body = server.get(f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{node}")
    assert status == 200, body
    items = json.loads(body)["items"]
    if not items:
        return None
    assert {s["spec"]["driver"] for s in items} == {DRIVER}
    return {d["name"]: d for s in items for d in s["spec"].get("devices") or ()}


def slice_versions(server: KubeApiServer, node: str) -> dict[str, str]:
    status, body = server.get(f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{node}")
    assert status == 200, body
    return {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in json.loads(body)["items"]}


def config(path: Path, server: KubeApiServer, plane: str, gpus: str = "") -> Path:
    path.write_text(f'kubeconfig = "{server.kubeconfig}"\nresync_interval = 300.0\n'
                    "[runtime]\nenabled = false\n[mig]\nenabled = false\n"
                    "[publish]\nlabels = false\nextended_resources = false\ngpu_objects = false\nevents = false\n"
                    f'[device_plugin]\nplane = "{plane}"\n[dra]\nverify_interval = 5.0\n{gpus}')
    return path


def reload_and_wait(agent: Agent) -> None:
    seen = len(agent.poll_notify())
    agent.send(signal.SIGHUP)
    agent.wait_notify("RELOADING=1", after=seen)
    agent.wait_notify("READY=1", after=seen)


def dra_node(tmp_path: Path, server: KubeApiServer, node: str, plane: str, gpus: str = "") -> tuple[Path, list[str]]:
    """Node ``node`` created anew, a config with ``plane`` written in ``tmp_path``; the config's path and the
    arguments of ``nodeagent run`` on the simulated dgx-h100 (its state in the agent's root) as that node."""
    make_node(server, node)
    cfg = config(tmp_path / "config.toml", server, plane, gpus)
    return cfg, ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", f"{ROOT}/sim.json",
                 "--node-name", node]


def remove_node(server: KubeApiServer, node: str) -> None:
    """The node's ResourceSlices and the Node itself deleted."""
    kube = KubeClient(connect(server.kubeconfig))
    try:
        for s in kube.list_resource_slices(field_selector=f"spec.nodeName={node}"):
            server.request("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{s['metadata']['name']}")
    finally:
        kube.close()
    server.request("DELETE", f"/api/v1/nodes/{node}")


def uuid_of(device: dict[str, Any]) -> str:
    return str(device["attributes"]["uuid"]["string"])


def test_plane_dra_publishes_resource_slices_and_serves_no_device_plugin_socket(
    tmp_path: Path, release_server: KubeApiServer
) -> None:
    kube_apiserver = release_server
    node = "e2e-dra-only"
    cfg, args = dra_node(tmp_path, kube_apiserver, node, "dra")
    try:
        with node_root() as root, running_agent(tmp_path, root, args) as agent:
            agent.wait_notify("READY=1", timeout=20)
            devices = eventually(lambda: slice_devices(kube_apiserver, node), 20, "ResourceSlices of the node")
            assert sorted(devices) == [f"gpu-{i}" for i in range(8)], sorted(devices)
            kubelet = root / "var/lib/kubelet"
            assert (kubelet / f"plugins_registry/{DRIVER}-reg.sock").is_socket()
            assert (kubelet / f"plugins/{DRIVER}/dra.sock").is_socket()
            # the kubelet dials the host path, not the one under --root
            with grpc.insecure_channel(f"unix://{kubelet / f'plugins_registry/{DRIVER}-reg.sock'}") as ch:
                info = reg_pb2_grpc.RegistrationStub(ch).GetInfo(reg_pb2.InfoRequest(), timeout=5)
            assert (info.name, info.endpoint) == (DRIVER, f"/var/lib/kubelet/plugins/{DRIVER}/dra.sock")
            plugin_dir = kubelet / "device-plugins"
            assert not plugin_dir.exists() or not list(plugin_dir.glob("*.sock"))
            assert "component device-plugin started" not in agent.log()
            # a reload that rebuilds the plane but keeps it keeps the slices too (no withdraw, no rewrite)
            before = slice_versions(kube_apiserver, node)
            config(cfg, kube_apiserver, "dra").write_text(cfg.read_text().replace("verify_interval = 5.0",
                                                                                  "verify_interval = 7.0"))
            reload_and_wait(agent)
            assert "reload: changed dra" in agent.log() and agent.log().count("component dra started") == 2
            # the rebuilt plane's first sync finds its pool intact in the API and takes it over as it is
            eventually(lambda: f"DRA pool {node}: adopted 1 ResourceSlice(s)" in agent.log(), 15, "pool adopted")
            assert slice_versions(kube_apiserver, node) == before
            assert "withdrawn" not in agent.log()
            code, took = agent.stop()
            assert code == 0 and took < 5.0, agent.log()
            # leaving is not withdrawing: prepared claims keep running, the next start answers for them
            assert sorted(slice_devices(kube_apiserver, node) or {}) == [f"gpu-{i}" for i in range(8)]
    finally:
        remove_node(kube_apiserver, node)


def test_plane_both_splits_the_gpus_and_sighup_switches_planes(
    tmp_path: Path, release_server: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    kube_apiserver = release_server
    node = "e2e-dra-both"
    cfg, args = dra_node(tmp_path, kube_apiserver, node, "both", "gpus = [0, 1]\n")
    try:
        with node_root(kubelet_harness) as root, running_agent(tmp_path, root, args) as agent:
            agent.wait_notify("READY=1", timeout=20)
            devices = eventually(lambda: slice_devices(kube_apiserver, node), 20, "ResourceSlices of the node")
            assert sorted(devices) == ["gpu-0", "gpu-1"], sorted(devices)
            dra_uuids = {uuid_of(d) for d in devices.values()}
            _, res = kubelet_harness.wait("nvidia.com/gpu", registered=True, total=6, timeout=20)
            plugin_ids = {d.id for d in res.devices}
            assert len(plugin_ids) == 6 and not plugin_ids & dra_uuids, (plugin_ids, dra_uuids)

            # one health monitor (the device plugin's) watches every GPU: an XID on a DRA GPU taints its device
            injected = subprocess.run([sys.executable, "-m", "nodeagent", "sim", "inject", "xid", "--sim-state",
                                       str(root / "sim.json"), "--gpu", "1", "--code", "48"],
                                      capture_output=True, text=True, timeout=30)
            assert injected.returncode == 0, injected.stderr

            def tainted() -> list[str]:
                return sorted(n for n, d in (slice_devices(kube_apiserver, node) or {}).items()
                              if any(t["key"] == UNHEALTHY_TAINT_KEY for t in d.get("taints") or ()))

            eventually(lambda: tainted() == ["gpu-1"], 15, "gpu-1 tainted unhealthy in the ResourceSlice")

            # SIGHUP to the device plugin alone: the slices are withdrawn, the plugin serves all 8 GPUs
            config(cfg, kube_apiserver, "device-plugin")
            reload_and_wait(agent)
            eventually(lambda: slice_devices(kube_apiserver, node) is None, 15, "ResourceSlices withdrawn")
            _, res = kubelet_harness.wait("nvidia.com/gpu", registered=True, total=8, timeout=20)
            assert dra_uuids <= {d.id for d in res.devices}

            # SIGHUP to DRA alone: every GPU in the slices, the device-plugin socket gone
            config(cfg, kube_apiserver, "dra")
            reload_and_wait(agent)
            devices = eventually(lambda: (d := slice_devices(kube_apiserver, node)) and len(d) == 8 and d, 20,
                                 "8 devices in the ResourceSlices")
            assert sorted(devices) == [f"gpu-{i}" for i in range(8)]
            eventually(lambda: not plugin_sockets(kubelet_harness), 10, "device-plugin socket gone")
            assert "reload: changed device_plugin" in agent.log()
            code, took = agent.stop()
            assert code == 0 and took < 5.0, agent.log()
    finally:
        remove_node(kube_apiserver, node)


def test_a_start_without_dra_deletes_the_slices_an_earlier_dra_run_left(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    """The agent runs with the token of its own pod (the packaged ClusterRoles and admission policy in force):
    plane "dra" publishes the node's slices and leaves them on exit; the next start with plane
    "device-plugin" deletes them at once (not after the kubelet's grace period), and only them: another
    node's slices and another driver's slices on this node stay."""
    from tests.e2e.test_kube_confinement import slice_obj
    from tests.e2e.test_kube_manifests import apply_rbac, bound_token, wait_for_policy

    node, other = "e2e-dra-leftover", "e2e-dra-leftover-b"
    apply_rbac(kube_apiserver, dra=True)  # a DRA plane installed before
    make_node(kube_apiserver, other)
    cfg, args = dra_node(tmp_path, kube_apiserver, node, "dra")
    token = bound_token(kube_apiserver, node)
    wait_for_policy(kube_apiserver, token, other)
    doc = json.loads(kube_apiserver.kubeconfig.read_text())
    doc["users"] = [{"name": "admin", "user": {"token": token}}]  # the agent's own token, no admin certificate
    agent_kubeconfig = tmp_path / "agent-kubeconfig"
    agent_kubeconfig.write_text(json.dumps(doc))
    cfg_text = cfg.read_text().replace(str(kube_apiserver.kubeconfig), str(agent_kubeconfig))
    cfg.write_text(cfg_text)
    kept = {f"{other}-gpu": slice_obj(f"{other}-gpu", other), f"{node}-nvidia": slice_obj(f"{node}-nvidia", node,
                                                                                           "gpu.nvidia.com")}
    slices = "/apis/resource.k8s.io/v1/resourceslices"

    def own_devices() -> list[str]:
        """The devices in this node's slices of the driver gpu.nodeagent.io."""
        status, body = kube_apiserver.get(f"{slices}?fieldSelector=spec.nodeName%3D{node},spec.driver%3D{DRIVER}")
        assert status == 200, body
        return [d["name"] for s in json.loads(body)["items"] for d in s["spec"].get("devices") or ()]

    try:
        for name, obj in kept.items():
            kube_apiserver.request("DELETE", f"{slices}/{name}")
            status, body = kube_apiserver.request("POST", slices, obj)
            assert status == 201, body
        with node_root(kubelet_harness) as root:
            (tmp_path / "first").mkdir()
            with running_agent(tmp_path / "first", root, args) as agent:
                agent.wait_notify("READY=1", timeout=20)
                eventually(lambda: len(own_devices()) == 8, 20, "the node's 8 GPUs in its ResourceSlices")
                code, _ = agent.stop()
                assert code == 0, agent.log()
            assert len(own_devices()) == 8  # left for the next start

            cfg.write_text(cfg_text.replace('plane = "dra"', 'plane = "device-plugin"'))
            (tmp_path / "second").mkdir()
            with running_agent(tmp_path / "second", root, args) as agent:
                t0 = time.monotonic()
                agent.wait_notify("READY=1", timeout=20)
                eventually(lambda: not own_devices(), 10, "the leftover slices deleted")
                took = time.monotonic() - t0
                line = f"deleted 1 DRA ResourceSlice(s) of {node} left by an earlier run (plane is device-plugin)"
                eventually(lambda: line in agent.log(), 5, "the deletion logged")
                kubelet_harness.wait("nvidia.com/gpu", registered=True, total=8, timeout=20)
                for name in kept:
                    assert kube_apiserver.get(f"{slices}/{name}")[0] == 200, name
                assert "not deleted" not in agent.log()
                code, _ = agent.stop()
                assert code == 0, agent.log()
        print(json.dumps({"leftover_slices_deleted_after_start_s": round(took, 3)}))
    finally:
        for name in kept:
            kube_apiserver.request("DELETE", f"{slices}/{name}")
        kube_apiserver.request("DELETE", f"/api/v1/nodes/{other}")
        remove_node(kube_apiserver, node)
