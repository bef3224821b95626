"""``nodeagent run`` with the kubelet's PodResources API (the real device manager's allocation state, served
by the harness): a device allocated through the kubelet path shows up in the GPU object's
``status.allocated`` and as pod/namespace/container on the dcgm-exporter metrics; API requests are counted."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from nodeagent.kube.gpuobjects import API_PATH, NODE_LABEL
from tests._metrics import scrape
from tests.e2e._agent import eventually, fresh_node_with_gpu_crd, node_root, running_agent
from tests.peers.apiserver import KubeApiServer, free_port
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers


def gpu_objects(server: KubeApiServer, node: str) -> dict[str, dict[str, Any]]:
    status, body = server.get(f"{API_PATH}?labelSelector={NODE_LABEL}%3D{node}")
    if status == 429:  # a freshly installed CRD's storage may still be initialising
        return {}
    assert status == 200, body
    return {o["metadata"]["name"]: o for o in json.loads(body)["items"]}


def test_allocated_device_reaches_gpu_object_and_metrics(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    node = f"pr-{tmp_path.name[-12:].lower().replace('_', '-')}".rstrip("-")
    fresh_node_with_gpu_crd(kube_apiserver, node)
    port = free_port()
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'kubeconfig = "{kube_apiserver.kubeconfig}"\nresync_interval = 1.0\n'
                   "[mig]\nenabled = false\n[runtime]\nenabled = false\n"
                   f'[metrics]\naddress = "127.0.0.1:{port}"\ninterval = 1.0\n'
                   '[kubelet]\npod_resources_socket = "/var/lib/kubelet/pod-resources.sock"\n')
    # /var/lib/kubelet under the root is the harness's directory (see node_root)
    args = ["run", "--simulate", "dgx-a100-40gb", "--sim-state",
            str(kubelet_harness.workdir / "sim.json"), "--config", str(cfg),  # in the root node_root gives
            "--node-name", node]
    with node_root(kubelet_harness) as root, running_agent(tmp_path, root, args, metrics=None) as agent:
        agent.wait_notify("READY=1", 20)
        kubelet_harness.wait("nvidia.com/gpu", registered=True, total=8, healthy=8)
        eventually(lambda: len(gpu_objects(kube_apiserver, node)) == 8, 20, "8 GPU objects")

        alloc = kubelet_harness.allocate("nvidia.com/gpu", 2, pod="train", namespace="ml", container="main")
        held = set(alloc.device_ids)
        assert len(held) == 2

        def allocated() -> dict[str, dict[str, Any]]:
            return {o["spec"]["uuid"]: o["status"].get("allocated") or {}
                    for o in gpu_objects(kube_apiserver, node).values()}

        eventually(lambda: sum(1 for a in allocated().values() if "ml/train" in a) == 2, 20,
                   "status.allocated of the two GPUs")
        by_uuid = allocated()
        for uuid, alloc_map in by_uuid.items():
            if uuid in held:
                (entry,) = alloc_map["ml/train"]["containers"]
                assert entry["container"] == "main" and entry["resource"] == "nvidia.com/gpu"
                assert entry["devices"] == [uuid]
            else:
                assert alloc_map == {}, uuid

        def pod_series() -> list[dict[str, str]]:
            return [lab for lab, _ in scrape(port).get("DCGM_FI_DEV_FB_USED", []) if lab.get("pod") == "train"]

        eventually(lambda: len(pod_series()) == 2, 20, "metrics with pod labels")
        series = pod_series()
        assert {s["UUID"] for s in series} == held
        assert {(s["namespace"], s["container"], s["Hostname"]) for s in series} == {("ml", "main", node)}

        fams = scrape(port)
        requests = {lab["method"]: v for lab, v in fams["nodeagent_kube_api_requests_total"]}
        assert requests.get("GET", 0) >= 1 and requests.get("PATCH", 0) >= 1 and requests.get("POST", 0) >= 8, requests

        # the pod goes away: the next pass clears the allocation again
        kubelet_harness.release(alloc.pod_uid)
        eventually(lambda: not any(allocated().values()), 20, "status.allocated cleared")
        code, took = agent.stop(signal.SIGTERM)
        assert code == 0 and took < 5.0, agent.log()
