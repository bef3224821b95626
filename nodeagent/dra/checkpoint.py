"""The DRA driver's record of prepared claims (``/var/lib/nodeagent/dra-claims.json``), written atomically.

A claim is recorded (with its devices and CDI IDs) only after its CDI spec file is in place, and its
record goes before the spec file is removed. A process killed between the two steps therefore leaves at
most a spec file without a record, which the next start deletes (the kubelet retries the call); a record
always means "prepared and answered", never half done.

A claim with a dynamic MIG device changes the GPU, so it is recorded BEFORE the side effect: state
``preparing`` (placements named, no instance yet) → GPU/compute instances created → CDI spec →
``prepared`` (with the instance ids and MIG UUIDs); unprepare records ``unpreparing`` first, then destroys
the instances, removes the spec and drops the record. A start that finds ``preparing`` undoes it (destroys
any instance at the recorded placements, removes the spec; the kubelet retries); ``unpreparing`` is
finished. Only instances at placements a record names are ever destroyed.

The file is replaced atomically and fsynced (temporary file + fsync + rename), like every state file
under /var/lib; only the per-claim CDI specs in /var/run/cdi, which end with the boot, skip the fsync.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent import fileio
from nodeagent.errors import InputError

VERSION = 1
PREPARED = "prepared"
PREPARING = "preparing"
UNPREPARING = "unpreparing"
STATES = (PREPARING, PREPARED, UNPREPARING)


@dataclass(frozen=True)
class MigInstance:
    """A dynamic MIG device's GPU instance: where it goes and, once created, what NVML called it."""

    gpu_index: int
    gpu_uuid: str
    profile: str
    start: int
    gi_id: int | None = None
    ci_id: int | None = None
    uuid: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_index": self.gpu_index, "gpu_uuid": self.gpu_uuid, "profile": self.profile,
                "start": self.start, "gi_id": self.gi_id, "ci_id": self.ci_id, "uuid": self.uuid}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MigInstance:
        def opt(v: Any) -> int | None:
            return None if v is None else int(v)

        return cls(int(d["gpu_index"]), str(d["gpu_uuid"]), str(d["profile"]), int(d["start"]),
                   opt(d.get("gi_id")), opt(d.get("ci_id")), str(d.get("uuid", "")))


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    mig: MigInstance | None = None  # dynamic MIG only
    share_id: str | None = None  # one allocation of a shared device (consumable capacity)
    consumed: tuple[tuple[str, str], ...] = ()  # capacity name → quantity it consumed, sorted
    admin: bool = False  # admin access: reached without being taken (never a holder of its GPU)
    channels: int = 0  # an IMEX channel device: the channels given (1 or all)
    domain: str = ""  # ... and the ComputeDomain (UID) they were given for

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"request_names": list(self.request_names), "pool": self.pool,
                             "device": self.device, "cdi_device_ids": list(self.cdi_device_ids)}
        if self.mig is not None:
            d["mig"] = self.mig.to_dict()
        if self.share_id is not None:
            d["share_id"] = self.share_id
        if self.consumed:
            d["consumed"] = dict(self.consumed)
        if self.admin:
            d["admin"] = True
        if self.channels:
            d["channels"] = self.channels
            d["domain"] = self.domain
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PreparedDevice:
        share = d.get("share_id")
        return cls(tuple(map(str, d["request_names"])), str(d["pool"]), str(d["device"]),
                   tuple(map(str, d["cdi_device_ids"])),
                   MigInstance.from_dict(d["mig"]) if d.get("mig") is not None else None,
                   None if share is None else str(share),
                   tuple(sorted((str(k), str(v)) for k, v in dict(d.get("consumed") or {}).items())),
                   d.get("admin") is True, int(d.get("channels") or 0), str(d.get("domain") or ""))


@dataclass(frozen=True)
class ClaimRecord:
    uid: str
    namespace: str
    name: str
    state: str
    devices: tuple[PreparedDevice, ...] = ()
    pod_claim_name: str | None = None  # a claim made from a template: the pod's name for it (device metadata)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"namespace": self.namespace, "name": self.name, "state": self.state,
                             "devices": [d.to_dict() for d in self.devices]}
        if self.pod_claim_name is not None:
            d["pod_claim_name"] = self.pod_claim_name
        return d


@dataclass
class Checkpoint:
    path: Path
    claims: dict[str, ClaimRecord] = field(default_factory=dict)
    root: fileio.Root | None = field(default=None, compare=False)  # the path is resolved inside it at each use

    @classmethod
    def load(cls, path: Path, root: fileio.Root | None = None) -> Checkpoint:
        """Read the file (missing = empty); a damaged file raises ``InputError`` naming it."""
        text = fileio.read_text(path, root=root)
        cp = cls(path, root=root)
        if text is None:
            return cp
        try:
            raw = json.loads(text)
            if raw.get("version") != VERSION:
                raise ValueError(f"unsupported version {raw.get('version')!r}")
            for uid, c in dict(raw["claims"]).items():
                if c["state"] not in STATES:
                    raise ValueError(f"claim {uid}: unknown state {c['state']!r}")
                devices = tuple(PreparedDevice.from_dict(d) for d in c["devices"])
                pod_claim = c.get("pod_claim_name")
                cp.claims[str(uid)] = ClaimRecord(str(uid), str(c["namespace"]), str(c["name"]),
                                                  str(c["state"]), devices,
                                                  None if pod_claim is None else str(pod_claim))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InputError(f"DRA checkpoint {path} is damaged: {e}", subject=str(path)) from e
        return cp

    def save(self) -> None:
        data = {"version": VERSION, "claims": {u: c.to_dict() for u, c in sorted(self.claims.items())}}
        # compact: without indent the json module encodes in C (the file is rewritten at every prepare)
        text = json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"
        fileio.atomic_write(self.path, text, mode=0o600, backup=False, root=self.root, parents=True)

    def put(self, record: ClaimRecord) -> None:
        self.claims[record.uid] = record
        self.save()

    def drop(self, uid: str) -> bool:
        if self.claims.pop(uid, None) is None:
            return False
        self.save()
        return True
