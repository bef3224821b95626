"""Per-claim CDI spec files (``/var/run/cdi/gpu.nodeagent.io-claim_<uid>.json``).

One spec per prepared claim, kind ``gpu.nodeagent.io/claim``, one CDI device per allocated device named
``<claim uid>-<device name>``. The spec-wide edits carry what every GPU container needs (control device
nodes, ``NVIDIA_VISIBLE_DEVICES`` listing the claim's device UUIDs); each device adds its own device
nodes (``/dev/nvidiaN``, and for a MIG device its GPU- and compute-instance access nodes). A claim of
GPUs on a VFIO driver (``vm-passthrough``) gets what NVIDIA's sandbox device plugin gives instead: the
VFIO container device ``/dev/vfio/vfio`` spec-wide, each GPU's IOMMU group device ``/dev/vfio/<group>``,
and ``PCI_RESOURCE_NVIDIA_COM_<NAME>`` listing the bus ids per resource name. A node the
host facts know (nodeagent.cdi.host: the node's host path under ``--root``, the numbers of a simulated
host's stand-in file) is written as the node-wide CDI spec writes it, so both specs resolve alike. Files
are written atomically, so a runtime reading the directory never sees half a spec, but without fsync:
``/var/run/cdi`` does not outlive the boot and the driver's start-up rewrites any spec that is missing or
differs from its claim record. A spec already on disk with the wanted content is not written again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nodeagent import fileio
from nodeagent.cdi.host import NodeFact
from nodeagent.cdi.spec import node_entry
from nodeagent.deviceplugin.allocate import CONTROL_DEVICES, VISIBLE_DEVICES_ENV, mig_cap_minors
from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.devices import DraDevice
from nodeagent.imex.channels import CHANNEL_DIR
from nodeagent.vfio.allocate import VFIO_CONTAINER
from nodeagent.vfio.names import env_name

CDI_VERSION = "0.6.0"
CDI_KIND = f"{DRIVER_NAME}/claim"
SPEC_PREFIX = f"{DRIVER_NAME}-claim_"
_UID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _check_uid(claim_uid: str) -> None:
    if not _UID_RE.match(claim_uid) or len(claim_uid) > 128:
        raise ValueError(f"claim UID is not usable in a CDI name: {claim_uid!r}")


def cdi_device_name(claim_uid: str, device: str, share_id: str | None = None) -> str:
    return f"{claim_uid}-{device}" if share_id is None else f"{claim_uid}-{device}-{share_id}"


def cdi_device_id(claim_uid: str, device: str, share_id: str | None = None) -> str:
    """The fully-qualified CDI device ID the kubelet hands to the runtime."""
    return f"{CDI_KIND}={cdi_device_name(claim_uid, device, share_id)}"


def share_env(devices: Sequence[DraDevice]) -> list[str]:
    """The limits of the shares among ``devices`` (consumable capacity) as container environment; the
    position of a device's UUID in ``NVIDIA_VISIBLE_DEVICES`` is its CUDA ordinal in the container:

    - ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<ordinal>=<MiB>M,...``: the memory each share consumed, the form
      an MPS client reads;
    - ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<percent>``: the smallest compute share reserved, when one is;
    - ``NODEAGENT_GPU_MEMORY_LIMIT=<uuid>=<MiB>Mi,...`` and ``NODEAGENT_GPU_COMPUTE_SHARE=<uuid>=<percent>,...``:
      the same by device UUID, for a workload of its own.

    Two shares of one device in a claim add up."""
    uuids = _visible(devices)
    memory: dict[str, int] = {}
    compute: dict[str, int] = {}
    for d in devices:
        if d.share is not None:
            memory[d.uuid] = memory.get(d.uuid, 0) + d.share.memory_bytes
            compute[d.uuid] = compute.get(d.uuid, 0) + d.share.compute_percent
    if not memory:
        return []
    mib = {u: -(-b // (1 << 20)) for u, b in memory.items()}
    env = [
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=" + ",".join(f"{uuids.index(u)}={mib[u]}M" for u in memory),
        "NODEAGENT_GPU_MEMORY_LIMIT=" + ",".join(f"{u}={mib[u]}Mi" for u in memory),
        "NODEAGENT_GPU_COMPUTE_SHARE=" + ",".join(f"{u}={min(compute[u], 100)}" for u in compute),
    ]
    reserved = [c for c in compute.values() if c > 0]
    if reserved:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={min(min(reserved), 100)}")
    return env


def _visible(devices: Sequence[DraDevice]) -> list[str]:
    """The claim's device UUIDs, each once, in device order (IMEX channels are no GPU)."""
    return list(dict.fromkeys(d.uuid for d in devices if d.kind != "channel"))


def _node(path: str, facts: Mapping[str, NodeFact]) -> dict[str, Any]:
    fact = facts.get(path)
    return {"path": path} if fact is None else node_entry(fact)


ChannelNodes = Callable[[int], list[dict[str, Any]]]  # channel count → CDI entries of channels 0..count-1


def _device_nodes(dev: DraDevice, facts: Mapping[str, NodeFact],
                  channel_nodes: ChannelNodes | None = None) -> list[dict[str, Any]]:
    if dev.kind == "channel":  # channel 0 (Single) or every channel (All) of the IMEX channel device
        count = max(dev.channels, 1)
        if channel_nodes is not None:
            return channel_nodes(count)
        return [_node(f"{CHANNEL_DIR}/channel{n}", facts) for n in range(count)]
    if dev.vfio is not None:
        return [_node(f"/dev/vfio/{dev.vfio.iommu_group}", facts)]
    nodes = [_node(f"/dev/nvidia{dev.minor}", facts)]
    if dev.gi_id is not None and dev.ci_id is not None:
        for minor in mig_cap_minors(dev.minor, dev.gi_id, dev.ci_id):
            nodes.append(_node(f"/dev/nvidia-caps/nvidia-cap{minor}", facts))
    return nodes


def _vfio_edits(devices: Sequence[DraDevice], facts: Mapping[str, NodeFact]) -> dict[str, Any]:
    """The claim-wide edits of VFIO devices: the container device and the bus ids per resource (KubeVirt
    finds the VM's host devices there), bus ids in device order."""
    if any(d.vfio is None for d in devices):
        raise ValueError("a claim cannot hold GPUs on a VFIO driver and GPUs on the nvidia driver together")
    by_resource: dict[str, list[str]] = {}
    for d in devices:
        assert d.vfio is not None
        by_resource.setdefault(d.vfio_resource, []).append(d.vfio.bdf)
    return {"env": [f"{env_name(r)}={','.join(b)}" for r, b in sorted(by_resource.items())],
            "deviceNodes": [_node(VFIO_CONTAINER, facts)]}


def claim_spec(claim_uid: str, devices: Sequence[DraDevice],
               facts: Mapping[str, NodeFact] | None = None, extra: Mapping[str, Any] | None = None,
               channel_nodes: ChannelNodes | None = None) -> dict[str, Any]:
    """The CDI spec for one claim (pure); ``facts`` are the host's device nodes by container path; ``extra``
    adds container edits (``env``, ``mounts``: the claim's MPS daemon)."""
    facts = facts or {}
    _check_uid(claim_uid)
    spec = {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [
            {"name": cdi_device_name(claim_uid, d.name, d.share.share_id if d.share is not None else None),
             "containerEdits": {"deviceNodes": _device_nodes(d, facts, channel_nodes)}}
            for d in devices
        ],
        "containerEdits": _vfio_edits(devices, facts) if any(d.vfio is not None for d in devices) else {
            "env": [f"{VISIBLE_DEVICES_ENV}={','.join(_visible(devices))}", *share_env(devices)],
            "deviceNodes": [_node(p, facts) for p in CONTROL_DEVICES],
        },
    }
    if devices and all(d.kind == "channel" for d in devices):
        del spec["containerEdits"]  # a claim of IMEX channels alone brings no GPU and no control device
        return spec
    if extra:
        edits: dict[str, Any] = spec["containerEdits"]  # type: ignore[assignment]
        edits["env"] = [*edits["env"], *extra.get("env", ())]
        if extra.get("mounts"):
            edits["mounts"] = list(extra["mounts"])
    return spec


class ClaimSpecs:
    """The per-claim spec files in one CDI directory."""

    def __init__(self, cdi_dir: Path, root: fileio.Root | None = None) -> None:
        self.dir = cdi_dir
        self.root = root  # every file and the directory are resolved inside it as they are used
        self.node_facts: Mapping[str, NodeFact] = {}  # set from the host facts on each inventory
        self.extra_edits: dict[str, Mapping[str, Any]] = {}  # claim UID → container edits beyond its devices
        self.channel_nodes: ChannelNodes | None = None  # IMEX channels made and described (else by path)

    def path(self, claim_uid: str) -> Path:
        _check_uid(claim_uid)
        return self.dir / f"{SPEC_PREFIX}{claim_uid}.json"

    def write(self, claim_uid: str, devices: Sequence[DraDevice]) -> list[str]:
        """Write (or rewrite) the claim's spec atomically; its CDI device IDs in device order."""
        data = self.render(claim_uid, devices)
        path = self.path(claim_uid)
        if self.current(claim_uid) != data:
            fileio.atomic_write(path, data, mode=0o644, backup=False, durable=False, root=self.root, parents=True)
        return [cdi_device_id(claim_uid, d.name, d.share.share_id if d.share is not None else None)
                for d in devices]

    def render(self, claim_uid: str, devices: Sequence[DraDevice]) -> str:
        return json.dumps(claim_spec(claim_uid, devices, self.node_facts, self.extra_edits.get(claim_uid),
                                     self.channel_nodes),
                          indent=2, sort_keys=True) + "\n"

    def current(self, claim_uid: str) -> str | None:
        """The claim's spec file as it is on disk (None when missing or unreadable)."""
        try:
            return fileio.read_text(self.path(claim_uid), root=self.root)
        except (OSError, fileio.UnreadableFileError):
            return None

    def remove(self, claim_uid: str) -> bool:
        return fileio.remove(self.path(claim_uid), durable=False, root=self.root)

    def claim_uids(self) -> set[str]:
        """The claims that have a spec file here."""
        directory = self.dir if self.root is None else self.root.within(self.dir)
        if not directory.is_dir():
            return set()
        out = set()
        for p in directory.glob(f"{SPEC_PREFIX}*.json"):
            out.add(p.name[len(SPEC_PREFIX):-len(".json")])
        return out
