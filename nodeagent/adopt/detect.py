"""What else serves this node's GPUs: the conflicts nodeagent looks for at start and at every resync, and that
``nodeagent doctor`` reports.

Four kinds, each found by a pure function over facts the adapters read:

- ``device-plugin``: another device plugin serves a resource name nodeagent would serve. A socket in the
  kubelet's device-plugin directory that is not nodeagent's and answers ``GetDevicePluginOptions``; its
  resource is the one whose socket name it holds (NVIDIA's plugin uses ``nvidia-gpu.sock`` as nodeagent
  does), else the one the kubelet's checkpoint registers with the same device IDs.
- ``dra-driver``: another DRA driver's ResourceSlices on this node list this node's GPUs (a device
  attribute holding one of their UUIDs or PCI bus ids, e.g. NVIDIA's ``gpu.nvidia.com``): nodeagent leaves
  those GPUs out of its own ResourceSlices (``foreign_gpus``) unless ``[adopt] take_over`` says otherwise.
- ``mig-manager``: ``nvidia.com/mig.config.state`` on the Node was last written by another field manager
  (the Node's ``managedFields``; nodeagent writes as ``nodeagent``).
- ``feature-labels``: gpu-feature-discovery through NFD owns label keys nodeagent writes: they are listed in
  the Node's ``nfd.node.kubernetes.io/feature-labels`` annotation or in a NodeFeature object of this node.
- ``gpu-operator``: the GPU Operator deploys its device plugin on this node (the Node's
  ``nvidia.com/gpu.deploy.device-plugin`` is ``true``, e.g. after ``nodeagent adopt --release``): nodeagent leaves
  the resources it would serve to that plugin until the node is handed over again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from nodeagent.errors import KubeError
from nodeagent.fileio import Root
from nodeagent.gpu.inventory import Inventory

Kind = Literal["device-plugin", "dra-driver", "mig-manager", "feature-labels", "gpu-operator"]
KINDS: tuple[Kind, ...] = ("device-plugin", "dra-driver", "mig-manager", "feature-labels", "gpu-operator")
REASONS: Mapping[Kind, str] = {
    "device-plugin": "AnotherDevicePlugin",
    "dra-driver": "AnotherDraDriver",
    "mig-manager": "AnotherMigManager",
    "feature-labels": "FeatureLabelsOwnedByNfd",
    "gpu-operator": "GpuOperatorDevicePlugin",
}
OPERATOR_DEVICE_PLUGIN = "nvidia.com/gpu.deploy.device-plugin"  # the GPU Operator's switch of its device plugin
FIELD_MANAGER = "nodeagent"  # the manager name of nodeagent's writes (its User-Agent)
MIG_STATE_LABEL = "nvidia.com/mig.config.state"
NFD_FEATURE_LABELS = "nfd.node.kubernetes.io/feature-labels"
NFD_DEFAULT_NS = "feature.node.kubernetes.io/"
NFD_NODE_NAME_LABEL = "nfd.node.kubernetes.io/node-name"
NODE_FEATURES = "/apis/nfd.k8s-sigs.io/v1alpha1/nodefeatures"
RESOURCE_SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@dataclass(frozen=True, order=True)
class Conflict:
    """One thing another agent does that nodeagent would do: ``subject`` is what both act on (a resource
    name, a label key, GPUs), ``owner`` who the other is (a socket file, a DRA driver, a field manager)."""

    kind: Kind
    subject: str
    owner: str
    detail: str

    @property
    def reason(self) -> str:
        return REASONS[self.kind]

    def key(self) -> tuple[str, str, str]:
        return self.kind, self.subject, self.owner


# -- device plugins (pure) -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForeignSocket:
    """A socket in the device-plugin directory that is not nodeagent's and answers the device-plugin API."""

    name: str
    device_ids: tuple[str, ...]
    pid: int | None = None


def plugin_conflicts(
    sockets: Iterable[ForeignSocket],
    checkpoint: Mapping[str, Sequence[str]],
    wanted: Mapping[str, str],
    uuids: Iterable[str] = (),
    device_ids: Mapping[str, Iterable[str]] | None = None,
) -> list[Conflict]:
    """``wanted``: resource name → the socket file nodeagent serves it on; ``checkpoint``: the kubelet's
    registered devices by resource; ``uuids``: this node's GPU and MIG device UUIDs; ``device_ids``: resource
    name → the device IDs nodeagent advertises for it (NVIDIA's plugin uses the same: UUIDs, ``UUID::n`` when
    shared). A socket's resource is the one of its socket name, else the one whose device IDs it lists, else
    the one the checkpoint registers with its device IDs."""
    by_socket = {sock: res for res, sock in wanted.items()}
    ours = set(uuids)
    mine = {r: set(v) for r, v in (device_ids or {}).items() if r in wanted}
    out: list[Conflict] = []
    for s in sockets:
        ids = set(s.device_ids)
        resource = by_socket.get(s.name)
        if resource is None:
            resource = next((r for r in sorted(mine) if ids & mine[r]), None)
        if resource is None:
            resource = next((r for r in sorted(wanted) if ids and ids & set(checkpoint.get(r, ()))), None)
        same = sorted(ids & ours)
        if resource is None and not same:
            continue  # a plugin of something else (another vendor's devices)
        who = s.name + (f" (pid {s.pid})" if s.pid else "")
        gpus = f"; {len(same)} of its {len(ids)} device(s) are this node's GPUs by UUID" if same else ""
        if resource is None:
            out.append(Conflict("device-plugin", "GPUs " + ",".join(same[:4]) + ("..." if len(same) > 4 else ""),
                                s.name, f"the device plugin on {who} lists this node's GPUs{gpus}"))
            continue
        out.append(Conflict("device-plugin", resource, s.name,
                            f"another device plugin serves {resource} on {who}{gpus}: nodeagent does not register "
                            f"{resource} until it is gone (or [adopt] take_over = true)"))
    return sorted(out)


# -- the API (pure) ----------------------------------------------------------------------------------------------
def _attribute_strings(device: Mapping[str, Any]) -> set[str]:
    out: set[str] = set()
    attrs = device.get("attributes") or {}
    if isinstance(attrs, Mapping):
        for value in attrs.values():
            if isinstance(value, Mapping) and isinstance(value.get("string"), str):
                out.add(value["string"])
    return out


def _same_gpu_keys(device: Mapping[str, Any], keys: Mapping[str, int]) -> set[str]:
    """The keys of ``keys`` (UUIDs, PCI bus ids in the standard form) a device's string attributes hold."""
    from nodeagent.dra.devices import pci_bus_id

    out: set[str] = set()
    for value in _attribute_strings(device):
        if value in keys:
            out.add(value)
        elif ":" in value and (bus := pci_bus_id(value)) in keys:
            out.add(bus)
    return out


def foreign_devices(slices: Iterable[Mapping[str, Any]], our_driver: str,
                    keys: Mapping[str, int]) -> dict[tuple[str, str, str], tuple[int, frozenset[str]]]:
    """(driver, pool, device) of every other driver's device that is one of this node's GPUs (or a part of
    one) → (that GPU's index, the keys that matched); ``keys`` maps UUIDs and PCI bus ids to GPU indices
    (``gpu_keys``)."""
    out: dict[tuple[str, str, str], tuple[int, frozenset[str]]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if not isinstance(spec, Mapping):
            continue
        driver = str(spec.get("driver", ""))
        if not driver or driver == our_driver:
            continue
        pool = str((spec.get("pool") or {}).get("name", "")) if isinstance(spec.get("pool"), Mapping) else ""
        for device in spec.get("devices") or []:
            if isinstance(device, Mapping):
                same = _same_gpu_keys(device, keys)
                if same:
                    gpu = min(keys[k] for k in same)
                    out[(driver, pool, str(device.get("name", "")))] = (gpu, frozenset(same))
    return out


def dra_conflicts(slices: Iterable[Mapping[str, Any]], our_driver: str, uuids: Iterable[str],
                  keys: Mapping[str, int] | None = None) -> list[Conflict]:
    """Slices of other drivers listing one of this node's GPUs: ``keys`` (``gpu_keys``: UUIDs and PCI bus ids
    → GPU index) or, without it, one of ``uuids`` (as a device attribute's string value)."""
    known = dict(keys) if keys is not None else {u: -1 for u in uuids}
    found: dict[str, set[str]] = {}
    gpus: dict[str, set[int]] = {}
    for (driver, _, _), (gpu, matched) in foreign_devices(slices, our_driver, known).items():
        found.setdefault(driver, set()).update(matched)
        if gpu >= 0:
            gpus.setdefault(driver, set()).add(gpu)
    out = []
    for driver, same in sorted(found.items()):
        left = sorted(gpus.get(driver, ()))
        what = (f"; nodeagent leaves GPU(s) {','.join(map(str, left))} out of its ResourceSlices while they are "
                "there (or [adopt] take_over = true)") if left else ""
        out.append(Conflict("dra-driver", f"{len(left) or len(same)} GPU(s)", driver,
                            f"DRA driver {driver} publishes ResourceSlices with this node's GPUs "
                            f"({', '.join(sorted(same)[:4])}{'...' if len(same) > 4 else ''}){what}"))
    return out


def gpu_keys(inventory: Inventory) -> dict[str, int]:
    """What names a GPU of this node in another driver's attributes: its UUID, its MIG devices' UUIDs and its
    PCI bus id (standard form), each → the GPU's index."""
    from nodeagent.dra.devices import pci_bus_id

    out: dict[str, int] = {}
    for g in inventory.gpus:
        out[g.uuid] = g.index
        out.update({d.uuid: g.index for d in g.mig_devices if d.uuid})
        if g.pci_bus_id:
            out[pci_bus_id(g.pci_bus_id)] = g.index
    return out


def _label_owners(node: Mapping[str, Any], key: str) -> list[str]:
    """The field managers of ``metadata.labels[key]`` on ``node`` (from its managedFields)."""
    owners = []
    for entry in (node.get("metadata") or {}).get("managedFields") or []:
        if not isinstance(entry, Mapping):
            continue
        fields = entry.get("fieldsV1") or {}
        labels = ((fields.get("f:metadata") or {}).get("f:labels") or {}) if isinstance(fields, Mapping) else {}
        if isinstance(labels, Mapping) and f"f:{key}" in labels:
            owners.append(str(entry.get("manager", "")))
    return owners


def mig_manager_conflicts(node: Mapping[str, Any], ours: str = FIELD_MANAGER) -> list[Conflict]:
    """``nvidia.com/mig.config.state`` written by a field manager that is not nodeagent."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    if MIG_STATE_LABEL not in labels:
        return []
    return [Conflict("mig-manager", MIG_STATE_LABEL, manager,
                     f"{MIG_STATE_LABEL}={labels[MIG_STATE_LABEL]} was written by {manager} (a MIG manager acting on "
                     "nvidia.com/mig.config as nodeagent does)")
            for manager in sorted(set(_label_owners(node, MIG_STATE_LABEL))) if manager and manager != ours]


def operator_conflicts(node: Mapping[str, Any], resources: Iterable[str]) -> list[Conflict]:
    """The GPU Operator deploys its device plugin here (``nvidia.com/gpu.deploy.device-plugin=true``): one
    conflict per resource nodeagent would serve (``resources``); none while nodeagent hands the node over."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    if labels.get(OPERATOR_DEVICE_PLUGIN) != "true":
        return []
    return [Conflict("gpu-operator", name, f"{OPERATOR_DEVICE_PLUGIN}=true",
                     f"the GPU Operator deploys its device plugin on this node ({OPERATOR_DEVICE_PLUGIN}=true): "
                     f"nodeagent leaves {name} to it and does not serve it until the node is handed over "
                     "(nodeagent adopt, or [adopt] gpu_operator = true)")
            for name in sorted(set(resources))]


def nfd_label_keys(annotation: str) -> set[str]:
    """The label keys of NFD's ``feature-labels`` annotation (names without a namespace are NFD's own)."""
    keys = set()
    for name in annotation.split(","):
        name = name.strip()
        if name:
            keys.add(name if "/" in name else NFD_DEFAULT_NS + name)
    return keys


def feature_label_conflicts(
    node: Mapping[str, Any], node_features: Iterable[Mapping[str, Any]], ours: Iterable[str],
    *, through_nfd: bool = False
) -> list[Conflict]:
    """Label keys nodeagent writes that NFD says are its own (annotation) or a NodeFeature object asks for.
    nodeagent's own NodeFeature (``nodeagent-<node>``) is none; with ``through_nfd`` (``[publish] labels =
    "nodefeature"``) NFD applies nodeagent's labels, so its annotation naming them is no conflict either."""
    mine = set(ours)
    meta_node = node.get("metadata") or {}
    annotations = meta_node.get("annotations") or {}
    own = f"nodeagent-{meta_node.get('name', '')}"
    claimed: dict[str, set[str]] = {}
    annotated = nfd_label_keys(str(annotations.get(NFD_FEATURE_LABELS, ""))) & mine
    if annotated and not through_nfd:
        claimed[f"NFD ({NFD_FEATURE_LABELS})"] = annotated
    for nf in node_features:
        meta = nf.get("metadata") or {}
        if meta.get("name") == own and (meta.get("labels") or {}).get("app.kubernetes.io/managed-by") == "nodeagent":
            continue
        labels = (nf.get("spec") or {}).get("labels") or {}
        same = {k if "/" in k else NFD_DEFAULT_NS + k for k in labels} & mine if isinstance(labels, Mapping) else set()
        if same:
            claimed.setdefault(f"NodeFeature {meta.get('namespace', '')}/{meta.get('name', '')}", set()).update(same)
    out = []
    for owner, keys in sorted(claimed.items()):
        shown = ", ".join(sorted(keys)[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
        out.append(Conflict("feature-labels", f"{len(keys)} label(s)", owner,
                            f"{owner} owns label(s) nodeagent writes: {shown} (gpu-feature-discovery through NFD "
                            "rewrites them)"))
    return out


# -- the API (adapter) -------------------------------------------------------------------------------------------
class Requests(Protocol):
    """What detection uses of ``KubeClient``."""

    def request(self, method: str, path: str, *, query: Any = None, body: Any = None, content_type: str | None = None,
                timeout: Any = 30.0, action: str | None = None, subject: str | None = None) -> dict[str, Any]: ...


@dataclass(frozen=True)
class KubeFacts:
    """What the API says about the node; a part that could not be read is None, with why in ``unread``."""

    node: Mapping[str, Any] | None
    slices: tuple[Mapping[str, Any], ...] | None
    node_features: tuple[Mapping[str, Any], ...] | None
    unread: tuple[str, ...] = ()


def read_kube_facts(kube: Requests, node_name: str, *, timeout: float = 10.0) -> KubeFacts:
    """The Node (with managedFields), this node's ResourceSlices and NodeFeature objects. A missing API (no
    NFD, no DRA) reads as empty; a refused or failed read is None and named in ``unread``."""
    unread: list[str] = []

    def get(what: str, path: str, query: Mapping[str, str] | None = None) -> dict[str, Any] | None:
        try:
            return kube.request("GET", path, query=query, timeout=timeout, action=f"read {what}", subject=node_name)
        except KubeError as e:
            if e.status == 404 and what != "Node":
                return {"items": []}
            unread.append(f"{what}: {e}")
            return None

    node = get("Node", f"/api/v1/nodes/{node_name}")
    slices = get("ResourceSlices", RESOURCE_SLICES, {"fieldSelector": f"spec.nodeName={node_name}"})
    features = get("NodeFeatures", NODE_FEATURES, {"labelSelector": f"{NFD_NODE_NAME_LABEL}={node_name}"})
    return KubeFacts(
        node,
        None if slices is None else tuple(slices.get("items") or ()),
        None if features is None else tuple(features.get("items") or ()),
        tuple(unread),
    )


def kube_conflicts(facts: KubeFacts, *, our_driver: str, uuids: Iterable[str], label_keys: Iterable[str],
                   keys: Mapping[str, int] | None = None, through_nfd: bool = False) -> list[Conflict]:
    """The conflicts the API shows (every part that was read)."""
    ids = set(uuids)
    out: list[Conflict] = []
    if facts.slices is not None:
        out += dra_conflicts(facts.slices, our_driver, ids, keys)
    if facts.node is not None:
        out += mig_manager_conflicts(facts.node)
        out += feature_label_conflicts(facts.node, facts.node_features or (), label_keys, through_nfd=through_nfd)
    return sorted(out)


# -- the device-plugin directory (adapter) -----------------------------------------------------------------------
@dataclass(frozen=True)
class PluginDirFacts:
    """The sockets of the device-plugin directory that answer the device-plugin API and are not nodeagent's,
    the kubelet's registered devices, and every socket that does not answer (stale or another protocol)."""

    foreign: tuple[ForeignSocket, ...]
    checkpoint: Mapping[str, tuple[str, ...]]
    silent: tuple[str, ...]


def read_plugin_dir(directory: Path, is_ours: Callable[[int], bool], timeout_s: float = 1.0,
                    root: Root | None = None) -> PluginDirFacts:
    """Probe every socket of ``directory`` but kubelet.sock; ``is_ours(pid)`` says whether a
    listening process is nodeagent."""
    from nodeagent.deviceplugin.probe import registered_devices, scan

    foreign: list[ForeignSocket] = []
    silent: list[str] = []
    for s in scan(directory, timeout_s=timeout_s):
        if s.pid is not None and is_ours(s.pid):
            continue
        if s.answers:
            foreign.append(ForeignSocket(s.name, s.device_ids, s.pid))
        else:
            silent.append(s.name)
    return PluginDirFacts(tuple(foreign), registered_devices(directory, root), tuple(silent))


def inventory_uuids(inventory: Inventory) -> set[str]:
    """Every GPU and MIG device UUID of an Inventory."""
    out: set[str] = set()
    for g in inventory.gpus:
        out.add(g.uuid)
        out.update(d.uuid for d in g.mig_devices if d.uuid)
    return out


DeviceRef = tuple[str, str, str]  # (driver, pool, device) as a ResourceClaim's allocation names a device


class ForeignDraGpus:
    """Which of this node's GPUs nodeagent's DRA driver must leave out of its ResourceSlices because another
    DRA driver has them: every GPU another driver's slices list now, and, once those slices are gone (the other
    driver handed over), every GPU a claim still holds through a device of the other driver, until that claim's
    pod has ended. The other driver's devices are remembered from its slices while they are seen (a claim names
    devices, not GPUs)."""

    def __init__(self) -> None:
        self.remembered: dict[DeviceRef, int] = {}

    def update(self, slices: Iterable[Mapping[str, Any]], our_driver: str, keys: Mapping[str, int],
               held: Iterable[DeviceRef] | None) -> frozenset[int]:
        """The GPUs to leave out. ``held``: the devices the pods of this node use through their claims (the
        kubelet's PodResources); None when unknown, which keeps every remembered device's GPU out."""
        current = foreign_devices(slices, our_driver, keys)
        for ref, (gpu, _) in current.items():
            self.remembered[ref] = gpu
        using = None if held is None else set(held)
        out = {gpu for gpu, _ in current.values()}
        for ref, gpu in list(self.remembered.items()):
            if ref in current:
                continue
            if using is None or ref in using:
                out.add(gpu)
            else:
                del self.remembered[ref]
        return frozenset(out)
