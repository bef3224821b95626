"""``nodeagent run`` with ``[vfio] enabled`` on a simulated L40S node, the real kube-apiserver and the real
kubelet device manager (harness, PodResources): the switches component starts and follows
``nvidia.com/gpu.workload.config`` both ways — the state label and one Event per change, ``nvidia.com/gpu``
left with nothing allocatable while the VFIO resource is served, a pod holding a VFIO device keeping the
node in vm-passthrough (its wait names the pod with the VFIO resource withdrawn meanwhile, ends ``failed``,
nothing changed, the resource served again), and the return once the pod is gone."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e._agent import eventually, fresh_node_with_gpu_crd, node_root, running_agent
from tests.peers.apiserver import KubeApiServer
from tests.peers.harness import running_harness

pytestmark = pytest.mark.peers

MACHINE = "l40s-x4"
NODE = "e2e-run-vfio"
GPU = "nvidia.com/gpu"
VFIO = "nvidia.com/AD102GL_L40S"
LABEL = "nvidia.com/gpu.workload.config"
STATE = "nvidia.com/gpu.workload.config.state"


def _labels(server: KubeApiServer) -> dict[str, str]:
    status, body = server.get(f"/api/v1/nodes/{NODE}")
    assert status == 200, body
    found: dict[str, str] = json.loads(body)["metadata"].get("labels") or {}
    return found


def _condition(server: KubeApiServer, kind: str) -> tuple[str, str, str]:
    status, body = server.get(f"/api/v1/nodes/{NODE}")
    assert status == 200, body
    found = {c["type"]: c for c in json.loads(body).get("status", {}).get("conditions") or []}
    c = found.get(f"nodeagent.io/{kind}", {})
    return c.get("status", ""), c.get("reason", ""), c.get("message", "")


def _set(server: KubeApiServer, value: str) -> None:
    status, body = server.request("PATCH", f"/api/v1/nodes/{NODE}", {"metadata": {"labels": {LABEL: value}}},
                                  content_type="application/merge-patch+json")
    assert status == 200, body


def _events(server: KubeApiServer, prefix: str) -> list[dict[str, Any]]:
    status, body = server.get(f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{NODE}")
    assert status == 200, body
    return [e for e in json.loads(body)["items"] if e["reason"].startswith(prefix)]


def test_run_follows_the_workload_label_both_ways(kube_apiserver: KubeApiServer, tmp_path: Path) -> None:
    started = time.monotonic()
    fresh_node_with_gpu_crd(kube_apiserver, NODE)
    with running_harness() as harness, node_root(harness) as root:
        etc = root / "etc/nodeagent"
        etc.mkdir(parents=True, exist_ok=True)
        cfg = etc / "config.toml"
        cfg.write_text(f'kubeconfig = "{kube_apiserver.kubeconfig}"\nresync_interval = 1.0\n'
                       "[vfio]\nenabled = true\nrelease_timeout = 4\n"
                       "[runtime]\nenabled = false\n"
                       '[kubelet]\npod_resources_socket = "/var/lib/kubelet/pod-resources.sock"\n')
        args = ["run", "--config", str(cfg), "--simulate", MACHINE, "--sim-state", str(tmp_path / "sim.json"),
                "--node-name", NODE]
        with running_agent(tmp_path, root, args) as agent:
            agent.wait_notify("READY=1", timeout=30)
            harness.wait(GPU, registered=True, total=4, healthy=4, timeout=20)

            _set(kube_apiserver, "vm-passthrough")
            eventually(lambda: _labels(kube_apiserver).get(STATE) == "vm-passthrough", 20, "state vm-passthrough")
            _, served = harness.wait(VFIO, registered=True, total=4, healthy=4, timeout=20)
            assert all(d.id.startswith("0000:") for d in served.devices)  # bus ids
            harness.wait(GPU, healthy=0, timeout=20)  # NVML sees no GPU: the plugin stopped serving them
            assert [e["type"] for e in _events(kube_apiserver, "WorkloadConfigApplied")] == ["Normal"]
            assert all((root / "sys/bus/pci/devices" / d.id / "driver").readlink().name == "vfio-pci"
                       for d in served.devices)
            # the node is ready for VMs, not short of GPUs: GPUReady True, reason VfioPassthrough
            eventually(lambda: _condition(kube_apiserver, "GPUReady")[1] == "VfioPassthrough", 20,
                       "GPUReady VfioPassthrough")
            status, _, message = _condition(kube_apiserver, "GPUReady")
            assert status == "True" and message.startswith("4 GPU(s) bound to vfio-pci for virtual machines"), message
            assert message.endswith(f"served as {VFIO}"), message
            assert _condition(kube_apiserver, "GPUHealthy")[:2] == ("Unknown", "VfioPassthrough")

            # a VM's pod holds one GPU: the way back waits for it, gives up after release_timeout, changes nothing
            pod = harness.allocate(VFIO, 1, pod="virt-launcher-vm", namespace="vms", pod_uid="vm-pod-uid")
            _set(kube_apiserver, "container")
            [waiting] = eventually(lambda: _events(kube_apiserver, "WorkloadConfigWaitingForPods"), 20, "the wait")
            assert "is held by pod vms/virt-launcher-vm" in waiting["message"], waiting
            # while it waits no new VM gets one of the GPUs: the VFIO resource is withdrawn
            harness.wait(VFIO, healthy=0, timeout=3)
            eventually(lambda: _labels(kube_apiserver).get(STATE) == "failed", 20, "state failed")
            [failed] = _events(kube_apiserver, "WorkloadConfigFailed")
            assert "held by pod vms/virt-launcher-vm after waiting 4s" in failed["message"], failed
            assert (root / "sys/bus/pci/devices" / pod.device_ids[0] / "driver").readlink().name == "vfio-pci"
            harness.wait(VFIO, registered=True, total=4, healthy=4, timeout=20)  # served again, as it was

            # the pod is gone; the label asked again (another value first: the same value is no new request)
            harness.release(pod.pod_uid)
            _set(kube_apiserver, "vm-passthrough")
            eventually(lambda: _labels(kube_apiserver).get(STATE) == "vm-passthrough", 20, "state vm-passthrough")
            _set(kube_apiserver, "container")
            eventually(lambda: _labels(kube_apiserver).get(STATE) == "container", 20, "state container")
            harness.wait(GPU, registered=True, total=4, healthy=4, timeout=20)
            harness.wait(VFIO, healthy=0, timeout=20)
            eventually(lambda: _condition(kube_apiserver, "GPUReady")[:2] == ("True", "AllGpusReady"), 20,
                       "GPUReady AllGpusReady back in container")
            assert len(_events(kube_apiserver, "WorkloadConfigApplied")) == 2
            assert agent.proc.poll() is None, agent.log()
            assert "Traceback" not in agent.log(), agent.log()
    print(f"test_run_vfio: {time.monotonic() - started:.1f}s")


def test_run_with_the_dra_plane_publishes_vfio_devices(kube_apiserver: KubeApiServer, tmp_path: Path) -> None:
    """Plane ``dra``: in vm-passthrough the node's pool offers the GPUs as ``gpu-<i>-vfio`` devices only (no
    VFIO device-plugin socket, no nvidia-driver device of the same GPU); back in container ``gpu-<i>``."""
    from tests.e2e.test_run_dra import remove_node, slice_devices

    node = "e2e-run-vfio-dra"
    fresh_node_with_gpu_crd(kube_apiserver, node)
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'kubeconfig = "{kube_apiserver.kubeconfig}"\nresync_interval = 1.0\n'
                   "[vfio]\nenabled = true\nrelease_timeout = 5\n[runtime]\nenabled = false\n"
                   '[device_plugin]\nplane = "dra"\n[dra]\nverify_interval = 5.0\n')
    args = ["run", "--config", str(cfg), "--simulate", MACHINE, "--sim-state", str(tmp_path / "sim.json"),
            "--node-name", node]

    def devices() -> list[str]:
        return sorted(slice_devices(kube_apiserver, node) or {})

    try:
        with node_root() as root, running_agent(tmp_path, root, args) as agent:
            agent.wait_notify("READY=1", timeout=30)
            eventually(lambda: devices() == [f"gpu-{i}" for i in range(4)], 20, "the GPUs in the slices")
            status, body = kube_apiserver.request(
                "PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": {LABEL: "vm-passthrough"}}},
                content_type="application/merge-patch+json")
            assert status == 200, body
            seen: list[list[str]] = []

            def vfio_only() -> bool:
                seen.append(devices())
                return seen[-1] == [f"gpu-{i}-vfio" for i in range(4)]

            eventually(vfio_only, 20, "the VFIO devices in the slices")
            # never both kinds of device for one GPU at once
            assert not [s for s in seen if any(d.endswith("-vfio") for d in s) and "gpu-0" in s], seen
            published = slice_devices(kube_apiserver, node) or {}
            assert published["gpu-2-vfio"]["attributes"]["type"] == {"string": "vfio"}
            plugin_dir = root / "var/lib/kubelet/device-plugins"
            assert not plugin_dir.exists() or not list(plugin_dir.glob("*.sock"))
            status, body = kube_apiserver.request(
                "PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": {LABEL: "container"}}},
                content_type="application/merge-patch+json")
            assert status == 200, body
            eventually(lambda: devices() == [f"gpu-{i}" for i in range(4)], 20, "the GPUs back in the slices")
            assert agent.proc.poll() is None, agent.log()
            assert "Traceback" not in agent.log(), agent.log()
    finally:
        remove_node(kube_apiserver, node)
