"""Metrics: dcgm-exporter names/labels from samples + PodResources, agent counters, real HTTP scrape."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice
from nodeagent.kube.podresources import Assignment
from nodeagent.metrics import DEFAULT_ADDRESS, GpuSample, Metrics, sample_from

MIG = MigDevice(1, 5, 0, "3g.20gb", 0, 4, 19968, "MIG-x")
INV = Inventory("535.1.2", 12020, (
    Gpu(0, "GPU-a", "NVIDIA A100-SXM4-40GB", "00000000:07:00.0", 0x20B010DE, 40960, 0, 8, 0, 0, "ampere"),
    Gpu(1, "GPU-b", "NVIDIA A100-SXM4-40GB", "00000000:0F:00.0", 0x20B010DE, 40960, 0, 8, 0, 1, "ampere",
        mig_capable=True, mig_current=True, mig_devices=(MIG,)),
))


@dataclass
class AdapterReading:  # the shape an NVML adapter may hand over
    utilization: int
    memory_used_mib: int
    memory_free_mib: int
    temperature_c: int
    power_w: float


def _families(m: Metrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = generate_latest(m.registry).decode()
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def test_default_address_is_loopback() -> None:
    import inspect

    assert DEFAULT_ADDRESS == "127.0.0.1:9400"
    assert inspect.signature(Metrics.serve).parameters["address"].default == DEFAULT_ADDRESS
    # what ``serve`` binds is the loopback interface only, never the wildcard address
    server = Metrics("n").serve("127.0.0.1:0")
    try:
        assert server.address[0] == "127.0.0.1"
    finally:
        server.stop()


def test_sample_conversion_from_object_and_mapping() -> None:
    s = sample_from(AdapterReading(55, 100, 900, 40, 71.5))
    assert s == GpuSample(55.0, 100.0, 900.0, 40.0, 71.5, None)
    assert sample_from({"gpu_util": 3, "last_xid": 79}).last_xid == 79.0


def test_dcgm_series_with_pods_and_mig_labels() -> None:
    m = Metrics("node-a")
    m.update_gpus(
        INV,
        {0: AdapterReading(80, 1000, 39960, 50, 250.0), 1: {"gpu_util": 10, "fb_used_mib": 5, "last_xid": 48}},
        [Assignment("ml", "train", "main", "nvidia.com/gpu", ("GPU-a",)),
         Assignment("ml", "infer", "srv", "nvidia.com/mig-3g.20gb", ("MIG-x",))],
        health={1: False},
    )
    fams = _families(m)
    util = {lab["gpu"]: (lab, v) for lab, v in fams["DCGM_FI_DEV_GPU_UTIL"]}
    lab0, v0 = util["0"]
    assert v0 == 80.0
    assert lab0 == {"gpu": "0", "UUID": "GPU-a", "pci_bus_id": "00000000:07:00.0", "device": "nvidia0",
                    "modelName": "NVIDIA A100-SXM4-40GB", "GPU_I_PROFILE": "", "GPU_I_ID": "", "Hostname": "node-a",
                    "namespace": "ml", "pod": "train", "container": "main"}
    lab1, _ = util["1"]  # a GPU's own series: no GPU instance, no holder of its MIG devices
    assert (lab1["GPU_I_PROFILE"], lab1["GPU_I_ID"], lab1["pod"]) == ("", "", "")
    assert [v for _, v in fams["DCGM_FI_DEV_XID_ERRORS"]] == [48.0]
    assert {lab["gpu"]: v for lab, v in fams["DCGM_FI_DEV_FB_FREE"]} == {"0": 39960.0}
    health = {lab["gpu"]: v for lab, v in fams["nodeagent_device_healthy"]}
    assert health == {"0": 1.0, "1": 0.0}


def test_gpu_instances_get_their_own_series_with_their_holders() -> None:
    m = Metrics("node-a")
    reading = {"memory_used_mib": 5, "memory_free_mib": 40955, "sm_clock_mhz": 1410, "energy_mj": 123456,
               "memory_temperature_c": 40,
               "mig": [{"gi_id": 5, "memory_used_mib": 2000, "memory_free_mib": 17968,
                        "gpm": {"graphics_util": 50.0, "pcie_rx_mibs": 2.0}}]}
    m.update_gpus(INV, {1: reading}, [Assignment("ml", "infer", "srv", "nvidia.com/mig-3g.20gb", ("MIG-x::1",))])
    fams = _families(m)
    fb = {(lab["GPU_I_ID"], lab["GPU_I_PROFILE"], lab["pod"]): v for lab, v in fams["DCGM_FI_DEV_FB_USED"]}
    assert fb == {("", "", ""): 5.0, ("5", "3g.20gb", "infer"): 2000.0}
    gr = [(lab["GPU_I_ID"], lab["UUID"], lab["gpu"], v) for lab, v in fams["DCGM_FI_PROF_GR_ENGINE_ACTIVE"]]
    assert gr == [("5", "GPU-b", "1", 0.5)]
    assert [v for _, v in fams["DCGM_FI_PROF_PCIE_RX_BYTES"]] == [2.0 * 1024 * 1024]
    assert [(lab["GPU_I_ID"], v) for lab, v in fams["DCGM_FI_DEV_SM_CLOCK"]] == [("", 1410.0)]
    assert [v for _, v in fams["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]] == [123456.0]
    assert [v for _, v in fams["DCGM_FI_DEV_MEMORY_TEMP"]] == [40.0]
    assert "DCGM_FI_PROF_SM_ACTIVE" not in fams or fams["DCGM_FI_PROF_SM_ACTIVE"] == []


def test_agent_counters_and_kube_hook() -> None:
    m = Metrics("n")
    hook = m.kube_hook()
    hook("PATCH", 200)
    hook("GET", 503)
    m.reconciles.labels(component="mig", result="success").inc()
    with m.apply_seconds.labels(component="mig").time():
        pass
    fams = _families(m)
    req = {lab["method"]: v for lab, v in fams["nodeagent_kube_api_requests"] if "method" in lab}
    assert req == {"PATCH": 1.0, "GET": 1.0}
    errs = {lab["code"]: v for lab, v in fams["nodeagent_kube_api_errors"] if "code" in lab}
    assert errs == {"503": 1.0}
    assert any(v == 1.0 for lab, v in fams["nodeagent_apply_duration_seconds"] if lab.get("le") == "+Inf")


def test_two_registries_do_not_collide() -> None:
    Metrics("a")
    Metrics("b")  # would raise "Duplicated timeseries" on a shared registry


def test_scrape_over_http() -> None:
    m = Metrics("node-z")
    m.update_gpus(INV, {0: GpuSample(gpu_util=12)})
    server = m.serve("127.0.0.1:0")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.stop()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = fams["DCGM_FI_DEV_GPU_UTIL"].samples
    assert sample.value == 12.0 and sample.labels["Hostname"] == "node-z"


def test_readings_from_the_nvml_adapter_on_the_simulator() -> None:
    from nodeagent.nvmlsource import open_nvml

    nvml = open_nvml("dgx-a100-40gb")
    try:
        inv = nvml.discover()
        m = Metrics("sim-node")
        m.update_gpus(inv, {g.index: nvml.metrics(g.index) for g in inv.gpus})
    finally:
        nvml.close()
    fams = _families(m)
    assert len(fams["DCGM_FI_DEV_FB_FREE"]) == 8
    total = {lab["gpu"]: v for lab, v in fams["DCGM_FI_DEV_FB_FREE"]}
    used = {lab["gpu"]: v for lab, v in fams["DCGM_FI_DEV_FB_USED"]}
    assert all(total[k] + used[k] == 40960 for k in total)
    assert {lab["modelName"] for lab, _ in fams["DCGM_FI_DEV_GPU_TEMP"]} == {"NVIDIA A100-SXM4-40GB"}


def test_reconcile_and_publish_observers() -> None:
    from nodeagent.kube.gpuobjects import SyncResult
    from nodeagent.kube.publisher import PublishResult

    m = Metrics("n")
    m.observe_reconcile("mig", "success", 0.2)
    m.observe_reconcile("mig", "failed", 0.01)
    m.count_publish(PublishResult(metadata_writes=1, status_writes=1, gpu_objects=SyncResult(created=["a"])).by_target())
    m.count_publish(PublishResult().by_target())
    fams = _families(m)
    rec = {(lab["component"], lab["result"]): v for lab, v in fams["nodeagent_reconciles"] if "result" in lab}
    assert rec == {("mig", "success"): 1.0, ("mig", "failed"): 1.0}
    assert any(lab.get("le") == "+Inf" and v == 2.0 for lab, v in fams["nodeagent_apply_duration_seconds"])
    writes = {lab["target"]: v for lab, v in fams["nodeagent_publish_writes"] if "target" in lab}
    assert writes == {"labels": 1.0, "status": 1.0, "gpu_objects": 1.0}  # a new GPU object: one create
