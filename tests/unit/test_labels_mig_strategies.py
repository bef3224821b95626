"""gpu.* and mig-* labels per MIG strategy, checked against what gpu-feature-discovery computes.

The expectations follow the behaviour of NVIDIA's labelers (k8s-device-plugin internal/lm:
``newGPULabelers``, ``newMigStrategySingleLabeler``, ``newMigStrategyMixedLabeler``, ``resourceLabeler``):
- ``gpu.count`` counts physical GPUs of the labelled product under every strategy, MIG mode or not,
  except ``single`` with a uniform MIG layout (then it counts MIG devices) or an invalid one (0);
- GPUs in MIG mode carry no sharing (``gpu.replicas`` 0) unless a GPU without MIG describes the node;
- ``single`` with GPUs in and out of MIG mode, an empty MIG GPU, or two profiles → ``-MIG-INVALID``;
- ``mixed`` adds ``mig-<profile>.{count,replicas,sharing-strategy,product,memory,slices.*}``.
"""

from __future__ import annotations

import pytest

from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice, MigProfile
from nodeagent.kube.labels import SharingFacts, desired_labels, gpu_family, sharing_facts
from nodeagent.sharing.spec import parse_plugin_config

P = "nvidia.com/"
MODEL = "NVIDIA-A100-SXM4-40GB"
PROFILES = (
    MigProfile("1g.5gb", 0, 19, 1, 4864, 7, (0, 1, 2, 3, 4, 5, 6), 1),
    MigProfile("1g.5gb+me", 0, 20, 1, 4864, 1, (0, 1, 2, 3, 4, 5, 6), 1),
    MigProfile("3g.20gb", 2, 9, 3, 19968, 2, (0, 4), 4),
)
GPU_KEYS = ("product", "count", "replicas", "memory", "sharing-strategy")


def dev(g: int, gi: int, profile: str = "1g.5gb") -> MigDevice:
    mem = 19968 if profile.startswith("3g") else 4864
    return MigDevice(g, gi, 0, profile, gi, 1, mem, f"MIG-{g}-{gi}")


def gpu(i: int, *devs: MigDevice, mig: bool | None = None, name: str = "NVIDIA A100-SXM4-40GB",
        cc: tuple[int, int] = (8, 0)) -> Gpu:
    return Gpu(i, f"GPU-{i}", name, f"00000000:{i + 7:02X}:00.0", 0x20B010DE, 40960, 0, cc[0], cc[1], i,
               "ampere", mig_capable=True, mig_current=bool(devs) if mig is None else mig,
               mig_profiles=PROFILES, mig_devices=devs)


def gpu_labels(*gpus: Gpu, mig: str = "none", **kw: object) -> dict[str, str]:
    labels = desired_labels(Inventory("535.161.08", 12020, gpus), SharingFacts(mig_strategy=mig, **kw))  # type: ignore[arg-type]
    return {k[len(P + "gpu."):]: v for k, v in labels.items() if k.startswith(P + "gpu.") and
            k[len(P + "gpu."):] in GPU_KEYS}


def mig_labels(*gpus: Gpu, **kw: object) -> dict[str, str]:
    labels = desired_labels(Inventory("535.161.08", 12020, gpus), SharingFacts(mig_strategy="mixed", **kw))  # type: ignore[arg-type]
    return {k: v for k, v in labels.items() if k.startswith(P + "mig-")}


FULL = {"product": MODEL, "replicas": "1", "memory": "40960", "sharing-strategy": "none"}
SHARED = {"product": MODEL + "-SHARED", "replicas": "2", "memory": "40960", "sharing-strategy": "time-slicing"}
MIG_PARENT = {"product": MODEL, "replicas": "0", "memory": "40960", "sharing-strategy": "none"}
INVALID = {"product": MODEL + "-MIG-INVALID", "count": "0", "replicas": "0", "memory": "0"}
TS = {"strategy": "time-slicing", "replicas": 2}


@pytest.mark.parametrize("strategy", ["none", "single", "mixed"])
def test_no_gpu_in_mig_mode_is_the_same_under_every_strategy(strategy: str) -> None:
    assert gpu_labels(gpu(0), gpu(1), mig=strategy) == {**FULL, "count": "2"}
    assert gpu_labels(gpu(0), gpu(1), mig=strategy, **TS) == {**SHARED, "count": "2"}


@pytest.mark.parametrize("strategy", ["none", "mixed"])
def test_all_gpus_in_mig_mode_count_physical_gpus_without_sharing(strategy: str) -> None:
    gpus = (gpu(0, dev(0, 1), dev(0, 2)), gpu(1, dev(1, 1)))
    assert gpu_labels(*gpus, mig=strategy, **TS) == {**MIG_PARENT, "count": "2"}


@pytest.mark.parametrize("strategy", ["none", "mixed"])
def test_some_gpus_in_mig_mode_the_full_gpu_describes_the_node(strategy: str) -> None:
    gpus = (gpu(0, dev(0, 1)), gpu(1))
    assert gpu_labels(*gpus, mig=strategy) == {**FULL, "count": "2"}
    assert gpu_labels(*gpus, mig=strategy, **TS) == {**SHARED, "count": "2"}


def test_mig_mode_without_devices_still_counts_as_a_gpu_under_mixed() -> None:
    assert gpu_labels(gpu(0, mig=True), gpu(1, dev(1, 3)), mig="mixed") == {**MIG_PARENT, "count": "2"}
    assert mig_labels(gpu(0, mig=True), gpu(1, dev(1, 3))) == {
        P + "mig-1g.5gb.count": "1", P + "mig-1g.5gb.replicas": "1", P + "mig-1g.5gb.sharing-strategy": "none",
        P + "mig-1g.5gb.product": MODEL + "-MIG-1g.5gb", P + "mig-1g.5gb.memory": "4864",
        P + "mig-1g.5gb.slices.gi": "1", P + "mig-1g.5gb.slices.ci": "1",
    }


def test_single_uniform_mig_describes_the_mig_device() -> None:
    gpus = (gpu(0, *(dev(0, i) for i in range(7))), gpu(1, *(dev(1, i) for i in range(7))))
    labels = desired_labels(Inventory("535.161.08", 12020, gpus), SharingFacts(mig_strategy="single"))
    assert {k: labels[P + "gpu." + k] for k in GPU_KEYS} == {
        "product": MODEL + "-MIG-1g.5gb", "count": "14", "replicas": "1", "memory": "4864", "sharing-strategy": "none"}
    assert labels[P + "gpu.slices.gi"] == labels[P + "gpu.slices.ci"] == "1"
    assert labels[P + "gpu.family"] == "ampere" and labels[P + "gpu.compute.major"] == "8"
    assert not [k for k in labels if k.startswith(P + "mig-")]
    shared = gpu_labels(*gpus, mig="single", **TS)
    assert shared["product"] == MODEL + "-MIG-1g.5gb-SHARED" and shared["replicas"] == "2"
    assert shared["sharing-strategy"] == "time-slicing" and shared["count"] == "14"


@pytest.mark.parametrize(
    "gpus",
    [
        (gpu(0, dev(0, 1)), gpu(1)),  # MIG and full GPUs together
        (gpu(0, dev(0, 1), dev(0, 2, "3g.20gb")),),  # two profiles
        (gpu(0, dev(0, 1)), gpu(1, mig=True)),  # a GPU in MIG mode without devices
        (gpu(0, mig=True),),
    ],
    ids=["mig-and-full", "two-profiles", "one-empty", "only-empty"],
)
def test_single_with_a_layout_it_cannot_serve_is_marked_invalid(gpus: tuple[Gpu, ...]) -> None:
    got = gpu_labels(*gpus, mig="single")
    assert {k: got[k] for k in INVALID} == INVALID
    labels = desired_labels(Inventory("535.161.08", 12020, gpus), SharingFacts(mig_strategy="single"))
    assert P + "gpu.slices.gi" not in labels
    assert labels[P + "gpu.family"] == "ampere"  # the physical-GPU facts stay


def test_single_without_mig_mode_is_plain() -> None:
    labels = desired_labels(Inventory("535.161.08", 12020, (gpu(0),)), SharingFacts(mig_strategy="single"))
    assert labels[P + "mig.strategy"] == "single"
    assert labels[P + "gpu.product"] == MODEL and labels[P + "gpu.count"] == "1"


def test_mixed_profile_labels_use_the_resource_form_and_per_profile_sharing() -> None:
    gpus = (gpu(0, dev(0, 1, "1g.5gb+me"), dev(0, 2), dev(0, 3)), gpu(1, dev(1, 1, "3g.20gb")))
    cfg = parse_plugin_config(
        "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/mig-1g.5gb\n      replicas: 4\n",
        source="t.yaml",
    )
    labels = desired_labels(Inventory("535.161.08", 12020, gpus), sharing_facts(cfg))
    assert labels[P + "mig-1g.5gb.me.count"] == "1"
    assert labels[P + "mig-1g.5gb.me.product"] == MODEL + "-MIG-1g.5gb.me"
    assert labels[P + "mig-1g.5gb.count"] == "2"
    assert labels[P + "mig-1g.5gb.replicas"] == "4"
    assert labels[P + "mig-1g.5gb.sharing-strategy"] == "time-slicing"
    assert labels[P + "mig-1g.5gb.product"] == MODEL + "-MIG-1g.5gb-SHARED"
    assert labels[P + "mig-3g.20gb.slices.gi"] == "3" and labels[P + "mig-3g.20gb.memory"] == "19968"
    assert labels[P + "mig-3g.20gb.replicas"] == "1"
    assert labels[P + "gpu.count"] == "2" and labels[P + "gpu.replicas"] == "0"


def test_count_is_per_labelled_product_on_mixed_models() -> None:
    l4 = gpu(2, name="NVIDIA L4", cc=(8, 9))
    got = gpu_labels(gpu(0, dev(0, 1)), gpu(1, dev(1, 1)), l4, mig="mixed")
    assert got["product"] == "NVIDIA-L4" and got["count"] == "1"  # the GPU without MIG describes the node


@pytest.mark.parametrize(
    ("cc", "family"),
    [((7, 0), "volta"), ((7, 5), "turing"), ((8, 0), "ampere"), ((8, 6), "ampere"), ((8, 9), "ada-lovelace"),
     ((9, 0), "hopper"), ((6, 1), "pascal")],
)
def test_family_from_compute_capability(cc: tuple[int, int], family: str) -> None:
    assert gpu_family(gpu(0, cc=cc)) == family


def test_mps_capable_only_with_mps_and_no_mig() -> None:
    inv = Inventory("535.161.08", 12020, (gpu(0),))
    assert desired_labels(inv, SharingFacts(strategy="mps", replicas=2))[P + "mps.capable"] == "true"
    assert desired_labels(inv, SharingFacts())[P + "mps.capable"] == "false"
    mig = Inventory("535.161.08", 12020, (gpu(0, dev(0, 1)),))
    assert desired_labels(mig, SharingFacts(strategy="mps", replicas=2))[P + "mps.capable"] == "false"
