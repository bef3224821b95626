"""The claim's device status (KEP-4817, ``status.devices``): what the driver tells the cluster about each
device it prepared for a claim.

``device_status`` (pure) builds one ``AllocatedDeviceStatus`` per prepared device (driver, pool, device, the
share ID of a shared device) with ``data``: the device's UUID, its GPU index and, for a MIG device, its
profile and placement. ``ClaimStatusWriter`` (the adapter) merges these entries into the claim's status
(entries of other drivers and devices stay as they are) through the status subresource, retrying once on a
conflict. Writing is best effort, after prepare answered: a claim whose status cannot be written is still
prepared; the failure is logged. The API server drops ``status.devices`` when the claim is deallocated, so
unprepare writes nothing.

Permissions: ``update`` on ``resourceclaims/status`` and, where the API server authorizes device status per
driver (``DRAResourceClaimGranularStatusAuthorization``, beta from 1.36), ``associated-node:update`` on the
synthetic ``resourceclaims/driver`` subresource for ``gpu.nodeagent.io``: the agent's token may only write the
status of claims allocated on its own node (packaging/kubernetes/rbac-dra.yaml).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from nodeagent.dra.checkpoint import PreparedDevice
from nodeagent.dra.devices import DraDevice
from nodeagent.errors import KubeError

log = logging.getLogger(__name__)

RESOURCE_V1 = "/apis/resource.k8s.io/v1"


def _data(pd: PreparedDevice, dev: DraDevice | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if pd.mig is not None:
        out.update(uuid=pd.mig.uuid, gpuIndex=pd.mig.gpu_index, parentUUID=pd.mig.gpu_uuid,
                   migProfile=pd.mig.profile, placementStart=pd.mig.start)
        return out
    if dev is None:
        return out
    if dev.vfio is not None:  # no UUID: NVML does not see a GPU on a VFIO driver
        out.update(pciBusID=dev.vfio.bdf, iommuGroup=dev.vfio.iommu_group, gpuIndex=dev.gpu_index)
        return out
    if dev.kind == "channel":
        out.update(channels=pd.channels, domainID=pd.domain)
        return out
    out.update(uuid=dev.uuid, gpuIndex=dev.gpu_index)
    if dev.kind == "mig":
        attrs = dev.attributes
        out["migProfile"] = attrs.get("profile", {}).get("string", "")
        out["placementStart"] = attrs.get("placementStart", {}).get("int", 0)
        out["parentUUID"] = attrs.get("parentUUID", {}).get("string", "")
    if pd.share_id is not None:
        out["consumedCapacity"] = dict(pd.consumed)
    return out


def device_status(driver: str, prepared: Sequence[PreparedDevice],
                  devices: Mapping[str, DraDevice]) -> list[dict[str, Any]]:
    """The ``status.devices`` entries of this driver for a prepared claim (one per prepared device)."""
    out: list[dict[str, Any]] = []
    for pd in prepared:
        entry: dict[str, Any] = {"driver": driver, "pool": pd.pool, "device": pd.device,
                                 "data": _data(pd, devices.get(pd.device))}
        if pd.share_id is not None:
            entry["shareID"] = pd.share_id
        out.append(entry)
    return out


def _key(entry: Mapping[str, Any]) -> tuple[str, str, str, str]:
    return (str(entry.get("driver", "")), str(entry.get("pool", "")), str(entry.get("device", "")),
            str(entry.get("shareID") or ""))


def _set(entry: Mapping[str, Any]) -> dict[str, Any]:
    """An entry without the unset fields some API servers echo as null (``conditions``)."""
    return {k: v for k, v in entry.items() if v is not None}


def merged(current: Sequence[Mapping[str, Any]], ours: Sequence[dict[str, Any]], driver: str,
           uid_devices: set[tuple[str, str, str, str]]) -> list[dict[str, Any]]:
    """``current`` with every entry of ``driver`` for the devices in ``uid_devices`` replaced by ``ours``."""
    keep = [_set(e) for e in current if not (e.get("driver") == driver and _key(e) in uid_devices)]
    return keep + list(ours)


class Api(Protocol):
    """What the writer needs of ``nodeagent.kube.client.KubeClient`` (the component hands its client in)."""

    def request(self, method: str, path: str, *, body: Any = None, action: str | None = None) -> dict[str, Any]:
        ...


class ClaimStatusWriter:
    def __init__(self, kube: Api, driver: str) -> None:
        self.kube = kube
        self.driver = driver
        self.writes = 0

    def write(self, namespace: str, name: str, uid: str, entries: list[dict[str, Any]]) -> bool:
        """Put ``entries`` into the claim's ``status.devices`` (blocking). False when the claim is gone,
        replaced or no longer allocated, or the write was refused (logged)."""
        path = f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaims/{name}"
        keys = {_key(e) for e in entries}
        for attempt in range(2):
            try:
                claim = self.kube.request("GET", path, action=f"get ResourceClaim {namespace}/{name}")
                if (claim.get("metadata") or {}).get("uid") != uid or not (claim.get("status") or {}).get(
                        "allocation"):
                    return False
                status = claim.setdefault("status", {})
                want = merged(status.get("devices") or [], entries, self.driver, keys)
                if [_set(e) for e in status.get("devices") or []] == want:
                    return True
                status["devices"] = want
                self.kube.request("PUT", f"{path}/status", body=claim,
                                  action=f"write the device status of ResourceClaim {namespace}/{name}")
                self.writes += 1
                return True
            except KubeError as e:
                if e.status == 409 and attempt == 0:
                    continue
                log.warning("DRA: device status of claim %s/%s not written: %s", namespace, name, e)
                return False
        return False
