"""Each real peer in use: kube-apiserver, the kubelet's device manager, containerd."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.peers import Containerd, ContainerdConfigError, HarnessError, KubeApiServer, KubeletHarness
from tests.peers.sampleplugin import SampleDevicePlugin

pytestmark = pytest.mark.peers

RESOURCE = "example.com/dongle"


# --- kube-apiserver ---------------------------------------------------------------------------------

def test_node_status_extended_resource_patch(kube_apiserver: KubeApiServer) -> None:
    from kubernetes import client as k8s

    api = kube_apiserver.api_client()
    try:
        core = k8s.CoreV1Api(api)
        name = "peers-test-node-patch"
        core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=name)))
        # A node without a kubelet has no capacity map yet; give it the one a kubelet would publish.
        core.patch_node_status(name, [{"op": "add", "path": "/status/capacity", "value": {"cpu": "4"}}])
        patch = [{"op": "add", "path": "/status/capacity/example.com~1dongle", "value": "4"}]
        # The typed client sends a list body as application/json-patch+json.
        core.patch_node_status(name, patch)
        node = core.read_node_status(name)
        assert node.status is not None and node.status.capacity is not None
        assert node.status.capacity[RESOURCE] == "4"
        # The same through plain HTTP with an explicit content type.
        patch2 = [{"op": "replace", "path": "/status/capacity/example.com~1dongle", "value": "2"}]
        status, body = kube_apiserver.request("PATCH", f"/api/v1/nodes/{name}/status", patch2,
                                              content_type="application/json-patch+json")
        assert status == 200, body
        status, body = kube_apiserver.get(f"/api/v1/nodes/{name}")
        assert status == 200
        assert json.loads(body)["status"]["capacity"][RESOURCE] == "2"
        core.delete_node(name)
    finally:
        api.close()
    assert kube_apiserver.version.startswith("v1.")


# --- kubelet device manager ---------------------------------------------------------------------------

@pytest.fixture
def plugin(kubelet_harness: KubeletHarness) -> Iterator[SampleDevicePlugin]:
    p = SampleDevicePlugin(kubelet_harness.plugin_dir, RESOURCE,
                         {f"dongle-{i}": "Healthy" for i in range(4)},
                         preferred=["dongle-3", "dongle-1"], pre_start_required=True)
    p.start()
    try:
        yield p
    finally:
        p.stop()


def test_plugin_registers_and_is_allocated(kubelet_harness: KubeletHarness, plugin: SampleDevicePlugin) -> None:
    plugin.register()
    _, res = kubelet_harness.wait(RESOURCE, registered=True, healthy=4, timeout=10)
    assert [d.id for d in res.devices] == [f"dongle-{i}" for i in range(4)]
    assert res.device("dongle-0").numa == (0,)

    alloc = kubelet_harness.allocate(RESOURCE, 2, pod="p1", container="c")
    # The kubelet asked for a preferred allocation and followed it, then called Allocate and PreStart.
    assert alloc.device_ids == ("dongle-1", "dongle-3")
    assert [c[0] for c in plugin.calls] == ["GetPreferredAllocation", "Allocate", "PreStartContainer"]
    assert alloc.envs == {"TEST_DEVICES": "dongle-1,dongle-3"}
    assert alloc.annotations == {"example.com/devices": "dongle-1,dongle-3"}
    assert sorted(alloc.cdi_devices) == ["example.com/dongle=dongle-1", "example.com/dongle=dongle-3"]
    assert {m["container_path"] for m in alloc.mounts} == {"/opt/test"}
    assert len(alloc.devices) == 2

    # The kubelet's PodResources API answers from the same allocation state.
    from nodeagent.kube.podresources_api import podresources_pb2 as pr
    from nodeagent.kube.podresources_api import podresources_pb2_grpc

    pr_grpc: Any = podresources_pb2_grpc

    with grpc.insecure_channel(f"unix://{kubelet_harness.pod_resources_socket}") as ch:
        stub = pr_grpc.PodResourcesListerStub(ch)
        listed = stub.List(pr.ListPodResourcesRequest(), timeout=5)
        allocatable = stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=5)
        got = stub.Get(pr.GetPodResourcesRequest(pod_name="p1", pod_namespace="default"), timeout=5)
    assert sorted(i for d in allocatable.devices for i in d.device_ids) == [f"dongle-{i}" for i in range(4)]
    assert got.pod_resources.containers[0].name == "c"
    (pod,) = listed.pod_resources
    assert (pod.name, pod.namespace, pod.containers[0].name) == ("p1", "default", "c")
    assert sorted(i for d in pod.containers[0].devices for i in d.device_ids) == ["dongle-1", "dongle-3"]

    # Only 2 left; asking for 3 more fails in the kubelet, the pod releases, then it fits.
    with pytest.raises(HarnessError, match="Requested: 3, Available: 2"):
        kubelet_harness.allocate(RESOURCE, 3, pod="p2")
    kubelet_harness.release("default/p1")
    assert len(kubelet_harness.allocate(RESOURCE, 3, pod="p3").device_ids) == 3


def test_health_change_and_restart(kubelet_harness: KubeletHarness, plugin: SampleDevicePlugin) -> None:
    plugin.register()
    kubelet_harness.wait(RESOURCE, healthy=4, timeout=10)
    t0 = time.time()
    plugin.set_health("dongle-2", "Unhealthy")
    seen, res = kubelet_harness.wait(RESOURCE, device="dongle-2", health="Unhealthy", timeout=5)
    assert res.allocatable == 3 and res.capacity == 4
    assert 0 <= seen - t0 < 5
    assert any(u.resource.allocatable == 3 for u in kubelet_harness.updates(RESOURCE))

    # A kubelet restart removes every socket in the directory, including the plugin's.
    assert plugin.socket.exists()
    kubelet_harness.restart()
    assert not plugin.socket.exists()
    assert kubelet_harness.kubelet_socket.exists()


def test_plugin_error_reaches_the_test(kubelet_harness: KubeletHarness, plugin: SampleDevicePlugin) -> None:
    plugin.preferred = None
    plugin.fail_allocate = (grpc.StatusCode.RESOURCE_EXHAUSTED, "dongles are busy")
    plugin.register()
    kubelet_harness.wait(RESOURCE, healthy=4, timeout=10)
    with pytest.raises(HarnessError) as err:
        kubelet_harness.allocate(RESOURCE, 1)
    assert err.value.code == "ResourceExhausted"
    assert err.value.message == "dongles are busy"
    # Direct call with explicit device IDs.
    with pytest.raises(HarnessError) as err:
        kubelet_harness.plugin(plugin.socket_name, "Allocate", devices=["dongle-0"])
    assert err.value.code == "ResourceExhausted"


# --- containerd ---------------------------------------------------------------------------------------

CONFIG_WITH_EXTRA_RUNTIME = """\
version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = true
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
    BinaryName = "/usr/bin/nvidia-container-runtime"
    SystemdCgroup = true
"""


def test_containerd_loads_extra_runtime(containerd: Containerd, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(CONFIG_WITH_EXTRA_RUNTIME)
    dump = containerd.config_dump(cfg)
    runtimes = dump["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["nvidia"]["options"]["BinaryName"] == "/usr/bin/nvidia-container-runtime"

    running = containerd.start(cfg)
    assert running.cri_error is None
    assert set(running.runtimes) == {"runc", "nvidia"}
    assert running.runtimes["nvidia"]["Type"] == "io.containerd.runc.v2"
    assert running.runtimes["nvidia"]["Options"]["BinaryName"] == "/usr/bin/nvidia-container-runtime"
    assert running.default_runtime == "runc"
    assert "Server:" in running.ctr("version")


def test_containerd_reports_bad_config(containerd: Containerd, tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('version = 2\n[plugins."io.containerd.grpc.v1.cri"\n')
    with pytest.raises(ContainerdConfigError, match=r"\(2, \d+\)"):
        containerd.config_dump(cfg)
