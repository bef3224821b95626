"""Pod UID → namespace/name against the real kubelet device manager: its own checkpoint file and its
PodResources v1 server, as the MIG reconciler uses them to name the pod behind a process on a busy GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nodeagent.kube.podnames import CHECKPOINT_NAME, PodNameLookup
from nodeagent.kube.podresources import PodResourcesClient
from tests.peers.harness import KubeletHarness
from tests.peers.sampleplugin import SampleDevicePlugin

pytestmark = pytest.mark.peers

RESOURCE = "example.com/gpu"
UID = "0b6c3d2e-7f1a-4c55-9e0d-1a2b3c4d5e6f"


@pytest.fixture
def plugin(kubelet_harness: KubeletHarness) -> Iterator[SampleDevicePlugin]:
    p = SampleDevicePlugin(kubelet_harness.plugin_dir, RESOURCE, {f"GPU-{i}": "Healthy" for i in range(3)})
    p.start()
    try:
        p.register()
        kubelet_harness.wait(RESOURCE, registered=True, timeout=10)
        yield p
    finally:
        p.stop()


def test_uid_of_an_allocated_pod_is_named_and_forgotten_when_released(
    kubelet_harness: KubeletHarness, plugin: SampleDevicePlugin
) -> None:
    client = PodResourcesClient(kubelet_harness.pod_resources_socket)
    try:
        lookup = PodNameLookup(kubelet_harness.plugin_dir / CHECKPOINT_NAME, client.list, max_age_s=0.0)
        assert lookup(UID) is None  # nothing allocated yet
        kubelet_harness.allocate(RESOURCE, 2, pod="train-0", namespace="ml", pod_uid=UID, container="main")
        kubelet_harness.allocate(RESOURCE, 1, pod="infer", namespace="serving", pod_uid="other-uid")
        assert lookup(UID) == "ml/train-0"
        assert lookup("other-uid") == "serving/infer"
        assert lookup("never-seen") is None
        kubelet_harness.release(UID)
        assert lookup(UID) is None and lookup("other-uid") == "serving/infer"
    finally:
        client.close()
    # a kubelet that does not answer: no name, no exception
    dead = PodResourcesClient(kubelet_harness.workdir / "no-such.sock", timeout=0.5)
    try:
        assert PodNameLookup(kubelet_harness.plugin_dir / CHECKPOINT_NAME, dead.list)("other-uid") is None
    finally:
        dead.close()


def test_pods_of_the_node_name_the_gpu_operators_operands(
    kubelet_harness: KubeletHarness, plugin: SampleDevicePlugin
) -> None:
    """The hand-over's fallback when the agent may not list pods: the kubelet's PodResources API names the
    node's pods, the operator's operand pods among them by their DaemonSet names."""
    from nodeagent.adopt import operand_pods_by_name

    kubelet_harness.allocate(RESOURCE, 1, pod="nvidia-device-plugin-daemonset-q7x2k", namespace="gpu-operator")
    kubelet_harness.allocate(RESOURCE, 1, pod="train-0", namespace="ml")
    client = PodResourcesClient(kubelet_harness.pod_resources_socket)
    try:
        pods = client.pods()
    finally:
        client.close()
    assert ("ml", "train-0") in pods and ("gpu-operator", "nvidia-device-plugin-daemonset-q7x2k") in pods
    assert operand_pods_by_name(pods) == ["gpu-operator/nvidia-device-plugin-daemonset-q7x2k"]
