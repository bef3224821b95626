"""Which pods hold which GPU through DRA: the kubelet's PodResources report each container's ResourceClaims
with their allocated devices; a device of nodeagent's driver from this node's pool names its GPU
(``gpu-3``, ``gpu-3-mig-…``). The device plugin's holders come from ``kube.podresources.holders_by_gpu``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.devices import device_gpu_index
from nodeagent.kube.podresources import ClaimAssignment


def dra_holders(uses: Iterable[ClaimAssignment], pool: str, uuids: Mapping[int, str]) -> dict[str, list[str]]:
    """GPU UUID → the pods (``namespace/name``) using a claim allocated one of its devices from ``pool``."""
    out: dict[str, set[str]] = {}
    for use in uses:
        for driver, claim_pool, device in use.devices:
            index = device_gpu_index(device) if driver == DRIVER_NAME and claim_pool == pool else None
            if index is not None and index in uuids:
                out.setdefault(uuids[index], set()).add(f"{use.namespace}/{use.pod}")
    return {u: sorted(p) for u, p in out.items()}


def merge(*maps: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
    out: dict[str, set[str]] = {}
    for m in maps:
        for gpu, pods in m.items():
            out.setdefault(gpu, set()).update(pods)
    return {g: sorted(p) for g, p in out.items()}
