"""IMEX channel devices of nodeagent's DRA driver, as NVIDIA's compute-domain driver models them (pure).

A node whose GPUs are fabric-attached (it carries a ``nvidia.com/gpu.clique`` value) publishes ONE device,
``channel-0``, in its pool, with the attributes ``type`` = "channel", ``id`` = 0 and ``clique`` = the node's
clique (``<cluster uuid>.<clique id>``). A ComputeDomain's ResourceClaimTemplate (made by ``nodeagent
controller``) asks for that device through the DeviceClass ``CHANNEL_CLASS`` and pins the ``clique``
attribute to one clique, so every pod of the domain lands on nodes of one NVLink clique. The claim's opaque
config (NVIDIA's ``ComputeDomainChannelConfig``: ``domainID``, ``allocationMode``) says what the container
gets when the claim is prepared: channel 0 (``Single``) or every channel of the node (``All``), as CDI
``deviceNodes`` entries for ``/dev/nvidia-caps-imex-channels/channel<N>`` (made and described by
``nodeagent.imex.channels``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.devices import DraDevice
from nodeagent.errors import ConfigError
from nodeagent.hostpaths import HostPaths
from nodeagent.imex.channels import DEFAULT_CHANNEL_COUNT, cdi_device_node, ensure_channels

DRIVER = DRIVER_NAME
CHANNEL_CLASS = "imex-channel.nodeagent.io"
CHANNEL_DEVICE = "channel-0"
CHANNEL_TYPE = "channel"
CLIQUE_ATTR = "clique"
CLIQUE_LABEL = "nvidia.com/gpu.clique"
# NVIDIA's opaque claim config for a channel (resource.nvidia.com/v1beta1), read unchanged
CONFIG_API_VERSION = "resource.nvidia.com/v1beta1"
CONFIG_KIND = "ComputeDomainChannelConfig"
SINGLE, ALL = "Single", "All"


def channel_device(clique: str) -> dict[str, Any]:
    """The ResourceSlice device entry of a node in ``clique``."""
    return {
        "name": CHANNEL_DEVICE,
        "attributes": {
            "type": {"string": CHANNEL_TYPE},
            "id": {"int": 0},
            CLIQUE_ATTR: {"string": clique},
        },
    }


def clique_selector(clique: str) -> str:
    """The CEL selector that keeps a channel request to the devices of ``clique``."""
    quoted = clique.replace("\\", "\\\\").replace('"', '\\"')
    return f'device.attributes["{DRIVER}"].{CLIQUE_ATTR} == "{quoted}"'


@dataclass(frozen=True)
class ChannelConfig:
    domain_id: str
    allocation_mode: str


def parse_channel_config(params: Mapping[str, Any], where: str) -> ChannelConfig:
    """NVIDIA's ``ComputeDomainChannelConfig`` from a claim's opaque parameters; one ``ConfigError`` naming
    ``where`` and the field for anything else."""
    if params.get("apiVersion") != CONFIG_API_VERSION or params.get("kind") != CONFIG_KIND:
        raise ConfigError(f"{where}: parameters must be {CONFIG_API_VERSION} {CONFIG_KIND}, got "
                          f"{params.get('apiVersion')!r} {params.get('kind')!r}", subject=where)
    domain = params.get("domainID")
    if not isinstance(domain, str) or not domain:
        raise ConfigError(f"{where}: domainID must be the ComputeDomain's UID, got {domain!r}", subject=where)
    mode = params.get("allocationMode", SINGLE) or SINGLE
    if mode not in (SINGLE, ALL):
        raise ConfigError(f"{where}: allocationMode must be Single or All, got {mode!r}", subject=where)
    unknown = sorted(set(params) - {"apiVersion", "kind", "domainID", "allocationMode"})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}", subject=where)
    return ChannelConfig(domain, mode)


def channel_ids(mode: str, count: int = DEFAULT_CHANNEL_COUNT) -> range:
    """The channels a container gets: channel 0 for ``Single``, 0..count-1 for ``All``."""
    return range(count) if mode == ALL else range(1)


def channel_nodes(paths: HostPaths) -> Callable[[int], list[dict[str, Any]]]:
    """CDI ``deviceNodes`` entries of channels 0..count-1, each channel device made on the node first if it is
    missing (``nodeagent.imex.channels``, as nvidia-modprobe makes them; major from ``/proc/devices``)."""
    def nodes(count: int) -> list[dict[str, Any]]:
        return [cdi_device_node(ch) for ch in ensure_channels(paths, range(count))]
    return nodes


def channel_dra_device(clique: str) -> DraDevice:
    """The node's channel device as the DRA plane holds it (no GPU: index and minor -1)."""
    return DraDevice(name=CHANNEL_DEVICE, kind="channel", gpu_index=-1, minor=-1, uuid="",
                     attributes=channel_device(clique)["attributes"])


def claim_channel_config(claim: Mapping[str, Any], driver: str, label: str) -> ChannelConfig | None:
    """The ``ComputeDomainChannelConfig`` among the claim's allocated opaque configs for ``driver`` (None
    when it has none); ``ConfigError`` for a malformed one or two that disagree."""
    alloc = (claim.get("status") or {}).get("allocation") or {}
    configs = (alloc.get("devices") or {}).get("config") or []
    found: ChannelConfig | None = None
    for i, c in enumerate(configs if isinstance(configs, list) else []):
        opaque = c.get("opaque") if isinstance(c, Mapping) else None
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        params = opaque.get("parameters")
        if not isinstance(params, Mapping) or params.get("kind") != CONFIG_KIND:
            continue
        cfg = parse_channel_config(params, f"{label}: allocation config[{i}]")
        if found is not None and cfg != found:
            raise ConfigError(f"{label}: two ComputeDomainChannelConfigs that disagree", subject=label)
        found = cfg
    return found
