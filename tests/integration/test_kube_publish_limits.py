"""NodePublisher against the REAL kube-apiserver: the re-apply rate limit and a cluster without the GPU CRD."""

from __future__ import annotations

import logging
import time

import pytest

from nodeagent.config import PublishSettings
from nodeagent.errors import KubeError
from nodeagent.gpu.inventory import Gpu, Inventory
from nodeagent.kube.client import KubeClient
from nodeagent.kube.gpuobjects import API_PATH, CRD_NAME, install_crd
from nodeagent.kube.labels import NetFacts
from nodeagent.kube.node import NodeClient
from nodeagent.kube.publisher import NodePublisher
from tests.integration._kube import wait_for

P = "nvidia.com/"
CRD_PATH = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}"
INV = Inventory("535.161.08", 12020, (
    Gpu(0, "GPU-0-77aa", "NVIDIA A100-SXM4-40GB", "00000000:07:00.0", 0x20B010DE, 40960, 0, 8, 0, 0, "ampere"),
))


def test_reapply_is_rate_limited_and_the_next_pass_catches_up(
    kube: KubeClient, node_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    pub = NodePublisher(kube, node_name, PublishSettings(gpu_objects=False), net=NetFacts())
    pub.reapply_per_minute = 2
    nc = NodeClient(kube, node_name)
    pub.publish(INV, ["nvidia.com/gpu"])
    pub.start_watch(watch_timeout_s=60)
    try:
        # somebody keeps deleting a label nodeagent owns: the first resets are undone at once
        for n in (1, 2):
            nc.patch_labels({P + "gpu.product": None})
            wait_for(lambda: P + "gpu.product" in nc.get().labels)
            assert pub.reapplied == n
        # the third within the minute is left for the next resync: nodeagent does not fight faster
        with caplog.at_level(logging.WARNING, logger="nodeagent.kube.publisher"):
            nc.patch_labels({P + "gpu.product": None})
            wait_for(lambda: any("keeps losing values" in r.getMessage() for r in caplog.records))
        writes = kube.stats.writes
        time.sleep(0.5)
        assert P + "gpu.product" not in nc.get().labels
        assert pub.reapplied == 2 and kube.stats.writes == writes
        # the periodic pass (publish) restores it; a minute later the watch may re-apply again
        assert pub.publish(INV, ["nvidia.com/gpu"]).metadata_writes == 1
        assert nc.get().labels[P + "gpu.product"] == "NVIDIA-A100-SXM4-40GB"
        pub._reapplies = [t - 61.0 for t in pub._reapplies]  # as if that minute had passed
        nc.patch_labels({P + "gpu.product": None})
        wait_for(lambda: P + "gpu.product" in nc.get().labels)
        assert pub.reapplied == 3
    finally:
        pub.close()


def _crd_gone(kube: KubeClient) -> bool:
    try:
        kube.request("GET", CRD_PATH)
    except KubeError as e:
        if e.status == 404:
            return True
        raise
    return False


def test_missing_crd_is_named_with_the_fix_and_labels_still_publish(
    kube: KubeClient, node_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # this session's apiserver may have the CRD from other tests: remove it, put it back afterwards
    try:
        kube.request("DELETE", CRD_PATH)
    except KubeError as e:
        if e.status != 404:
            raise
    wait_for(lambda: _crd_gone(kube), 30)
    try:
        pub = NodePublisher(kube, node_name, PublishSettings(), net=NetFacts())
        with caplog.at_level(logging.WARNING, logger="nodeagent.kube.publisher"):
            res = pub.publish(INV, ["nvidia.com/gpu"])
        (err,) = res.errors
        assert f"the CRD {CRD_NAME} is not installed" in err
        assert "kubectl apply -f packaging/kubernetes/gpu-crd.yaml" in err
        assert any("kubectl apply -f packaging/kubernetes/gpu-crd.yaml" in r.getMessage() for r in caplog.records)
        assert "\n" not in err
        labels = NodeClient(kube, node_name).get().labels
        assert labels[P + "gpu.count"] == "1" and labels[P + "gpu.product"] == "NVIDIA-A100-SXM4-40GB"
        assert res.metadata_writes >= 1 and res.status_writes == 1  # labels and gpu-memory went out

        # once the CRD is there, the next pass creates the object
        install_crd(kube)

        def created() -> bool:
            try:
                return pub.publish(INV, ["nvidia.com/gpu"]).gpu_objects.created == [f"{node_name}-gpu0"]
            except KubeError as e:  # a freshly served CRD may answer 429 for a moment
                if e.status == 429:
                    return False
                raise

        wait_for(created, 30)
        assert kube.request("GET", f"{API_PATH}/{node_name}-gpu0")["spec"]["uuid"] == "GPU-0-77aa"
        kube.request("DELETE", f"{API_PATH}/{node_name}-gpu0")
    finally:
        install_crd(kube)
