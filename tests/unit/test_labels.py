"""Node label planning: gpu-feature-discovery keys, network keys, ownership and the one merge patch."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice, MigProfile
from nodeagent.kube.labels import (
    MANAGED_LABELS_ANNOTATION,
    NET_FASTEST_NIC_SPEED,
    NET_RDMA_CAPABLE,
    NET_RDMA_NICS,
    NetFacts,
    SharingFacts,
    desired_labels,
    label_value,
    plan_label_patch,
    sharing_facts,
    valid_label_key,
    valid_label_value,
)
from nodeagent.sharing.spec import parse_plugin_config

P = "nvidia.com/"
A100_PROFILES = (
    MigProfile("1g.5gb", 0, 19, 1, 4864, 7, (0, 1, 2, 3, 4, 5, 6), 1),
    MigProfile("3g.20gb", 2, 9, 3, 19968, 2, (0, 4), 4),
)


def gpu(i: int, *, mig: bool = False, devices: tuple[MigDevice, ...] = ()) -> Gpu:
    return Gpu(
        index=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", name="NVIDIA A100-SXM4-40GB",
        pci_bus_id=f"00000000:{i + 7:02X}:00.0", pci_device_id=0x20B010DE, memory_mib=40960, numa_node=0,
        compute_major=8, compute_minor=0, minor_number=i, architecture="ampere", mig_capable=True,
        mig_current=mig, mig_profiles=A100_PROFILES, mig_devices=devices,
    )


def mig_dev(g: int, gi: int, profile: str, mem: int, start: int) -> MigDevice:
    return MigDevice(g, gi, 0, profile, start, 1, mem, f"MIG-{g}-{gi}-aaaa-bbbb")


def inventory(*gpus: Gpu) -> Inventory:
    return Inventory(driver_version="535.161.08", cuda_driver_version=12020, gpus=gpus)


def test_full_gpus_get_gfd_labels() -> None:
    labels = desired_labels(inventory(gpu(0), gpu(1)), SharingFacts())
    assert labels[P + "gpu.present"] == "true"
    assert labels[P + "gpu.product"] == "NVIDIA-A100-SXM4-40GB"
    assert labels[P + "gpu.count"] == "2"
    assert labels[P + "gpu.memory"] == "40960"
    assert labels[P + "gpu.family"] == "ampere"
    assert labels[P + "gpu.compute.major"] == "8"
    assert labels[P + "gpu.compute.minor"] == "0"
    assert labels[P + "gpu.replicas"] == "1"
    assert labels[P + "gpu.sharing-strategy"] == "none"
    assert labels[P + "mig.capable"] == "true"
    assert labels[P + "mig.strategy"] == "none"
    assert labels[P + "cuda.driver-version.major"] == "535"
    assert labels[P + "cuda.driver-version.minor"] == "161"
    assert labels[P + "cuda.driver-version.revision"] == "08"
    assert labels[P + "cuda.driver-version.full"] == "535.161.08"
    assert labels[P + "cuda.runtime-version.full"] == "12.2"
    assert P + "mig.config" not in labels and P + "mig.config.state" not in labels


def test_time_slicing_marks_product_shared() -> None:
    s = SharingFacts(strategy="time-slicing", replicas=4)
    labels = desired_labels(inventory(gpu(0)), s)
    assert labels[P + "gpu.product"] == "NVIDIA-A100-SXM4-40GB-SHARED"
    assert labels[P + "gpu.replicas"] == "4"
    assert labels[P + "gpu.sharing-strategy"] == "time-slicing"
    renamed = desired_labels(inventory(gpu(0)), SharingFacts(strategy="time-slicing", replicas=4, renamed=True))
    assert renamed[P + "gpu.product"] == "NVIDIA-A100-SXM4-40GB"


def test_sharing_facts_from_plugin_config() -> None:
    cfg = parse_plugin_config(
        "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 3\n",
        source="t.yaml",
    )
    s = sharing_facts(cfg)
    assert (s.mig_strategy, s.strategy, s.replicas, s.renamed) == ("mixed", "time-slicing", 3, False)
    assert sharing_facts(None) == SharingFacts()


def test_mixed_mig_labels_per_profile() -> None:
    g0 = gpu(0, mig=True, devices=(mig_dev(0, 1, "3g.20gb", 19968, 0), mig_dev(0, 2, "3g.20gb", 19968, 4)))
    g1 = gpu(1, mig=True, devices=(mig_dev(1, 7, "1g.5gb", 4864, 0),))
    labels = desired_labels(inventory(g0, g1, gpu(2)), SharingFacts(mig_strategy="mixed"))
    assert labels[P + "mig-3g.20gb.count"] == "2"
    assert labels[P + "mig-3g.20gb.memory"] == "19968"
    assert labels[P + "mig-1g.5gb.count"] == "1"
    assert labels[P + "mig-1g.5gb.slices.gi"] == "1"
    assert labels[P + "gpu.count"] == "3"  # gpu-feature-discovery counts physical GPUs, MIG mode or not
    assert labels[P + "mig.strategy"] == "mixed"


def test_single_mig_labels_describe_the_mig_device() -> None:
    devs = tuple(mig_dev(0, i, "1g.5gb", 4864, i) for i in range(7))
    labels = desired_labels(inventory(gpu(0, mig=True, devices=devs)), SharingFacts(mig_strategy="single"))
    assert labels[P + "gpu.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    assert labels[P + "gpu.count"] == "7"
    assert labels[P + "gpu.memory"] == "4864"


def test_network_labels() -> None:
    labels = desired_labels(inventory(), SharingFacts(), NetFacts(fastest_nic_speed_mbps=200000, rdma_nics=4))
    assert labels == {NET_FASTEST_NIC_SPEED: "200000", NET_RDMA_NICS: "4", NET_RDMA_CAPABLE: "true"}
    none = desired_labels(inventory(), SharingFacts(), NetFacts(None, 0))
    assert none == {NET_RDMA_NICS: "0", NET_RDMA_CAPABLE: "false"}


def test_no_gpus_means_no_gpu_labels() -> None:
    assert desired_labels(inventory(), SharingFacts()) == {}


def test_patch_adds_changes_removes_only_owned_keys() -> None:
    current = {"kubernetes.io/hostname": "n1", P + "gpu.count": "8", P + "gpu.memory": "40960", "team": "a"}
    annotations = {MANAGED_LABELS_ANNOTATION: f"{P}gpu.count,{P}gpu.memory,{P}gpu.old"}
    desired = {P + "gpu.count": "4", P + "gpu.product": "X"}
    p = plan_label_patch(current, annotations, desired)
    assert p.labels == {P + "gpu.count": "4", P + "gpu.product": "X", P + "gpu.memory": None}
    assert p.annotations == {MANAGED_LABELS_ANNOTATION: f"{P}gpu.count,{P}gpu.product"}
    assert "team" not in p.labels and "kubernetes.io/hostname" not in p.labels


def test_patch_is_empty_when_nothing_changed() -> None:
    desired = {P + "gpu.count": "4"}
    p = plan_label_patch(desired, {MANAGED_LABELS_ANNOTATION: P + "gpu.count"}, desired)
    assert not p


def test_foreign_label_with_unowned_key_is_never_removed() -> None:
    # a label we never set (not in the annotation) stays even if we do not want it
    p = plan_label_patch({P + "gpu.count": "2"}, {}, {})
    assert not p


def test_label_value_sanitising() -> None:
    assert label_value("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert label_value("Tesla T4 (rev a1)!") == "Tesla-T4-rev-a1"
    assert len(label_value("x" * 100)) == 63


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=120))
def test_label_value_always_valid(raw: str) -> None:
    assert valid_label_value(label_value(raw))


@settings(max_examples=50, deadline=None)
@given(
    st.dictionaries(st.sampled_from([P + "a", P + "b", P + "c", "x/y"]), st.sampled_from(["1", "2"])),
    st.dictionaries(st.sampled_from([P + "a", P + "b", P + "c"]), st.sampled_from(["1", "2"])),
    st.sets(st.sampled_from([P + "a", P + "b", P + "c"])),
)
def test_patch_reaches_desired_and_spares_foreign(
    current: dict[str, str], desired: dict[str, str], owned: set[str]
) -> None:
    ann = {MANAGED_LABELS_ANNOTATION: ",".join(sorted(owned))} if owned else {}
    p = plan_label_patch(current, ann, desired)
    after = dict(current)
    for k, v in p.labels.items():
        if v is None:
            after.pop(k, None)
        else:
            after[k] = v
    for k, v in desired.items():
        assert after[k] == v
    for k in current:
        if k not in owned and k not in desired:
            assert after[k] == current[k]
    assert all(valid_label_key(k) for k in p.labels)
