"""GPU objects (pure part): device → GPU mapping, per-GPU capacity, allocations from PodResources."""

from __future__ import annotations

from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice
from nodeagent.kube.gpuobjects import desired_gpu_objects, gpu_of_device, object_name, per_gpu_capacity
from nodeagent.kube.labels import SharingFacts
from nodeagent.kube.podresources import Assignment, assignments_from_response, by_device
from nodeagent.kube.podresources_api import podresources_pb2 as pb

MIGS = (MigDevice(1, 3, 0, "3g.20gb", 0, 4, 19968, "MIG-aaa"), MigDevice(1, 4, 0, "1g.5gb+me", 4, 1, 4864, "MIG-bbb"))


def _gpu(i: int, mig: bool = False) -> Gpu:
    return Gpu(i, f"GPU-{i}", "NVIDIA A100-SXM4-40GB", f"00000000:0{i}:00.0", 0x20B010DE, 40960, 0, 8, 0, i,
               "ampere", mig_capable=True, mig_current=mig, mig_devices=MIGS if mig else ())


INV = Inventory("535.1.2", 12020, (_gpu(0), _gpu(1, mig=True)))


def test_device_ids_map_to_physical_gpus() -> None:
    assert gpu_of_device("GPU-0", INV) == 0
    assert gpu_of_device("GPU-0::3", INV) == 0
    assert gpu_of_device("MIG-bbb", INV) == 1
    assert gpu_of_device("1", INV) == 1
    assert gpu_of_device("1:0", INV) == 1
    assert gpu_of_device("GPU-9", INV) is None
    assert gpu_of_device("7", INV) is None


def test_capacity_per_strategy() -> None:
    assert per_gpu_capacity(_gpu(0), SharingFacts(strategy="time-slicing", replicas=4)) == {"nvidia.com/gpu": "4"}
    mixed = per_gpu_capacity(_gpu(1, True), SharingFacts(mig_strategy="mixed"))
    assert mixed == {"nvidia.com/mig-1g.5gb.me": "1", "nvidia.com/mig-3g.20gb": "1"}
    assert per_gpu_capacity(_gpu(1, True), SharingFacts(mig_strategy="single")) == {"nvidia.com/gpu": "2"}


def test_desired_objects_with_allocations_and_health() -> None:
    assigns = [
        Assignment("ml", "train-0", "main", "nvidia.com/gpu", ("GPU-0",)),
        Assignment("ml", "infer", "srv", "nvidia.com/mig-3g.20gb", ("MIG-aaa",)),
        Assignment("ml", "infer", "side", "nvidia.com/mig-1g.5gb.me", ("MIG-bbb",)),
    ]
    objs = desired_gpu_objects("node-a", INV, SharingFacts(mig_strategy="mixed"), assigns, {1: False})
    assert set(objs) == {object_name("node-a", 0), object_name("node-a", 1)}
    o0 = objs["node-a-gpu0"]
    assert o0.spec["path"] == "/dev/nvidia0" and o0.spec["nodeName"] == "node-a" and o0.spec["memory"] == 40960
    assert o0.status["state"] == "Healthy"
    assert o0.status["allocated"] == {
        "ml/train-0": {"namespace": "ml", "pod": "train-0",
                       "containers": [{"container": "main", "resource": "nvidia.com/gpu", "devices": ["GPU-0"]}]}
    }
    o1 = objs["node-a-gpu1"]
    assert o1.status["state"] == "Unhealthy"
    assert set(o1.status["allocatable"].values()) == {"0"}
    assert [c["container"] for c in o1.status["allocated"]["ml/infer"]["containers"]] == ["side", "srv"]
    assert o1.status["allocatedDevices"] == 2


def test_podresources_response_conversion() -> None:
    resp = pb.ListPodResourcesResponse(pod_resources=[
        pb.PodResources(name="p", namespace="ns", containers=[
            pb.ContainerResources(name="c", devices=[
                pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-0", "GPU-1"]),
                pb.ContainerDevices(resource_name="example.com/none", device_ids=[]),
            ]),
        ]),
    ])
    a = assignments_from_response(resp)
    assert a == [Assignment("ns", "p", "c", "nvidia.com/gpu", ("GPU-0", "GPU-1"))]
    assert set(by_device(a)) == {"GPU-0", "GPU-1"}
