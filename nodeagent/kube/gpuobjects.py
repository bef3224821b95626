"""One cluster-scoped ``GPU`` object (nodeagent.io/v1alpha1) per physical GPU of the own node.

``desired_gpu_objects`` is pure: Inventory + sharing facts + PodResources assignments + health →
what each object should hold. ``GpuObjects.sync`` writes only the differences: it lists the node's
objects once (label ``nodeagent.io/node``), then keeps what it wrote in memory, so a pass where nothing
changed sends no request at all. Objects carry an owner reference to the Node (they go away with it);
objects of GPUs that are gone are deleted. The CRD is ``packaging/kubernetes/gpu-crd.yaml``.

The CRD has no status subresource, so every change is ONE request: a new GPU is created with its status,
a changed one gets one JSON patch of what differs (spec, status, owner, labels). A cluster still serving an
older CRD with a status subresource drops the status of a create (and keeps the old one on a patch):
``sync`` notices it in the answer, writes the status through ``/status`` and does so from then on (two
requests for a new GPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nodeagent.errors import KubeError
from nodeagent.gpu.inventory import Gpu, Inventory
from nodeagent.kube.client import JSON_PATCH, KubeClient
from nodeagent.kube.labels import NVIDIA, SharingFacts, resource_profile
from nodeagent.kube.podresources import Assignment

log = logging.getLogger(__name__)

GROUP = "nodeagent.io"
VERSION = "v1alpha1"
PLURAL = "gpus"
KIND = "GPU"
CRD_NAME = f"{PLURAL}.{GROUP}"
NODE_LABEL = "nodeagent.io/node"
API_PATH = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
CRD_FILE = Path(__file__).resolve().parents[2] / "packaging" / "kubernetes" / "gpu-crd.yaml"


_Dicts = list[dict[str, Any]]  # owner references, JSON-patch ops


@dataclass(frozen=True)
class DesiredGpu:
    name: str
    labels: Mapping[str, str]
    spec: Mapping[str, Any]
    status: Mapping[str, Any]


@dataclass
class SyncResult:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    status_updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    status_subresource_writes: int = 0  # extra /status requests an older CRD (with the subresource) needs

    @property
    def writes(self) -> int:
        return (len(self.created) + len(self.updated) + len(self.status_updated) + len(self.deleted)
                + self.status_subresource_writes)


def object_name(node_name: str, index: int) -> str:
    return f"{node_name}-gpu{index}"


def gpu_of_device(device_id: str, inv: Inventory) -> int | None:
    """The physical GPU index a device-plugin device ID belongs to (UUID, MIG UUID, index, replica)."""
    base = device_id.split("::", 1)[0]
    for g in inv.gpus:
        if base == g.uuid:
            return g.index
        for d in g.mig_devices:
            if base == d.uuid:
                return g.index
    head = base.split(":", 1)[0]
    if head.isdigit():
        idx = int(head)
        if any(g.index == idx for g in inv.gpus):
            return idx
    return None


def per_gpu_capacity(g: Gpu, sharing: SharingFacts) -> dict[str, str]:
    """What one GPU contributes to the node's device-plugin resources."""
    replicas = max(1, sharing.replicas)
    gpu_res = NVIDIA + ("gpu.shared" if sharing.renamed and replicas > 1 else "gpu")
    if g.mig_current and sharing.mig_strategy == "mixed":
        counts: dict[str, int] = {}
        for d in g.mig_devices:
            prof = resource_profile(d.profile)
            counts[prof] = counts.get(prof, 0) + max(1, sharing.mig_replicas.get(prof, 1))
        return {f"{NVIDIA}mig-{p}": str(n) for p, n in sorted(counts.items())}
    if g.mig_current and sharing.mig_strategy == "single":
        return {gpu_res: str(len(g.mig_devices) * replicas)}
    return {gpu_res: str(replicas)}


def desired_gpu_objects(
    node_name: str,
    inv: Inventory,
    sharing: SharingFacts,
    assignments: Iterable[Assignment] = (),
    health: Mapping[int, bool] | None = None,
) -> dict[str, DesiredGpu]:
    """Object name → desired content for every GPU in the inventory (pure)."""
    held: dict[int, dict[str, dict[str, Any]]] = {}
    held_count: dict[int, int] = {}
    for a in assignments:
        per_gpu: dict[int, list[str]] = {}
        for dev in a.device_ids:
            idx = gpu_of_device(dev, inv)
            if idx is not None:
                per_gpu.setdefault(idx, []).append(dev)
        for idx, devs in per_gpu.items():
            pods = held.setdefault(idx, {})
            key = f"{a.namespace}/{a.pod}"
            entry = pods.setdefault(key, {"namespace": a.namespace, "pod": a.pod, "containers": []})
            entry["containers"].append({"container": a.container, "resource": a.resource, "devices": sorted(devs)})
            held_count[idx] = held_count.get(idx, 0) + len(devs)
    out: dict[str, DesiredGpu] = {}
    for g in sorted(inv.gpus, key=lambda x: x.index):
        name = object_name(node_name, g.index)
        healthy = True if health is None else health.get(g.index, True)
        cap = per_gpu_capacity(g, sharing)
        alloc = dict(cap) if healthy else {k: "0" for k in cap}
        pods = held.get(g.index, {})
        for entry in pods.values():
            entry["containers"].sort(key=lambda c: (c["container"], c["resource"]))
        out[name] = DesiredGpu(
            name=name,
            labels={NODE_LABEL: node_name},
            spec={
                "index": g.index,
                "uuid": g.uuid,
                "model": g.name,
                "memory": g.memory_mib,
                "path": f"/dev/nvidia{g.minor_number}",
                "pciBusId": g.pci_bus_id,
                "nodeName": node_name,
            },
            status={
                "state": "Healthy" if healthy else "Unhealthy",
                "migEnabled": g.mig_current,
                "capacity": cap,
                "allocatable": alloc,
                "allocated": dict(sorted(pods.items())),
                "allocatedDevices": held_count.get(g.index, 0),
            },
        )
    return out


def _owner(node_name: str, node_uid: str) -> list[dict[str, Any]]:
    if not node_uid:
        return []
    return [{"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid}]


@dataclass
class _Seen:
    labels: dict[str, str]
    spec: dict[str, Any]
    status: dict[str, Any]
    owners: list[dict[str, Any]]


def _seen_from(obj: Mapping[str, Any]) -> _Seen:
    meta = obj.get("metadata") or {}
    owners = [
        {k: o.get(k) for k in ("apiVersion", "kind", "name", "uid")} for o in meta.get("ownerReferences") or []
    ]
    return _Seen(
        labels=dict(meta.get("labels") or {}),
        spec=dict(obj.get("spec") or {}),
        status=dict(obj.get("status") or {}),
        owners=owners,
    )


class GpuObjects:
    """Keeps the own node's GPU objects equal to the desired ones, writing only differences."""

    def __init__(self, kube: KubeClient, node_name: str) -> None:
        self.kube = kube
        self.node_name = node_name
        self._cache: dict[str, _Seen] | None = None
        self.status_subresource = False  # learnt from the first create: the served CRD has one

    def invalidate(self) -> None:
        """Forget what was written; the next sync lists the objects again."""
        self._cache = None

    def list(self) -> dict[str, dict[str, Any]]:
        data = self.kube.request(
            "GET",
            API_PATH,
            query={"labelSelector": f"{NODE_LABEL}={self.node_name}"},
            action=f"list GPU objects of node {self.node_name}",
            subject=self.node_name,
        )
        return {str(o["metadata"]["name"]): o for o in data.get("items") or []}

    def _load(self) -> dict[str, _Seen]:
        if self._cache is None:
            try:
                objs = self.list()
            except KubeError as e:
                if e.status == 404:
                    raise KubeError(
                        f"GPU objects: the CRD {CRD_NAME} is not installed "
                        f"(kubectl apply -f packaging/kubernetes/gpu-crd.yaml)",
                        subject=CRD_NAME,
                        status=404,
                    ) from e
                raise
            self._cache = {n: _seen_from(o) for n, o in objs.items()}
        return self._cache

    def sync(self, desired: Mapping[str, DesiredGpu], node_uid: str) -> SyncResult:
        try:
            return self._sync(desired, node_uid)
        except KubeError as e:
            if e.status in (404, 409, 422):
                self.invalidate()  # somebody else changed the objects; relist next time
            raise

    def _sync(self, desired: Mapping[str, DesiredGpu], node_uid: str) -> SyncResult:
        seen = self._load()
        res = SyncResult()
        owners = _owner(self.node_name, node_uid)
        for name, want in desired.items():
            have = seen.get(name)
            if have is None:
                self._create(name, want, owners, seen, res)
                continue
            ops = _patch_ops(have, want, owners)
            if not ops:
                continue
            meta_changed = any(not op["path"].startswith("/status") for op in ops)
            status_changed = have.status != dict(want.status)
            if self.status_subresource:
                main = [op for op in ops if not op["path"].startswith("/status")]
                if main:
                    self._patch(name, "", main, have)
                if status_changed:
                    self._patch(name, "/status", [{"op": "add", "path": "/status", "value": dict(want.status)}],
                                have)
                    if main:
                        res.status_subresource_writes += 1
            else:
                before = have.status
                self._patch(name, "", ops, have)
                if status_changed and have.status == before:
                    # the server kept the old status: an older CRD with a status subresource
                    self.status_subresource = True
                    self._patch(name, "/status", [{"op": "add", "path": "/status", "value": dict(want.status)}],
                                have)
                    res.status_subresource_writes += 1
            (res.updated if meta_changed else res.status_updated).append(name)
        for name in sorted(set(seen) - set(desired)):
            try:
                self.kube.request("DELETE", f"{API_PATH}/{name}", action=f"delete GPU object {name}", subject=name)
            except KubeError as e:
                if e.status != 404:
                    raise
            del seen[name]
            res.deleted.append(name)
        return res

    def _create(self, name: str, want: DesiredGpu, owners: _Dicts, seen: dict[str, _Seen],
                res: SyncResult) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": {"name": name, "labels": dict(want.labels), "ownerReferences": owners},
            "spec": dict(want.spec),
            "status": dict(want.status),
        }
        created = self.kube.request("POST", API_PATH, body=body, action=f"create GPU object {name}", subject=name)
        have = seen[name] = _seen_from(created)
        res.created.append(name)
        if want.status and not have.status:
            # an older CRD with a status subresource: the create dropped the status; write it there
            self.status_subresource = True
            self._patch(name, "/status", [{"op": "add", "path": "/status", "value": dict(want.status)}], have)
            res.status_subresource_writes += 1

    def _patch(self, name: str, sub: str, ops: _Dicts, have: _Seen) -> None:
        out = self.kube.request(
            "PATCH", f"{API_PATH}/{name}{sub}", body=ops, content_type=JSON_PATCH,
            action=f"update {'status of ' if sub else ''}GPU object {name}", subject=name,
        )
        fresh = _seen_from(out)
        have.labels, have.spec, have.owners, have.status = fresh.labels, fresh.spec, fresh.owners, fresh.status


def _patch_ops(have: _Seen, want: DesiredGpu, owners: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON-patch ops turning ``have`` into ``want``: whole spec/status/owners, single labels (labels others
    set on the object stay)."""
    ops: list[dict[str, Any]] = []
    if any(have.labels.get(k) != v for k, v in want.labels.items()):
        if not have.labels:
            ops.append({"op": "add", "path": "/metadata/labels", "value": dict(want.labels)})
        else:
            ops.extend({"op": "add", "path": f"/metadata/labels/{_pointer(k)}", "value": v}
                       for k, v in sorted(want.labels.items()) if have.labels.get(k) != v)
    if have.owners != owners:
        ops.append({"op": "add", "path": "/metadata/ownerReferences", "value": owners})
    if have.spec != dict(want.spec):
        ops.append({"op": "add", "path": "/spec", "value": dict(want.spec)})
    if have.status != dict(want.status):
        ops.append({"op": "add", "path": "/status", "value": dict(want.status)})
    return ops


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def install_crd(kube: KubeClient, manifest: str | None = None, *, timeout: float = 30.0) -> None:
    """Create (or keep) the GPU CRD and wait until the API server serves it."""
    doc = yaml.safe_load(manifest if manifest is not None else CRD_FILE.read_text())
    base = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    try:
        kube.request("POST", base, body=doc, action=f"create CRD {CRD_NAME}", subject=CRD_NAME)
    except KubeError as e:
        if e.status != 409:
            raise
    deadline = time.monotonic() + timeout
    while True:
        crd = kube.request("GET", f"{base}/{CRD_NAME}", action=f"read CRD {CRD_NAME}", subject=CRD_NAME)
        conds = (crd.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Established" and c.get("status") == "True" for c in conds):
            return
        if time.monotonic() > deadline:
            raise KubeError(f"CRD {CRD_NAME} not established after {timeout:.0f}s", subject=CRD_NAME)
        time.sleep(0.1)
