"""Node labels from the Inventory (pure): gpu-feature-discovery's keys plus nodeagent's network facts.

``desired_labels`` says what the labels should be; ``plan_label_patch`` compares that with the Node and
returns the one merge patch that gets there, touching only keys nodeagent owns. Ownership is recorded in
the annotation ``nodeagent.io/managed-labels`` (a sorted comma list), so a key nodeagent set earlier and
no longer wants is removed, while labels set by anybody else are never touched.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from nodeagent.gpu.inventory import Gpu, Inventory
from nodeagent.sharing.spec import PluginConfig

NVIDIA = "nvidia.com/"
DOMAIN = "nodeagent.io/"
MANAGED_LABELS_ANNOTATION = DOMAIN + "managed-labels"

# nodeagent's own keys (documented in README "Node publishing")
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
    for r in sh.resources:
        is_renamed = bool(r.rename) or sh.rename_by_default
        if r.name == NVIDIA + "gpu":
            replicas = max(replicas, r.replicas)
            renamed = renamed or is_renamed
        elif r.name.startswith(NVIDIA + "mig-"):
            mig_replicas[r.name[len(NVIDIA + "mig-") :]] = r.replicas
    return SharingFacts(
        mig_strategy=cfg.flags.mig_strategy,
        strategy=sh.strategy if sh.resources else "none",
        replicas=replicas,
        renamed=renamed,
        mig_replicas=mig_replicas,
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


def _shared_product(product: str, sharing: SharingFacts, replicas: int) -> str:
    if replicas > 1 and sharing.strategy != "none" and not sharing.renamed:
        return label_value(product + "-SHARED")
    return product


def resource_profile(profile: str) -> str:
    """The resource-name form of a MIG profile (``1g.10gb+me`` → ``1g.10gb.me``)."""
    return profile.replace("+", ".")


def desired_labels(inv: Inventory, sharing: SharingFacts, net: NetFacts | None = None) -> dict[str, str]:
    """Every label nodeagent wants on the Node for this inventory (pure)."""
    labels: dict[str, str] = {}
    if net is not None:
        if net.fastest_nic_speed_mbps is not None and net.fastest_nic_speed_mbps > 0:
            labels[NET_FASTEST_NIC_SPEED] = str(net.fastest_nic_speed_mbps)
        labels[NET_RDMA_NICS] = str(net.rdma_nics)
        labels[NET_RDMA_CAPABLE] = "true" if net.rdma_nics > 0 else "false"
    gpus = sorted(inv.gpus, key=lambda g: g.index)
    if not gpus:
        return labels
    first = gpus[0]
    mig_gpus = [g for g in gpus if g.mig_current]
    full_gpus = [g for g in gpus if not g.mig_current]
    replicas = max(1, sharing.replicas)
    labels.update(_cuda_labels(inv))
    labels.update(
        {
            f"{NVIDIA}gpu.present": "true",
            f"{NVIDIA}gpu.family": label_value(first.architecture) or "unknown",
            f"{NVIDIA}gpu.compute.major": str(first.compute_major),
            f"{NVIDIA}gpu.compute.minor": str(first.compute_minor),
            f"{NVIDIA}mig.capable": "true" if any(g.mig_capable for g in gpus) else "false",
            f"{NVIDIA}mig.strategy": sharing.mig_strategy,
            f"{NVIDIA}gpu.sharing-strategy": sharing.strategy if replicas > 1 else "none",
            f"{NVIDIA}gpu.replicas": str(replicas),
        }
    )
    mig_devices = [d for g in mig_gpus for d in g.mig_devices]
    if sharing.mig_strategy == "single" and mig_gpus:
        # every MIG device is advertised as nvidia.com/gpu; describe the (uniform) MIG device
        profiles = Counter(d.profile for d in mig_devices)
        if len(profiles) == 1:
            prof, count = next(iter(profiles.items()))
            dev = mig_devices[0]
            labels[f"{NVIDIA}gpu.product"] = _shared_product(f"{_product(first)}-MIG-{prof}", sharing, replicas)
            labels[f"{NVIDIA}gpu.count"] = str(count + len(full_gpus))
            labels[f"{NVIDIA}gpu.memory"] = str(dev.memory_mib)
            parent = next(g for g in mig_gpus if g.index == dev.gpu_index)
            p = parent.profile(prof)
            if p is not None:
                labels[f"{NVIDIA}gpu.slices.gi"] = str(p.slice_count)
                labels[f"{NVIDIA}gpu.slices.ci"] = str(p.slice_count)
        else:
            # not uniform: the plugin cannot advertise this with the single strategy; say what is there
            labels[f"{NVIDIA}gpu.product"] = _shared_product(_product(first), sharing, replicas)
            labels[f"{NVIDIA}gpu.count"] = str(len(mig_devices) + len(full_gpus))
            labels[f"{NVIDIA}gpu.memory"] = str(first.memory_mib)
    else:
        counted = full_gpus if sharing.mig_strategy == "mixed" else gpus
        labels[f"{NVIDIA}gpu.product"] = _shared_product(_product(first), sharing, replicas)
        labels[f"{NVIDIA}gpu.count"] = str(len(counted))
        labels[f"{NVIDIA}gpu.memory"] = str(first.memory_mib)
    if sharing.mig_strategy == "mixed":
        by_profile: dict[str, list[int]] = {}
        for d in mig_devices:
            by_profile.setdefault(d.profile, []).append(d.memory_mib)
        for prof, mems in sorted(by_profile.items()):
            base = f"{NVIDIA}mig-{resource_profile(prof)}"
            mig_reps = max(1, sharing.mig_replicas.get(resource_profile(prof), 1))
            labels[f"{base}.count"] = str(len(mems))
            labels[f"{base}.memory"] = str(mems[0])
            labels[f"{base}.replicas"] = str(mig_reps)
            labels[f"{base}.sharing-strategy"] = sharing.strategy if mig_reps > 1 else "none"
            labels[f"{base}.product"] = label_value(f"{_product(first)}-MIG-{prof}")
            owner = next((g for g in mig_gpus if g.profile(prof) is not None), None)
            p = owner.profile(prof) if owner is not None else None
            if p is not None:
                labels[f"{base}.slices.gi"] = str(p.slice_count)
                labels[f"{base}.slices.ci"] = str(p.slice_count)
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
