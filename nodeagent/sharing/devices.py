"""Inventory + plugin config → the resources to advertise and their devices (pure, no I/O).

Resource names follow NVIDIA's plugin (``nvidia.com/gpu``, ``nvidia.com/mig-1g.10gb``, ``+`` → ``.``),
and time-slicing / MPS replicas are ``<id>::<n>``. Unlike NVIDIA's plugin, a sharing entry's
``devices`` and ``rename`` are honoured, so each GPU (or MIG device) can carry its own replica count
and resource name. Every advertised ID maps back to one physical device for Allocate.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

from nodeagent.boundedyaml import plain
from nodeagent.errors import ConfigError
from nodeagent.gpu.inventory import Gpu, Inventory, MigDevice
from nodeagent.sharing.spec import (
    MAX_ADVERTISED_DEVICES,
    RESOURCE_PREFIX,
    PluginConfig,
    ReplicatedResource,
    resource_name_problem,
)

GPU_RESOURCE = RESOURCE_PREFIX + "gpu"
REPLICA_SEPARATOR = "::"
MAX_ID_LENGTH = 63


@dataclass(frozen=True)
class PhysicalDevice:
    """A whole GPU or one MIG device, as the container runtime must see it."""

    gpu: Gpu
    mig: MigDevice | None
    id: str  # ID under the configured deviceIDStrategy (uuid, or index "0" / "0:1")

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig else self.gpu.uuid

    @property
    def gpu_index(self) -> int:
        return self.gpu.index

    @property
    def numa_node(self) -> int | None:
        return self.gpu.numa_node


@dataclass(frozen=True)
class AdvertisedDevice:
    """One device ID the kubelet sees; ``replica`` is None when the device is not shared."""

    id: str
    physical: PhysicalDevice
    replica: int | None = None

    @property
    def numa_node(self) -> int | None:
        return self.physical.numa_node


@dataclass(frozen=True)
class MpsAccess:
    """What a container of an MPS resource gets besides its devices: the daemon's pipe directory and the
    host's shared memory, both mounted, and the pipe directory in its environment."""

    pipe_dir: str  # the path as the host names it (the same path inside the container)
    pipe_dir_on_host: str  # the path the kubelet mounts (under --root in a sandbox)
    shm_on_host: str


@dataclass(frozen=True)
class Resource:
    """One extended resource and its devices, in advertising order."""

    name: str
    devices: tuple[AdvertisedDevice, ...]
    sharing: str = "none"  # none | time-slicing | mps
    fail_requests_greater_than_one: bool = False
    mps: MpsAccess | None = None  # how containers reach this resource's MPS control daemon (sharing "mps")

    def device(self, device_id: str) -> AdvertisedDevice | None:
        for d in self.devices:
            if d.id == device_id:
                return d
        return None

    def by_id(self) -> dict[str, AdvertisedDevice]:
        return {d.id: d for d in self.devices}

    def gpu_indices(self) -> frozenset[int]:
        return frozenset(d.physical.gpu_index for d in self.devices)


def mig_resource_suffix(profile: str) -> str:
    """``1g.10gb+me`` → ``mig-1g.10gb.me``."""
    return "mig-" + profile.replace("+", ".")


def _mig_index(gpu: Gpu, mig: MigDevice) -> int:
    ordered = sorted(gpu.mig_devices, key=lambda m: (m.gi_id, m.ci_id))
    return ordered.index(mig)


def _physical(gpu: Gpu, mig: MigDevice | None, id_strategy: str) -> PhysicalDevice:
    if id_strategy == "index":
        ident = f"{gpu.index}:{_mig_index(gpu, mig)}" if mig else str(gpu.index)
    else:
        ident = mig.uuid if mig else gpu.uuid
    return PhysicalDevice(gpu=gpu, mig=mig, id=ident)


def _gpu_resource_name(gpu: Gpu, config: PluginConfig) -> str:
    for p in config.gpu_patterns:
        if fnmatch.fnmatchcase(gpu.name, p.pattern):
            return p.name
    return GPU_RESOURCE


def _mig_resource_name(profile: str, config: PluginConfig) -> str:
    for p in config.mig_patterns:
        if fnmatch.fnmatchcase(profile, p.pattern):
            return p.name
    return RESOURCE_PREFIX + mig_resource_suffix(profile)


def base_resources(
    inventory: Inventory, config: PluginConfig, *, withdrawn: Iterable[int] = ()
) -> dict[str, list[PhysicalDevice]]:
    """Resource name → physical devices before sharing, per ``flags.migStrategy``."""
    skip = set(withdrawn)
    gpus = [g for g in sorted(inventory.gpus, key=lambda g: g.index) if g.index not in skip]
    strategy = config.flags.mig_strategy
    id_strategy = config.flags.plugin.device_id_strategy
    out: dict[str, list[PhysicalDevice]] = {}

    def add(name: str, dev: PhysicalDevice) -> None:
        out.setdefault(name, []).append(dev)

    if strategy == "none":
        for g in gpus:
            add(_gpu_resource_name(g, config), _physical(g, None, id_strategy))
        return out

    if strategy == "single":
        mig_on = [g for g in gpus if g.mig_current]
        if mig_on and len(mig_on) != len(gpus):
            off = ", ".join(str(g.index) for g in gpus if not g.mig_current)
            raise ConfigError(
                f"migStrategy single: GPU(s) {off} have MIG disabled while others have it enabled",
                subject="flags.migStrategy",
            )
        profiles = sorted({m.profile for g in mig_on for m in g.mig_devices})
        if len(profiles) > 1:
            raise ConfigError(
                f"migStrategy single: MIG devices must all have one profile, found {', '.join(profiles)}",
                subject="flags.migStrategy",
            )
        for g in gpus:
            if g.mig_current:
                for m in sorted(g.mig_devices, key=lambda m: (m.gi_id, m.ci_id)):
                    add(GPU_RESOURCE, _physical(g, m, id_strategy))
            else:
                add(_gpu_resource_name(g, config), _physical(g, None, id_strategy))
        return out

    # mixed
    for g in gpus:
        if g.mig_current:
            for m in sorted(g.mig_devices, key=lambda m: (m.gi_id, m.ci_id)):
                add(_mig_resource_name(m.profile, config), _physical(g, m, id_strategy))
        else:
            add(_gpu_resource_name(g, config), _physical(g, None, id_strategy))
    return out


def _entry_label(config: PluginConfig, entry: ReplicatedResource) -> str:
    section = "timeSlicing" if config.sharing.strategy == "time-slicing" else "mps"
    return f"{config.source}: sharing.{section}.resources[{entry.position}] ({entry.name})"


def _select(entry: ReplicatedResource, devices: list[PhysicalDevice], config: PluginConfig) -> list[PhysicalDevice]:
    sel = entry.devices
    if sel.all:
        return list(devices)
    if sel.count is not None:
        if sel.count > len(devices):
            raise ConfigError(
                f"{_entry_label(config, entry)}: devices: {sel.count} but only {len(devices)} device(s) exist",
                subject=entry.name,
            )
        return devices[: sel.count]
    # every name a reference may use → the devices it selects (one pass, not one scan per reference)
    by_ref: dict[str, list[PhysicalDevice]] = {}
    for d in devices:
        names = {d.uuid, d.id, str(d.gpu.index), d.gpu.uuid}
        if d.mig is not None:
            names.add(f"{d.gpu.index}:{_mig_index(d.gpu, d.mig)}")
        for n in names:
            by_ref.setdefault(n, []).append(d)
    chosen: dict[str, PhysicalDevice] = {}
    for ref in sel.refs:
        hits = by_ref.get(ref)
        if not hits:
            raise ConfigError(
                f"{_entry_label(config, entry)}: device {plain(ref)} does not exist in {entry.name}", subject=entry.name
            )
        for h in hits:
            chosen.setdefault(h.id, h)
    return list(chosen.values())


def mps_max_clients(gpu: Gpu) -> int:
    """Client contexts one MPS server accepts on this GPU: 48 from compute capability 7.5 on, else 16 (the
    bound NVIDIA's MPS control daemon checks replicas against)."""
    return 48 if (gpu.compute_major, gpu.compute_minor) >= (7, 5) else 16


def _check_mps_device(config: PluginConfig, entry: ReplicatedResource, dev: PhysicalDevice) -> None:
    if dev.mig is not None:
        raise ConfigError(
            f"{_entry_label(config, entry)}: device {dev.id} is a MIG device; MPS shares whole GPUs only "
            "(use flags.migStrategy none, or time-slicing for MIG devices)",
            subject=entry.name,
        )
    _check_mps_replicas(config, entry, dev.gpu)


def _check_mps_replicas(config: PluginConfig, entry: ReplicatedResource, gpu: Gpu) -> None:
    limit = mps_max_clients(gpu)
    if entry.replicas > limit:
        raise ConfigError(
            f"{_entry_label(config, entry)}: replicas {entry.replicas} is more than the {limit} clients one MPS "
            f"server accepts on GPU {gpu.index} ({gpu.name}, compute capability "
            f"{gpu.compute_major}.{gpu.compute_minor})",
            subject=entry.name,
        )


def check_mps_replicas(inventory: Inventory, config: PluginConfig) -> None:
    """Refuse (``ConfigError``, as ``build_resources`` would) MPS replicas beyond what one MPS server accepts
    on a GPU the entry selects. A GPU's compute capability never changes, so such a config can never be
    served on this node, whatever the MIG layout: the agent refuses it at start and on reload instead of
    retrying its device plugin for ever. What depends on the layout (MIG devices, missing devices) is left
    to ``build_resources``."""
    if config.sharing.strategy != "mps":
        return
    try:
        base = base_resources(inventory, config)
    except ConfigError:
        return  # a MIG layout problem: the device plugin reports it (and the layout may change)
    for entry in config.sharing.resources:
        try:
            selected = _select(entry, base.get(entry.name, []), config)
        except ConfigError:
            continue
        for dev in selected:
            if dev.mig is None:
                _check_mps_replicas(config, entry, dev.gpu)


def _check_id(device_id: str, resource: str) -> str:
    if len(device_id) > MAX_ID_LENGTH:
        raise ConfigError(f"device ID {device_id} of {resource} is longer than {MAX_ID_LENGTH} characters")
    return device_id


def build_resources(
    inventory: Inventory, config: PluginConfig, *, withdrawn: Iterable[int] = ()
) -> dict[str, Resource]:
    """Every resource to advertise (sorted by name), with sharing applied per device."""
    base = base_resources(inventory, config, withdrawn=withdrawn)
    sharing = config.sharing
    # For each (resource, physical id): (replicas, target resource name)
    plan: dict[str, dict[str, tuple[int, str]]] = {}
    for entry in sharing.resources:
        devices = base.get(entry.name)
        if devices is None:
            if entry.devices.all:
                continue  # sharing a resource this node does not have is not an error (same config fleet-wide)
            raise ConfigError(
                f"{_entry_label(config, entry)}: this node has no {entry.name} devices", subject=entry.name
            )
        target = entry.rename or (entry.name + ".shared" if sharing.rename_by_default else entry.name)
        if target != entry.name and target in base:
            raise ConfigError(
                f"{_entry_label(config, entry)}: rename {target} is the name of another resource of this node; "
                "choose a name no other resource has",
                subject=entry.name,
            )
        per = plan.setdefault(entry.name, {})
        for dev in _select(entry, devices, config):
            if sharing.strategy == "mps":
                _check_mps_device(config, entry, dev)
            if dev.id in per:
                raise ConfigError(
                    f"{_entry_label(config, entry)}: device {dev.id} is already shared by another entry",
                    subject=entry.name,
                )
            per[dev.id] = (entry.replicas, target)

    total = sum(plan.get(name, {}).get(dev.id, (1, ""))[0] for name, devs in base.items() for dev in devs)
    if total > MAX_ADVERTISED_DEVICES:
        raise ConfigError(
            f"{config.source}: the config advertises {total} devices, more than the {MAX_ADVERTISED_DEVICES} "
            "accepted on one node; lower the replicas",
            subject=config.source,
        )
    collected: dict[str, list[AdvertisedDevice]] = {}
    shared_names: set[str] = set()
    for name, devices in base.items():
        per = plan.get(name, {})
        for dev in devices:
            if dev.id in per:
                replicas, target = per[dev.id]
                shared_names.add(target)
                collected.setdefault(target, []).extend(
                    AdvertisedDevice(id=_check_id(f"{dev.id}{REPLICA_SEPARATOR}{n}", target), physical=dev, replica=n)
                    for n in range(replicas)
                )
            else:
                collected.setdefault(name, []).append(AdvertisedDevice(id=_check_id(dev.id, name), physical=dev))

    out: dict[str, Resource] = {}
    for name in sorted(collected):
        problem = resource_name_problem(name)
        if problem is not None:
            raise ConfigError(f"{config.source}: resource {name[:80]!r} is {problem}", subject=name[:80])
        shared = name in shared_names
        out[name] = Resource(
            name=name,
            devices=tuple(collected[name]),
            sharing=sharing.strategy if shared else "none",
            fail_requests_greater_than_one=shared and sharing.fail_requests_greater_than_one,
        )
    return out


def device_gpus(inventory: Inventory, config: PluginConfig, gpu_indices: frozenset[int], *,
                excluded: Iterable[int] = ()) -> dict[tuple[str, str], int]:
    """(resource, device ID) → GPU index of every device ``build_resources`` gives these GPUs (nothing
    withdrawn): the IDs a pod may hold, whether or not they are advertised right now."""
    resources = build_resources(inventory, config, withdrawn=excluded)
    return {(r.name, d.id): d.physical.gpu_index for r in resources.values() for d in r.devices
            if d.physical.gpu_index in gpu_indices}


def resource_ids(resources: dict[str, Resource]) -> dict[str, list[str]]:
    """Resource name → advertised IDs (the shape ``served_resources`` reports)."""
    return {name: [d.id for d in r.devices] for name, r in resources.items()}
