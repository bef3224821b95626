"""Publishes the node's pool as ResourceSlices, writing only when the content changed.

``sync(content)`` (blocking; call it from a worker thread) compares the wanted content with what it last
wrote. The first call reads the node's slices of this driver: if every one of them carries the wanted
content hash and the slice count matches, they are adopted as they are (a restart writes nothing);
otherwise the pool generation becomes one more than the highest seen and all slices are rewritten.
Every later change bumps the generation, replaces the slices by name (create when missing) and deletes
the slices beyond the new count. ``remove()`` deletes all of the node's slices of this driver.

Shared counters are laid out as the API server's version requires (``nodeagent.dra.slices``): unless
given, the layout is read from ``/version`` at the first sync of a pool with counters. Shared devices
(consumable capacity) are published as such only to an API server that serves the feature by default
(1.36 and later, or ``consumable=True``); an older one gets them as ordinary devices.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from nodeagent.dra import DRIVER_NAME
from nodeagent.dra.slices import (
    API_VERSION,
    CONTENT_ANNOTATION,
    LAYOUTS,
    MAX_DEVICES,
    PoolContent,
    build_slices,
    consumable_capacity_for,
    layout_for,
    taint_probe_body,
)
from nodeagent.errors import KubeError
from nodeagent.kube.client import KubeClient

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    generation: int
    writes: int  # create + replace + delete requests sent
    slices: int


class SlicePublisher:
    def __init__(self, kube: KubeClient, node_name: str, *, driver: str = DRIVER_NAME,
                 max_devices: int = MAX_DEVICES, layout: str | None = None,
                 consumable: bool | None = None) -> None:
        if layout is not None and layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}: {layout!r}")
        self.kube = kube
        self.layout = layout
        self.consumable = consumable
        self.server_version: str | None = None
        self.taints: bool | None = None  # whether the API server keeps device taints (None: not asked yet)
        self.node_name = node_name
        self.driver = driver
        self.max_devices = max_devices
        self.generation = 0
        self._digest: str | None = None  # content hash of what the API holds, None = unknown
        self._names: set[str] = set()
        self._stale = False  # set by invalidate() from any thread without waiting for a running sync
        self._lock = threading.Lock()
        self.writes = 0

    @property
    def selector(self) -> str:
        return f"spec.nodeName={self.node_name},spec.driver={self.driver}"

    def _current(self) -> dict[str, dict[str, Any]]:
        items = self.kube.list_resource_slices(field_selector=self.selector)
        return {str(it["metadata"]["name"]): it for it in items}

    def sync(self, content: PoolContent) -> SyncResult:
        with self._lock:
            return self._sync(content)

    def _sync(self, content: PoolContent) -> SyncResult:
        if self._stale:
            self._stale = False
            self._digest = None
        layout = self._layout(content)
        if content.shared and not self._consumable():
            content = content.without_sharing()
        digest = content.digest_for(layout)
        if self._digest == digest:
            return SyncResult(self.generation, 0, len(self._names))
        current = self._current()
        gens = [int(it["spec"]["pool"].get("generation", 0)) for it in current.values()]
        if self._digest is None and current:
            counts = {int(it["spec"]["pool"].get("resourceSliceCount", 0)) for it in current.values()}
            same = all(it["metadata"].get("annotations", {}).get(CONTENT_ANNOTATION) == digest
                       for it in current.values())
            if same and len(set(gens)) == 1 and counts == {len(current)}:
                self.generation = gens[0]
                self._digest = digest
                self._names = set(current)
                log.info("DRA pool %s: adopted %d ResourceSlice(s) at generation %d", self.node_name,
                         len(current), self.generation)
                return SyncResult(self.generation, 0, len(current))
        self.generation = max([self.generation, *gens]) + 1
        wanted = build_slices(self.node_name, content, self.generation, driver=self.driver,
                              max_devices=self.max_devices, layout=layout)
        writes = 0
        for body in wanted:
            name = body["metadata"]["name"]
            old = current.get(name)
            if old is None:
                self.kube.create_resource_slice(body)
            else:
                body["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
                self.kube.replace_resource_slice(name, body)
            writes += 1
        names = {b["metadata"]["name"] for b in wanted}
        for name in sorted(set(current) - names):
            self.kube.delete_resource_slice(name)
            writes += 1
        self._names = names
        self._digest = digest
        self.writes += writes
        log.info("DRA pool %s: generation %d, %d device(s) in %d ResourceSlice(s)", self.node_name,
                 self.generation, len(content.devices), len(wanted))
        return SyncResult(self.generation, writes, len(wanted))

    def _version(self) -> str:
        if self.server_version is None:
            self.server_version = str(self.kube.request("GET", "/version", action="read the API server version")
                                      .get("gitVersion", ""))
        return self.server_version

    def _layout(self, content: PoolContent) -> str:
        if self.layout is None and content.counter_sets:
            version = self._version()
            self.layout = layout_for(version)
            log.info("DRA pool %s: API server %s, shared counters laid out %s", self.node_name, version,
                     self.layout)
        return self.layout or layout_for("")

    def _consumable(self) -> bool:
        if self.consumable is None:
            version = self._version()
            self.consumable = consumable_capacity_for(version)
            log.info("DRA pool %s: API server %s, shared GPUs published %s", self.node_name, version,
                     "with consumable capacity" if self.consumable else
                     "as ordinary devices (no consumable capacity before Kubernetes 1.36)")
        return self.consumable

    def device_taints(self) -> bool:
        """Whether the API server keeps device taints in ResourceSlices: asked once with a dry-run create of a
        one-device slice (nothing is stored); a server without the feature drops the field from its answer."""
        if self.taints is None:
            group = API_VERSION.split("/")[0]
            path = f"/apis/{API_VERSION}/resourceslices?dryRun=All"
            try:
                answer = self.kube.request("POST", path, body=taint_probe_body(self.node_name, self.driver),
                                           action=f"ask whether {group} keeps device taints")
            except KubeError as e:  # not known now: not remembered, asked again next time
                log.warning("DRA pool %s: whether the API server keeps device taints is unknown: %s",
                            self.node_name, e)
                return False
            devices = answer.get("spec", {}).get("devices") or [{}]
            self.taints = bool(devices[0].get("taints"))
            log.info("DRA pool %s: the API server %s device taints", self.node_name,
                     "keeps" if self.taints else "drops (DRADeviceTaints off)")
        return self.taints

    def invalidate(self) -> None:
        """Forget what the API holds (outage, kubelet wipe): the next ``sync`` reads and compares again.
        Never blocks; a sync running right now is followed by a full one."""
        self._stale = True

    def remove(self) -> int:
        """Delete every ResourceSlice of this node and driver; the number deleted."""
        with self._lock:
            n = 0
            for name in sorted(self._current()):
                try:
                    if self.kube.delete_resource_slice(name):
                        n += 1
                except KubeError as e:
                    log.warning("cannot delete ResourceSlice %s: %s", name, e)
                    raise
            self.writes += n
            self._digest = None
            self._names = set()
            return n
