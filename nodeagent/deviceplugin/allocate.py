"""What a container gets for the device IDs the kubelet allocated (pure, no I/O, no gRPC).

The answer depends on ``flags.plugin``: the device-list strategies (environment variable, volume
mounts, CDI annotations, CDI devices over CRI, any combination) and ``passDeviceSpecs``. Replica IDs
are mapped back to their physical device first; a container asking for two replicas of one GPU
sees that GPU once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from nodeagent.cdi.host import Mount
from nodeagent.cdi.names import qualified_name
from nodeagent.errors import InputError
from nodeagent.gpu.mps import PIPE_ENV, SHM_DIR
from nodeagent.logs import cut
from nodeagent.sharing.devices import PhysicalDevice, Resource
from nodeagent.sharing.spec import PluginFlags

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
IMEX_CHANNELS_ENV = "NVIDIA_IMEX_CHANNELS"
IMEX_CDI_KIND = "nvidia.com/imex-channel"
VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")

# /proc/driver/nvidia-caps/mig-minors numbering: "config" 1, "monitor" 2, then per GPU 15 GPU
# instances, each with its own access node followed by 8 compute-instance access nodes.
_CAPS_FIRST = 3
_CAPS_PER_GI = 9
_CAPS_PER_GPU = 15 * _CAPS_PER_GI


class AllocationError(InputError):
    """The kubelet asked for something this resource cannot give (gRPC INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class DeviceNode:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class ContainerAllocation:
    """One container's share of an AllocateResponse."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    devices: tuple[DeviceNode, ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()


def mig_cap_minors(gpu_minor: int, gi_id: int, ci_id: int) -> tuple[int, int]:
    """Minor numbers of ``nvidia-cap<N>`` granting access to a GPU instance and its compute instance."""
    gi = _CAPS_FIRST + gpu_minor * _CAPS_PER_GPU + gi_id * _CAPS_PER_GI
    return gi, gi + 1 + ci_id


MAX_LISTED = 256  # characters of the requested IDs an error message quotes


def _listed(ids: Sequence[str]) -> str:
    """The IDs for an error message, at most ``MAX_LISTED`` characters of them (a request may hold megabytes)."""
    shown: list[str] = []
    length = 0
    for i in ids:
        if length > MAX_LISTED:
            break
        shown.append(cut(i, MAX_LISTED))
        length += len(shown[-1]) + 2
    text = cut(", ".join(shown), MAX_LISTED)
    return text if len(shown) == len(ids) else f"{text} (and {len(ids) - len(shown)} more)"


def physical_devices(resource: Resource, device_ids: Sequence[str]) -> list[PhysicalDevice]:
    """Validate requested IDs against what was advertised; distinct physical devices in request order."""
    if not device_ids:
        raise AllocationError(f"empty allocation request for {resource.name}", subject=resource.name)
    known = resource.by_id()
    unknown = [i for i in device_ids if i not in known]
    if unknown:
        raise AllocationError(
            f"device(s) {_listed(unknown)} were never advertised for {resource.name}", subject=resource.name
        )
    if resource.fail_requests_greater_than_one and len(device_ids) > 1:
        raise AllocationError(
            f"request for {len(device_ids)} devices of shared resource {resource.name} "
            f"({_listed(device_ids)}): failRequestsGreaterThanOne allows 1 per container",
            subject=resource.name,
        )
    out: list[PhysicalDevice] = []
    for i in device_ids:
        phys = known[i].physical
        if phys not in out:
            out.append(phys)
    return out


def _device_nodes(devices: Sequence[PhysicalDevice]) -> tuple[DeviceNode, ...]:
    nodes = [DeviceNode(p, p) for p in CONTROL_DEVICES]
    seen: set[str] = set()
    for d in devices:
        path = f"/dev/nvidia{d.gpu.minor_number}"
        if path not in seen:
            seen.add(path)
            nodes.append(DeviceNode(path, path))
    for d in devices:
        if d.mig is None:
            continue
        for minor in mig_cap_minors(d.gpu.minor_number, d.mig.gi_id, d.mig.ci_id):
            path = f"/dev/nvidia-caps/nvidia-cap{minor}"
            if path not in seen:
                seen.add(path)
                nodes.append(DeviceNode(path, path))
    return tuple(nodes)


def cdi_annotation_key(prefix: str, device_ids: Sequence[str]) -> str:
    """A stable annotation key per request (NVIDIA uses a random one; a digest keeps this pure)."""
    digest = hashlib.sha256(",".join(device_ids).encode()).hexdigest()[:16]
    return f"{prefix}nodeagent-device-plugin_{digest}"


def container_allocation(
    resource: Resource, flags: PluginFlags, device_ids: Sequence[str]
) -> ContainerAllocation:
    """The response for one container request."""
    devices = physical_devices(resource, device_ids)
    ids = [d.id for d in devices]
    strategies = flags.device_list_strategy
    envs: dict[str, str] = {}
    mounts: list[Mount] = []
    annotations: dict[str, str] = {}
    cdi: list[str] = []
    if "envvar" in strategies:
        envs[VISIBLE_DEVICES_ENV] = ",".join(ids)
    if "volume-mounts" in strategies:
        envs[VISIBLE_DEVICES_ENV] = VOLUME_MOUNT_ROOT
        mounts.extend(Mount(f"{VOLUME_MOUNT_ROOT}/{i}", "/dev/null") for i in ids)
    # The names nodeagent's CDI spec (nodeagent.cdi) gives these devices: index "0" / "0:1" or UUID.
    cdi_names = [qualified_name(i) for i in ids]
    if "cdi-annotations" in strategies:
        annotations[cdi_annotation_key(flags.cdi_annotation_prefix, device_ids)] = ",".join(cdi_names)
    if "cdi-cri" in strategies:
        cdi.extend(cdi_names)
    channels = flags.imex_channels  # the plugin config's imex.channelIDs, in every container (as NVIDIA's plugin)
    if channels:
        numbers = [str(c.number) for c in channels]
        if "envvar" in strategies:
            envs[IMEX_CHANNELS_ENV] = ",".join(numbers)
        if "volume-mounts" in strategies:
            mounts.extend(Mount(f"{VOLUME_MOUNT_ROOT}/imex/{n}", "/dev/null") for n in numbers)
        imex_names = [f"{IMEX_CDI_KIND}={n}" for n in numbers]
        if "cdi-annotations" in strategies:
            key = cdi_annotation_key(flags.cdi_annotation_prefix, device_ids)
            annotations[key] = ",".join([*cdi_names, *imex_names])
        if "cdi-cri" in strategies:
            cdi.extend(imex_names)
    if resource.mps is not None:  # the control daemon's pipe directory and the shared memory it uses
        envs[PIPE_ENV] = resource.mps.pipe_dir
        mounts.append(Mount(resource.mps.pipe_dir, resource.mps.pipe_dir_on_host, read_only=False))
        mounts.append(Mount(SHM_DIR, resource.mps.shm_on_host, read_only=False))
    return ContainerAllocation(
        envs=envs,
        mounts=tuple(mounts),
        devices=(_device_nodes(devices) + tuple(DeviceNode(c.path, c.host_path) for c in channels)
                 if flags.pass_device_specs else ()),
        annotations=annotations,
        cdi_devices=tuple(cdi),
    )


def allocate(
    resource: Resource, flags: PluginFlags, requests: Sequence[Sequence[str]]
) -> list[ContainerAllocation]:
    """Every container of one AllocateRequest; any bad container fails the whole request."""
    return [container_allocation(resource, flags, ids) for ids in requests]
