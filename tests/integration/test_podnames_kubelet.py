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
