"""ResourceSlice bodies (``resource.k8s.io/v1``) for the node's pool (pure).

One pool per node, named after the node. Devices are split into slices of at most ``MAX_DEVICES``
(the API limit is 128; 64 once a device of the pool consumes counters or carries a taint, the limit of
resource.k8s.io/v1 from 1.37); the slices are named ``<node>-gpu.nodeagent.io-<i>`` so every rewrite
replaces the same objects. Every slice carries a hash of the whole pool's content (without the
generation) in an annotation: a restarted agent that finds the same hash on all slices writes nothing.

Shared counters (dynamic MIG) are laid out in one of two ways, as the API server requires:

- ``LAYOUT_SEPARATE`` (Kubernetes ≥ 1.35): counter sets live in slices of their own (at most 8 sets per
  slice, no devices there), pool-wide; devices in the other slices consume them by name.
- ``LAYOUT_INLINE`` (1.34, DRAPartitionableDevices alpha): a device may only consume counter sets of its
  own slice, so each GPU's counter set travels with that GPU's placement devices; slices are packed with
  at most 32 counters and 1024 device counter entries each (the 1.34 limits).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.devices import COMPUTE_SHARE_CAPACITY, CounterSet, DraDevice

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES = 128
MAX_DEVICES_ADVANCED = 64  # with taints or counters (1.37 and later)
MAX_COUNTER_SETS = 8  # per slice, LAYOUT_SEPARATE
MAX_SHARED_COUNTERS_INLINE = 32  # all sets of one slice together, LAYOUT_INLINE (1.34)
MAX_DEVICE_COUNTERS_INLINE = 1024  # device counter entries per slice, LAYOUT_INLINE (1.34)
LAYOUT_SEPARATE = "separate"
LAYOUT_INLINE = "inline"
LAYOUTS = (LAYOUT_SEPARATE, LAYOUT_INLINE)
MAX_TAINT_VALUE = 63
CONTENT_ANNOTATION = f"{DRIVER_NAME}/content-hash"
UNHEALTHY_TAINT_KEY = f"{DRIVER_NAME}/unhealthy"
# a GPU taken out of service by its remediation (NoSchedule; NoExecute where the policy says)
REMEDIATION_TAINT_KEY = f"{DRIVER_NAME}/remediation"
TAINT_EFFECTS = ("NoSchedule", "NoExecute")
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"

_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9._-]")


def taint_value(reason: str) -> str:
    """A health reason as a label value (the taint value's syntax): ``XID 79`` → ``XID-79``."""
    v = _LABEL_VALUE_BAD.sub("-", reason)[:MAX_TAINT_VALUE].strip("-._")
    return v


def device_body(dev: DraDevice, unhealthy_reason: str | None,
                extra_taints: Sequence[Mapping[str, str]] = ()) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": dev.name,
        "attributes": dict(dev.attributes),
        "capacity": dict(dev.capacity),
    }
    if dev.shared:
        body["allowMultipleAllocations"] = True
    if dev.consumes:
        body["consumesCounters"] = [
            {"counterSet": cset, "counters": {k: {"value": str(v)} for k, v in sorted(counters.items())}}
            for cset, counters in sorted(dev.consumes.items())
        ]
    taints = [dict(t) for t in extra_taints]
    if unhealthy_reason is not None:
        taints.insert(0, {"key": UNHEALTHY_TAINT_KEY, "value": taint_value(unhealthy_reason), "effect": "NoSchedule"})
    if taints:
        body["taints"] = taints
    return body


def remediation_taint(reason: str, effect: str) -> dict[str, str]:
    """The taint a device of a GPU under remediation carries (``effect``: NoSchedule or NoExecute)."""
    if effect not in TAINT_EFFECTS:
        raise ValueError(f"taint effect must be one of {', '.join(TAINT_EFFECTS)}: {effect!r}")
    return {"key": REMEDIATION_TAINT_KEY, "value": taint_value(reason), "effect": effect}


def taint_probe_body(node_name: str, driver: str = DRIVER_NAME) -> dict[str, Any]:
    """A ResourceSlice of one tainted device, only ever sent as a dry run: the API server's answer keeps the
    taint when it serves device taints (beta from 1.36; 1.34/1.35 with DRADeviceTaints) and drops it
    otherwise."""
    return {"apiVersion": API_VERSION, "kind": "ResourceSlice",
            "metadata": {"name": f"{node_name}-{driver}-taint-probe"},
            "spec": {"driver": driver, "nodeName": node_name,
                     "pool": {"name": node_name, "generation": 0, "resourceSliceCount": 1},
                     "devices": [{"name": "probe", "taints": [
                         {"key": REMEDIATION_TAINT_KEY, "value": "probe", "effect": "NoSchedule"}]}]}}


def counter_set_body(cs: CounterSet) -> dict[str, Any]:
    return {"name": cs.name, "counters": {k: {"value": str(v)} for k, v in sorted(cs.counters.items())}}


@dataclass(frozen=True)
class PoolContent:
    """What the pool publishes, independent of its generation."""

    devices: tuple[dict[str, Any], ...]
    counter_sets: tuple[dict[str, Any], ...] = ()

    @property
    def digest(self) -> str:
        return self.digest_for(LAYOUT_SEPARATE)

    @property
    def shared(self) -> bool:
        """Whether a device allows multiple allocations (consumable capacity)."""
        return any(d.get("allowMultipleAllocations") for d in self.devices)

    def without_sharing(self) -> PoolContent:
        """The pool for an API without consumable capacity: shared devices published as ordinary ones (their
        memory capacity without a request policy, no compute share)."""
        return PoolContent(tuple(_unshared(d) for d in self.devices), self.counter_sets)

    def digest_for(self, layout: str) -> str:
        """The content hash; with counters the layout is part of it (a server upgrade re-lays the pool)."""
        doc: Any = self.devices if not self.counter_sets else [layout, self.devices, self.counter_sets]
        raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()[:32]


def _unshared(dev: dict[str, Any]) -> dict[str, Any]:
    if not dev.get("allowMultipleAllocations"):
        return dev
    out = {k: v for k, v in dev.items() if k != "allowMultipleAllocations"}
    out["capacity"] = {name: {"value": c["value"]} for name, c in dev["capacity"].items()
                       if name != COMPUTE_SHARE_CAPACITY}
    return out


def consumable_capacity_for(git_version: str) -> bool:
    """Whether a kube-apiserver of that version serves consumable capacity by default (beta from 1.36;
    alpha and off by default in 1.34 and 1.35, when the API drops the fields)."""
    v = _minor_version(git_version)
    return v is not None and v >= (1, 36)


def _minor_version(git_version: str) -> tuple[int, int] | None:
    parts = git_version.lstrip("v").split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "0")
    except (ValueError, IndexError):
        return None


def pool_content(devices: Sequence[DraDevice], unhealthy: Mapping[str, str] | None = None,
                 counter_sets: Sequence[CounterSet] = (),
                 taints: Mapping[str, Sequence[Mapping[str, str]]] | None = None) -> PoolContent:
    """``unhealthy``: device name → reason; those devices carry the unhealthy taint. ``counter_sets``: the
    shared counters the devices consume (``nodeagent.dra.devices.build_counter_sets``). ``taints``: device
    name → further taints (a remediation's)."""
    bad = unhealthy or {}
    more = taints or {}
    return PoolContent(tuple(device_body(d, bad.get(d.name), more.get(d.name, ())) for d in devices),
                       tuple(counter_set_body(c) for c in counter_sets))


def layout_for(git_version: str) -> str:
    """The counter layout a kube-apiserver of that version (``v1.34.4``) accepts."""
    v = _minor_version(git_version)
    if v is None:
        return LAYOUT_SEPARATE
    return LAYOUT_INLINE if v < (1, 35) else LAYOUT_SEPARATE


def slice_name(node_name: str, i: int, driver: str = DRIVER_NAME) -> str:
    return f"{node_name}-{driver}-{i}"


def _advanced(dev: Mapping[str, Any]) -> bool:
    return bool(dev.get("consumesCounters") or dev.get("taints"))


def _device_counters(dev: Mapping[str, Any]) -> int:
    return sum(len(c["counters"]) for c in dev.get("consumesCounters") or ())


def _set_size(cs: Mapping[str, Any]) -> int:
    return len(cs["counters"])


def _chunks(devs: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    return [devs[i:i + size] for i in range(0, len(devs), size)]


Chunk = tuple[list[dict[str, Any]], list[dict[str, Any]]]  # (devices, counter sets) of one slice


def _layout_separate(content: PoolContent, max_devices: int) -> list[Chunk]:
    sets = list(content.counter_sets)
    out: list[Chunk] = [([], sets[i:i + MAX_COUNTER_SETS]) for i in range(0, len(sets), MAX_COUNTER_SETS)]
    devs = list(content.devices)
    if any(_advanced(d) for d in devs):
        max_devices = min(max_devices, MAX_DEVICES_ADVANCED)
    out.extend((c, []) for c in _chunks(devs, max_devices))
    return out


def _layout_inline(content: PoolContent, max_devices: int) -> list[Chunk]:
    """Each counter set with the devices consuming it; groups packed into slices within the 1.34 limits."""
    if any(_advanced(d) for d in content.devices):
        max_devices = min(max_devices, MAX_DEVICES_ADVANCED)
    users: dict[str, list[dict[str, Any]]] = {str(cs["name"]): [] for cs in content.counter_sets}
    plain: list[dict[str, Any]] = []
    for d in content.devices:
        names = [str(c["counterSet"]) for c in d.get("consumesCounters") or ()]
        if not names:
            plain.append(d)
            continue
        if len(names) != 1 or names[0] not in users:
            raise ValueError(f"device {d['name']}: consumes counter sets {names}, inline layout needs one "
                             "published set")
        users[names[0]].append(d)
    out: list[Chunk] = []
    cur: Chunk = ([], [])
    for cs in content.counter_sets:
        group = users[str(cs["name"])]
        entries = sum(_device_counters(d) for d in group)
        if (_set_size(cs) > MAX_SHARED_COUNTERS_INLINE or len(group) > max_devices
                or entries > MAX_DEVICE_COUNTERS_INLINE):
            raise ValueError(f"counter set {cs['name']}: {len(group)} devices with {entries} counter entries "
                             "and its counters do not fit one ResourceSlice")
        fits = (sum(map(_set_size, cur[1])) + _set_size(cs) <= MAX_SHARED_COUNTERS_INLINE
                and len(cur[0]) + len(group) <= max_devices
                and sum(map(_device_counters, cur[0])) + entries <= MAX_DEVICE_COUNTERS_INLINE)
        if not fits:
            out.append(cur)
            cur = ([], [])
        cur[0].extend(group)
        cur[1].append(cs)
    if cur[1]:
        out.append(cur)
    out.extend((c, []) for c in _chunks(plain, max_devices))
    return out


def build_slices(
    node_name: str,
    content: PoolContent,
    generation: int,
    *,
    driver: str = DRIVER_NAME,
    max_devices: int = MAX_DEVICES,
    layout: str = LAYOUT_SEPARATE,
) -> list[dict[str, Any]]:
    """The ResourceSlice objects for one pool generation (at least one slice, maybe without devices)."""
    if not 1 <= max_devices <= MAX_DEVICES:
        raise ValueError(f"max_devices must be within 1..{MAX_DEVICES}: {max_devices}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}: {layout!r}")
    if not content.counter_sets:
        if any(_advanced(d) for d in content.devices):
            max_devices = min(max_devices, MAX_DEVICES_ADVANCED)
        chunks: list[Chunk] = [(c, []) for c in _chunks(list(content.devices), max_devices)]
    elif layout == LAYOUT_SEPARATE:
        chunks = _layout_separate(content, max_devices)
    else:
        chunks = _layout_inline(content, max_devices)
    chunks = chunks or [([], [])]
    digest = content.digest_for(layout)
    out: list[dict[str, Any]] = []
    for i, (chunk, sets) in enumerate(chunks):
        spec: dict[str, Any] = {
            "driver": driver,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(chunks)},
        }
        if sets and layout == LAYOUT_SEPARATE:
            spec["sharedCounters"] = sets
        else:
            spec["devices"] = chunk
            if sets:
                spec["sharedCounters"] = sets
        out.append({
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {
                "name": slice_name(node_name, i, driver),
                "labels": {MANAGED_BY_LABEL: "nodeagent"},
                "annotations": {CONTENT_ANNOTATION: digest},
            },
            "spec": spec,
        })
    return out
