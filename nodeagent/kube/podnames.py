"""Pod UID → ``namespace/name``, for messages that name the pod behind a process (a busy-GPU refusal).

A process only tells its pod UID (from its cgroup path); the kubelet's PodResources v1 API tells which
``namespace/name`` holds which device but carries no UID. The kubelet's device-manager checkpoint
(``<device-plugins dir>/kubelet_internal_checkpoint``) joins the two: it records, per pod UID, the devices
allocated to it. A UID whose devices a PodResources pod holds gets that pod's name; a pod that holds no
device of a plugin stays unnamed (None), and callers then show the UID alone.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent import fileio
from nodeagent.errors import KubeletError
from nodeagent.kube.podresources import Assignment

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "kubelet_internal_checkpoint"


@dataclass(frozen=True)
class CheckpointEntry:
    """Devices of one resource the kubelet allocated to one container of the pod with this UID."""

    pod_uid: str
    container: str
    resource: str
    device_ids: frozenset[str]


def _device_ids(raw: Any) -> frozenset[str]:
    # Current kubelets key the IDs by NUMA node ({"0": ["id", ...]}); older ones wrote a plain list.
    if isinstance(raw, Mapping):
        return frozenset(str(d) for ids in raw.values() if isinstance(ids, list) for d in ids)
    if isinstance(raw, list):
        return frozenset(str(d) for d in raw)
    return frozenset()


def parse_checkpoint(text: str) -> list[CheckpointEntry]:
    """The pod device entries of a kubelet device-manager checkpoint (pure); [] when it has none or is not
    the JSON the kubelet writes."""
    try:
        doc = json.loads(text)
    except ValueError:
        return []
    data = doc.get("Data") if isinstance(doc, Mapping) else None
    entries = data.get("PodDeviceEntries") if isinstance(data, Mapping) else None
    out: list[CheckpointEntry] = []
    for e in entries if isinstance(entries, list) else []:
        if not isinstance(e, Mapping) or not e.get("PodUID"):
            continue
        out.append(CheckpointEntry(str(e["PodUID"]), str(e.get("ContainerName", "")),
                                   str(e.get("ResourceName", "")), _device_ids(e.get("DeviceIDs"))))
    return out


def pod_names(entries: Iterable[CheckpointEntry], assignments: Iterable[Assignment]) -> dict[str, str]:
    """Pod UID → ``namespace/name`` for every UID whose devices a PodResources assignment holds (pure)."""
    holders: dict[tuple[str, str], str] = {}
    for a in assignments:
        for dev in a.device_ids:
            holders[(a.resource, dev)] = f"{a.namespace}/{a.pod}"
    out: dict[str, str] = {}
    for e in entries:
        for dev in sorted(e.device_ids):
            name = holders.get((e.resource, dev))
            if name is not None:
                out.setdefault(e.pod_uid, name)
                break
    return out


class PodNameLookup:
    """``lookup(uid) -> "namespace/name" | None`` from the checkpoint and a PodResources ``list`` callable.

    Blocking (a file read and one gRPC call); meant for worker threads. Both sources are read at most once
    per ``max_age_s`` so naming every process of a busy GPU costs one round trip. Never raises: an
    unreachable kubelet or a missing checkpoint only means no name.
    """

    def __init__(self, checkpoint: Path, list_assignments: Callable[[], list[Assignment]],
                 *, max_age_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 root: fileio.Root | None = None) -> None:
        self.checkpoint = checkpoint
        self._root = root  # the checkpoint is resolved inside it at each read
        self._list = list_assignments
        self._max_age = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}
        self._read_at: float | None = None

    def _refresh(self) -> dict[str, str]:
        try:
            entries = parse_checkpoint(fileio.read_text(self.checkpoint, root=self._root) or "")
        except (OSError, fileio.UnreadableFileError) as e:
            log.debug("no kubelet device checkpoint at %s: %s", self.checkpoint, e)
            return {}
        if not entries:
            return {}
        try:
            assignments = self._list()
        except KubeletError as e:
            log.info("pod names unknown (PodResources): %s", e)
            return {}
        return pod_names(entries, assignments)

    def __call__(self, pod_uid: str) -> str | None:
        with self._lock:
            now = self._clock()
            if self._read_at is None or now - self._read_at > self._max_age:
                self._names = self._refresh()
                self._read_at = now
            return self._names.get(pod_uid)
