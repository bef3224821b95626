"""Node labels from the Inventory (pure): gpu-feature-discovery's keys plus nodeagent's network facts.

``desired_labels`` says what the labels should be; ``plan_label_patch`` compares that with the Node and
returns the one merge patch that gets there, touching only keys nodeagent owns. Ownership is recorded in
the annotation ``nodeagent.io/managed-labels`` (a sorted comma list), so a key nodeagent set earlier and
no longer wants is removed, while labels set by anybody else are never touched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from nodeagent.gpu import fabric
from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice
from nodeagent.sharing.spec import PluginConfig

NVIDIA = "nvidia.com/"
DOMAIN = "nodeagent.io/"
MANAGED_LABELS_ANNOTATION = DOMAIN + "managed-labels"

# nodeagent's own keys (documented in docs/node-publishing.md)
NET_FASTEST_NIC_SPEED = DOMAIN + "net.fastest-nic-speed-mbps"
NET_RDMA_NICS = DOMAIN + "net.rdma-nics"
NET_RDMA_CAPABLE = DOMAIN + "net.rdma-capable"

# Labels nodeagent never writes even if a caller asks: they belong to users or to the MIG reconciler.
RESERVED = frozenset({NVIDIA + "mig.config", NVIDIA + "mig.config.state"})

_VALUE_OK = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_VALUE_BAD_CHARS = re.compile(r"[^-A-Za-z0-9_.]")
_KEY_NAME_OK = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_KEY_PREFIX_OK = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class SharingFacts:
    """What the device-plugin config says about sharing, reduced to what the labels need."""

    mig_strategy: str = "none"  # none | single | mixed
    strategy: str = "none"  # none | time-slicing | mps
    replicas: int = 1  # replicas of whole GPUs (nvidia.com/gpu)
    renamed: bool = False  # the shared resource got another name (no "-SHARED" suffix then)
    mig_replicas: Mapping[str, int] = field(default_factory=dict)  # resource-form profile → replicas
    mig_renamed: frozenset[str] = frozenset()  # resource-form profiles whose shared resource is renamed


@dataclass(frozen=True)
class NetFacts:
    """Network facts for placement by bandwidth (from ``nodeagent.net.nics``)."""

    fastest_nic_speed_mbps: int | None = None
    rdma_nics: int = 0


@dataclass(frozen=True)
class LabelPatch:
    """One merge patch of labels and the ownership annotation; empty when nothing changes."""

    labels: dict[str, str | None] = field(default_factory=dict)
    annotations: dict[str, str | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.labels or self.annotations)


def sharing_facts(cfg: PluginConfig | None) -> SharingFacts:
    """Reduce a device-plugin config to what the labels need."""
    if cfg is None:
        return SharingFacts()
    sh = cfg.sharing
    replicas = 1
    renamed = False
    mig_replicas: dict[str, int] = {}
    mig_renamed: set[str] = set()
    for r in sh.resources:
        is_renamed = bool(r.rename) or sh.rename_by_default
        if r.name == NVIDIA + "gpu":
            replicas = max(replicas, r.replicas)
            renamed = renamed or is_renamed
        elif r.name.startswith(NVIDIA + "mig-"):
            mig_replicas[r.name[len(NVIDIA + "mig-") :]] = r.replicas
            if is_renamed:
                mig_renamed.add(r.name[len(NVIDIA + "mig-") :])
    return SharingFacts(
        mig_strategy=cfg.flags.mig_strategy,
        strategy=sh.strategy if sh.resources else "none",
        replicas=replicas,
        renamed=renamed,
        mig_replicas=mig_replicas,
        mig_renamed=frozenset(mig_renamed),
    )


def label_value(raw: str) -> str:
    """A valid label value from free text: spaces → ``-``, other bad characters dropped, ≤ 63 chars."""
    v = _VALUE_BAD_CHARS.sub("", "-".join(raw.split()))
    v = v[:63]
    v = v.strip("-_.")
    return v


def valid_label_value(v: str) -> bool:
    return len(v) <= 63 and bool(_VALUE_OK.match(v))


def valid_label_key(k: str) -> bool:
    prefix, _, name = k.rpartition("/")
    if prefix and (len(prefix) > 253 or not _KEY_PREFIX_OK.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_KEY_NAME_OK.match(name))


def _product(gpu: Gpu) -> str:
    return label_value(gpu.name)


def _cuda_labels(inv: Inventory) -> dict[str, str]:
    out: dict[str, str] = {}
    parts = inv.driver_version.split(".")
    if inv.driver_version and all(p.isdigit() for p in parts):
        keys = ("major", "minor", "revision")
        for key, part in zip(keys, parts, strict=False):
            out[f"{NVIDIA}cuda.driver-version.{key}"] = part
        out[f"{NVIDIA}cuda.driver-version.full"] = label_value(inv.driver_version)
    if inv.cuda_driver_version > 0:
        major, minor = inv.cuda_version
        out[f"{NVIDIA}cuda.runtime-version.major"] = str(major)
        out[f"{NVIDIA}cuda.runtime-version.minor"] = str(minor)
        out[f"{NVIDIA}cuda.runtime-version.full"] = f"{major}.{minor}"
    return out


def _shared_product(product: str, sharing: SharingFacts, replicas: int, renamed: bool | None = None) -> str:
    is_renamed = sharing.renamed if renamed is None else renamed
    if replicas > 1 and sharing.strategy != "none" and not is_renamed:
        return label_value(product + "-SHARED")
    return product


def resource_profile(profile: str) -> str:
    """The resource-name form of a MIG profile (``1g.10gb+me`` → ``1g.10gb.me``)."""
    return profile.replace("+", ".")


# gpu-feature-discovery derives gpu.family from the CUDA compute capability, not from NVML's architecture
_FAMILY_BY_MAJOR = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper",
                    10: "blackwell", 12: "blackwell"}


def gpu_family(gpu: Gpu) -> str:
    """gpu-feature-discovery's family name (``ada-lovelace`` for 8.9, ``turing`` for 7.5, ...)."""
    major, minor = gpu.compute_major, gpu.compute_minor
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return _FAMILY_BY_MAJOR.get(major) or label_value(gpu.architecture) or "undefined"


def _gpu_resource_labels(gpus: list[Gpu], sharing: SharingFacts) -> dict[str, str]:
    """The ``nvidia.com/gpu.*`` labels of physical GPUs, as gpu-feature-discovery computes them.

    Whatever the MIG strategy, ``gpu.count`` counts the physical GPUs of the labelled product, MIG mode or
    not. GPUs in MIG mode carry no sharing (``gpu.replicas`` 0); when the node also has GPUs without MIG,
    those describe the node (with the configured sharing). Among several products the lowest-indexed GPU
    decides (gpu-feature-discovery picks one at random).
    """
    full = [g for g in gpus if not g.mig_current]
    rep = full[0] if full else gpus[0]
    count = sum(1 for g in gpus if g.name == rep.name)
    p = f"{NVIDIA}gpu."
    if full:
        replicas = max(1, sharing.replicas)
        labels = {
            p + "product": _shared_product(_product(rep), sharing, replicas),
            p + "replicas": str(replicas),
            p + "sharing-strategy": sharing.strategy if replicas > 1 else "none",
        }
    else:
        labels = {p + "product": _product(rep), p + "replicas": "0", p + "sharing-strategy": "none"}
    labels[p + "count"] = str(count)
    if rep.memory_mib > 0:
        labels[p + "memory"] = str(rep.memory_mib)
    if rep.compute_major > 0:
        labels[p + "family"] = gpu_family(rep)
        labels[p + "compute.major"] = str(rep.compute_major)
        labels[p + "compute.minor"] = str(rep.compute_minor)
    return labels


def _mig_attribute_labels(base: str, gpus: list[Gpu], dev: MigDevice) -> dict[str, str]:
    labels = {f"{base}.memory": str(dev.memory_mib)}
    parent = next((g for g in gpus if g.index == dev.gpu_index), None)
    prof = parent.profile(dev.profile) if parent is not None else None
    if prof is not None:
        labels[f"{base}.slices.gi"] = str(prof.slice_count)
        labels[f"{base}.slices.ci"] = str(prof.slice_count)  # nodeagent makes full-size compute instances
    return labels


def _mig_product(gpus: list[Gpu], dev: MigDevice) -> str:
    parent = next((g for g in gpus if g.index == dev.gpu_index), gpus[0])
    return label_value(f"{_product(parent)}-MIG-{resource_profile(dev.profile)}")


def _single_strategy_labels(gpus: list[Gpu], sharing: SharingFacts) -> dict[str, str]:
    """What ``migStrategy: single`` puts over the physical-GPU labels (nothing when no GPU is in MIG mode)."""
    mig_gpus = [g for g in gpus if g.mig_current]
    if not mig_gpus:
        return {}
    p = f"{NVIDIA}gpu."
    devices = [d for g in mig_gpus for d in g.mig_devices]
    profiles = {d.profile for d in devices}
    empty = any(not g.mig_devices for g in mig_gpus)
    if empty or len(mig_gpus) != len(gpus) or len(profiles) != 1:
        # the plugin cannot serve this as one uniform nvidia.com/gpu: gpu-feature-discovery says so
        return {
            p + "product": label_value(f"{_product(mig_gpus[0])}-MIG-INVALID"),
            p + "count": "0",
            p + "replicas": "0",
            p + "memory": "0",
        }
    dev = devices[0]
    replicas = max(1, sharing.replicas)
    labels = {
        p + "product": _shared_product(_mig_product(gpus, dev), sharing, replicas),
        p + "count": str(len(devices)),
        p + "replicas": str(replicas),
        p + "sharing-strategy": sharing.strategy if replicas > 1 else "none",
    }
    labels.update(_mig_attribute_labels(f"{NVIDIA}gpu", gpus, dev))
    return labels


def _mixed_strategy_labels(gpus: list[Gpu], sharing: SharingFacts) -> dict[str, str]:
    """``nvidia.com/mig-<profile>.*`` for every MIG profile present (GPUs in MIG mode without devices add none)."""
    by_profile: dict[str, list[MigDevice]] = {}
    for g in gpus:
        if g.mig_current:
            for d in g.mig_devices:
                by_profile.setdefault(resource_profile(d.profile), []).append(d)
    labels: dict[str, str] = {}
    for prof, devs in sorted(by_profile.items()):
        base = f"{NVIDIA}mig-{prof}"
        reps = max(1, sharing.mig_replicas.get(prof, 1))
        labels[f"{base}.count"] = str(len(devs))
        labels[f"{base}.replicas"] = str(reps)
        labels[f"{base}.sharing-strategy"] = sharing.strategy if reps > 1 else "none"
        labels[f"{base}.product"] = _shared_product(
            _mig_product(gpus, devs[0]), sharing, reps, renamed=prof in sharing.mig_renamed
        )
        labels.update(_mig_attribute_labels(base, gpus, devs[0]))
    return labels


def desired_labels(inv: Inventory, sharing: SharingFacts, net: NetFacts | None = None) -> dict[str, str]:
    """Every label nodeagent wants on the Node for this inventory (pure).

    The ``nvidia.com/gpu.*`` and ``nvidia.com/mig-*`` labels follow gpu-feature-discovery for each MIG
    strategy: physical-GPU labels first, then ``single`` overrides them with the (uniform) MIG device or
    marks the node ``-MIG-INVALID``, and ``mixed`` adds one label group per MIG profile.
    """
    labels: dict[str, str] = {}
    if net is not None:
        if net.fastest_nic_speed_mbps is not None and net.fastest_nic_speed_mbps > 0:
            labels[NET_FASTEST_NIC_SPEED] = str(net.fastest_nic_speed_mbps)
        labels[NET_RDMA_NICS] = str(net.rdma_nics)
        labels[NET_RDMA_CAPABLE] = "true" if net.rdma_nics > 0 else "false"
    gpus = sorted(inv.gpus, key=lambda g: g.index)
    if not gpus:
        return labels
    any_mig = any(g.mig_current for g in gpus)
    labels.update(_cuda_labels(inv))
    labels[f"{NVIDIA}gpu.present"] = "true"
    labels[f"{NVIDIA}mig.capable"] = "true" if any(g.mig_capable for g in gpus) else "false"
    labels[f"{NVIDIA}mig.strategy"] = sharing.mig_strategy
    labels[f"{NVIDIA}mps.capable"] = "true" if sharing.strategy == "mps" and not any_mig else "false"
    labels.update(_gpu_resource_labels(gpus, sharing))
    clique = fabric.decide(inv)
    if clique.value is not None:  # withheld while the fabric is not ready or the GPUs disagree, as GFD does
        labels[fabric.CLIQUE_LABEL] = clique.value
    if sharing.mig_strategy == "single":
        labels.update(_single_strategy_labels(gpus, sharing))
    elif sharing.mig_strategy == "mixed":
        labels.update(_mixed_strategy_labels(gpus, sharing))
    return {k: v for k, v in labels.items() if k not in RESERVED and valid_label_key(k) and valid_label_value(v)}


def parse_managed(annotation: str | None) -> set[str]:
    return {k.strip() for k in (annotation or "").split(",") if k.strip()}


def format_managed(keys: Iterable[str]) -> str:
    return ",".join(sorted(set(keys)))


def plan_label_patch(
    current_labels: Mapping[str, str],
    current_annotations: Mapping[str, str],
    desired: Mapping[str, str],
    *,
    annotation: str = MANAGED_LABELS_ANNOTATION,
) -> LabelPatch:
    """The merge patch from the Node's labels to ``desired`` for the keys nodeagent owns (pure)."""
    owned_before = parse_managed(current_annotations.get(annotation))
    labels: dict[str, str | None] = {}
    for k, v in desired.items():
        if k in RESERVED:
            continue
        if current_labels.get(k) != v:
            labels[k] = v
    for k in sorted(owned_before - set(desired)):
        if k in current_labels and k not in RESERVED:
            labels[k] = None
    annotations: dict[str, str | None] = {}
    want = format_managed(k for k in desired if k not in RESERVED)
    have = current_annotations.get(annotation)
    if want and have != want:
        annotations[annotation] = want
    elif not want and have is not None:
        annotations[annotation] = None
    return LabelPatch(labels=labels, annotations=annotations)
