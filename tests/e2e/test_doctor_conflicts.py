"""``nodeagent doctor`` on simulated nodes where another agent serves or configures the GPUs: another device
plugin at nodeagent's socket name and one under another name that the kubelet's checkpoint registers as
nvidia.com/gpu (both real gRPC servers answering the device-plugin API), another DRA driver's ResourceSlices
with the node's GPU UUID, nvidia.com/mig.config.state written by another field manager, and NFD owning
nodeagent's label keys (its annotation and a NodeFeature object), the last three on a real kube-apiserver."""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_doctor import _na, _one
from tests.peers.apiserver import KubeApiServer
from tests.peers.sampleplugin import SampleDevicePlugin

T4_UUID = "GPU-9b546366-b804-5789-91a6-2ff95c0d0aa5"  # the simulated t4x1's GPU


@pytest.fixture
def root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="nadoc-", dir="/tmp") as d:  # short: sockets live below it
        yield Path(d) / "node"


def _findings(root: Path, *args: str) -> tuple[int, list[dict[str, Any]]]:
    r = _na(root, "doctor", "--simulate", "t4x1", "--json", *args)
    assert r.returncode in (0, 1, 2) and "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout)["findings"]


def test_other_device_plugins_on_the_node(root: Path) -> None:
    plugins = root / "var/lib/kubelet/device-plugins"
    plugins.mkdir(parents=True)
    # this test process serves both; the node's /proc says it is not nodeagent
    proc = root / "proc" / str(os.getpid())
    proc.mkdir(parents=True)
    (proc / "cmdline").write_bytes(b"nvidia-device-plugin\0--fail-on-init-error=false\0")
    same_name = SampleDevicePlugin(
        plugins, "nvidia.com/gpu", {T4_UUID: "Healthy"}, socket_name="nvidia-gpu.sock"
    )
    other_name = SampleDevicePlugin(
        plugins, "nvidia.com/gpu", {"Dev-1": "Healthy"}, socket_name="dp.1700000000"
    )
    fpga = SampleDevicePlugin(plugins, "example.com/fpga", {"fpga-0": "Healthy"}, socket_name="fpga.sock")
    (plugins / "kubelet_internal_checkpoint").write_text(
        json.dumps(
            {
                "Data": {
                    "PodDeviceEntries": [],
                    "RegisteredDevices": {"nvidia.com/gpu": ["Dev-1"], "example.com/fpga": ["fpga-0"]},
                }
            }
        )
    )
    for p in (same_name, other_name, fpga):
        p.start()
    try:
        code, findings = _findings(root, "--no-kube")
    finally:
        for p in (same_name, other_name, fpga):
            p.stop()
    assert code == 1
    same = _one(
        findings,
        "kubelet",
        "warning",
        f"another device plugin serves nvidia.com/gpu on nvidia-gpu.sock (pid {os.getpid()}); 1 of its 1 "
        "device(s) are this node's GPUs by UUID: nodeagent does not register nvidia.com/gpu until it is gone",
    )
    assert "[adopt] take_over = true" in same["fix"]
    _one(
        findings,
        "kubelet",
        "warning",
        f"another device plugin serves nvidia.com/gpu on dp.1700000000 (pid {os.getpid()})",
    )
    _one(findings, "kubelet", "ok", "fpga.sock: another device plugin, for other devices (1 listed)")

    # the same sockets served by nodeagent itself (its /proc entry says `nodeagent run`): no conflict
    (proc / "cmdline").write_bytes(b"/usr/bin/python3\0/usr/bin/nodeagent\0run\0")
    same_name.start()
    try:
        code, findings = _findings(root, "--no-kube")
    finally:
        same_name.stop()
    assert not [f for f in findings if "another device plugin serves" in f["text"]], findings


@pytest.fixture
def node_feature_crd(kube_apiserver: KubeApiServer) -> Iterator[None]:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "nodefeatures.nfd.k8s-sigs.io"},
        "spec": {
            "group": "nfd.k8s-sigs.io",
            "scope": "Namespaced",
            "names": {"plural": "nodefeatures", "singular": "nodefeature", "kind": "NodeFeature"},
            "versions": [
                {
                    "name": "v1alpha1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                }
            ],
        },
    }
    status, body = kube_apiserver.request(
        "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd
    )
    assert status in (201, 409), body
    import time

    deadline = time.monotonic() + 30
    while kube_apiserver.get("/apis/nfd.k8s-sigs.io/v1alpha1/nodefeatures")[0] != 200:
        assert time.monotonic() < deadline, "the NodeFeature CRD is not served"
        time.sleep(0.2)
    yield


def test_dra_driver_mig_manager_and_nfd_on_the_api(
    root: Path, kube_apiserver: KubeApiServer, node_feature_crd: None
) -> None:
    server, node = kube_apiserver, "doctor-conflicts"
    server.request("DELETE", f"/api/v1/nodes/{node}")
    # the MIG state label as NVIDIA's mig-manager writes it (its field manager), NFD's ownership annotation
    status, body = server.request(
        "POST",
        "/api/v1/nodes?fieldManager=nvidia-mig-manager",
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node,
                "labels": {
                    "nvidia.com/mig.config.state": "success",
                    "nvidia.com/gpu.product": "Tesla-T4",
                    # a hand-over switched both off; somebody switched one on again
                    "nvidia.com/gpu.deploy.device-plugin": "false",
                    "nvidia.com/gpu.deploy.gpu-feature-discovery": "true",
                },
                "annotations": {
                    "nfd.node.kubernetes.io/feature-labels": "cpu-model.id,nvidia.com/gpu.product",
                    "nodeagent.io/handed-over": '["device-plugin", "gpu-feature-discovery"]',
                },
            },
        },
    )
    assert status == 201, body
    slice_name = f"{node}-gpu.nvidia.com"
    status, body = server.request(
        "POST",
        "/apis/resource.k8s.io/v1/resourceslices",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": slice_name},
            "spec": {
                "driver": "gpu.nvidia.com",
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-0", "attributes": {"uuid": {"string": T4_UUID}}}],
            },
        },
    )
    assert status == 201, body
    server.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "nfd"}}
    )
    status, body = server.request(
        "POST",
        "/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/nfd/nodefeatures",
        {
            "apiVersion": "nfd.k8s-sigs.io/v1alpha1",
            "kind": "NodeFeature",
            "metadata": {"name": f"{node}-gfd", "labels": {"nfd.node.kubernetes.io/node-name": node}},
            "spec": {"labels": {"nvidia.com/gpu.count": "1", "nvidia.com/gpu.product": "Tesla-T4"}},
        },
    )
    assert status == 201, body
    try:
        code, findings = _findings(root, "--kubeconfig", str(server.kubeconfig), "--node-name", node)
        # the operator's device plugin switched on again (a release): nodeagent would leave its resources to it
        status, body = server.request(
            "PATCH", f"/api/v1/nodes/{node}",
            {"metadata": {"labels": {"nvidia.com/gpu.deploy.device-plugin": "true"}}},
            content_type="application/merge-patch+json",
        )
        assert status == 200, body
        _, released = _findings(root, "--kubeconfig", str(server.kubeconfig), "--node-name", node)
        # the fix printed for it, run as printed: the operands are handed over again, the finding is gone
        fix = _one(released, "node", "warning", "the GPU Operator deploys its device plugin on this node")["fix"]
        words = shlex.split(fix)
        assert words[:3] == ["nodeagent", "--root", str(root)], fix
        adopted = _na(root, *words[3:])
        assert adopted.returncode == 0, adopted.stdout + adopted.stderr
        _, after = _findings(root, "--kubeconfig", str(server.kubeconfig), "--node-name", node)
        assert not [f for f in after if "deploys its device plugin" in f["text"] or "no longer false" in f["text"]]
    finally:
        server.request("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{slice_name}")
        server.request("DELETE", f"/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/nfd/nodefeatures/{node}-gfd")
        server.request("DELETE", f"/api/v1/nodes/{node}")
    assert code in (1, 2)
    _one(
        findings,
        "kubelet",
        "warning",
        f"DRA driver gpu.nvidia.com publishes ResourceSlices with this node's GPUs ({T4_UUID})",
    )
    mig = _one(
        findings, "node", "warning", "nvidia.com/mig.config.state=success was written by nvidia-mig-manager"
    )
    assert mig["fix"].startswith(f"nodeagent --root {root} adopt --node-name {node}"), mig
    _one(
        findings,
        "node",
        "warning",
        "NFD (nfd.node.kubernetes.io/feature-labels) owns label(s) nodeagent writes: nvidia.com/gpu.product",
    )
    _one(
        findings,
        "node",
        "warning",
        "NodeFeature nfd/doctor-conflicts-gfd owns label(s) nodeagent writes: "
        "nvidia.com/gpu.count, nvidia.com/gpu.product",
    )
    again = _one(
        findings,
        "node",
        "warning",
        "handed over from the GPU Operator (nodeagent.io/handed-over), but "
        "nvidia.com/gpu.deploy.gpu-feature-discovery is no longer false",
    )
    assert again["fix"] == f"nodeagent --root {root} adopt --node-name {node} --kubeconfig {server.kubeconfig}"
    operator = _one(released, "node", "warning", "the GPU Operator deploys its device plugin on this node "
                    "(nvidia.com/gpu.deploy.device-plugin=true): nodeagent leaves nvidia.com/gpu to it")
    assert operator["fix"] == f"nodeagent --root {root} adopt --node-name {node} --kubeconfig {server.kubeconfig}"
    assert not [f for f in findings if "deploys its device plugin" in f["text"]]  # while it was false
