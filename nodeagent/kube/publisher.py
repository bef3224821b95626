"""``NodePublisher``: what the node has, made visible on the API server with the fewest writes.

``publish(inventory, served_resources, plugin_config)`` computes labels, unserved extended resources and
GPU objects (pure planners), compares them with the last known Node (from the watch, else one GET) and
writes only differences: a pass where nothing changed makes no write at all. A GPU whose ``health``
changed between passes gets a Node Event (``GpuUnhealthy`` Warning / ``GpuHealthy``). With ``start_watch`` the
publisher keeps one watch on the own Node and re-applies its values when somebody (the kubelet, a user)
resets them. With a ``StatusStage`` the status values are not written here but staged for the
``ConditionWriter``, which sends them in its next status patch together with the Node conditions.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

from nodeagent.config import PublishSettings
from nodeagent.errors import KubeError, KubeletError
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient
from nodeagent.kube.conditions import StatusStage
from nodeagent.kube.events import RESOURCE_REFUSED, EventRecorder
from nodeagent.kube.gpuobjects import GpuObjects, SyncResult, desired_gpu_objects, gpu_of_device
from nodeagent.kube.labels import (
    MANAGED_LABELS_ANNOTATION,
    NetFacts,
    desired_labels,
    parse_managed,
    plan_label_patch,
    sharing_facts,
)
from nodeagent.kube.node import NodeClient, NodeSubscription, NodeView, NodeWatchHub
from nodeagent.kube.nodefeature import NodeFeatureWriter
from nodeagent.kube.podresources import Assignment, PodResourcesClient
from nodeagent.kube.resources import (
    MANAGED_RESOURCES_ANNOTATION,
    ResourceSettings,
    desired_resources,
    merge_fields,
    plan_status,
)
from nodeagent.net.nics import read_nics
from nodeagent.sharing.spec import PluginConfig

log = logging.getLogger(__name__)

_S = TypeVar("_S")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _in_worker_thread(
    method: Callable[Concatenate[_S, _P], _R],
) -> Callable[Concatenate[_S, _P], Coroutine[Any, Any, _R]]:
    """The awaitable twin of a blocking method: the same call, run in a worker thread off the event loop."""

    async def run(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return await asyncio.to_thread(method, self, *args, **kwargs)

    run.__name__ = f"a{method.__name__}"
    run.__doc__ = f"``{method.__name__}`` for asyncio callers (runs in a worker thread)."
    return run


@dataclass
class PublishResult:
    label_changes: dict[str, str | None] = field(default_factory=dict)
    status_ops: list[dict[str, Any]] = field(default_factory=list)
    metadata_writes: int = 0
    status_writes: int = 0
    status_staged: bool = False  # status values handed to the StatusStage (written with the conditions)
    gpu_objects: SyncResult = field(default_factory=SyncResult)
    refused: tuple[str, ...] = ()
    errors: list[str] = field(default_factory=list)

    @property
    def writes(self) -> int:
        return self.metadata_writes + self.status_writes + self.gpu_objects.writes

    def by_target(self) -> dict[str, int]:
        """The writes of this pass by what they wrote (the metrics' ``target`` label)."""
        return {"labels": self.metadata_writes, "status": self.status_writes,
                "gpu_objects": self.gpu_objects.writes}


@dataclass(frozen=True)
class _Inputs:
    inventory: Inventory
    served: frozenset[str]
    plugin_config: PluginConfig | None
    health: Mapping[int, bool] | None


class NodePublisher:
    """Publishes one node's GPU facts; blocking ``publish`` (use ``apublish`` from asyncio)."""

    def __init__(
        self,
        kube: KubeClient,
        node_name: str,
        settings: PublishSettings | None = None,
        *,
        resources: ResourceSettings | None = None,
        paths: HostPaths | None = None,
        pod_resources: PodResourcesClient | None = None,
        net: NetFacts | None = None,
        events: EventRecorder | None = None,
        watches: NodeWatchHub | None = None,
        status_stage: StatusStage | None = None,
    ) -> None:
        self.kube = kube
        self.status_stage = status_stage
        self.settings = settings or PublishSettings()
        self.resources = resources or ResourceSettings()  # the config file names none: the defaults
        self.node = NodeClient(kube, node_name, watches=watches)
        self.paths = paths or HostPaths()
        self.pod_resources = pod_resources
        self.fixed_net = net
        self.events = events or EventRecorder(self.node, enabled=self.settings.events)
        self.gpus = GpuObjects(kube, node_name)
        # [publish] labels = "nodefeature": the labels go to NFD's NodeFeature object of the node
        self.node_feature = NodeFeatureWriter(kube, node_name, self.settings.nodefeature_namespace)
        self._node_feature_gone = False  # publishing on the Node: a NodeFeature of an earlier run was deleted
        self.reapplied = 0
        self.reapply_per_minute = 6  # more re-applies than this in a minute wait for the next resync
        self._reapplies: list[float] = []
        self._latest: NodeView | None = None
        self._inputs: _Inputs | None = None
        self._lock = threading.RLock()
        self._watch: NodeSubscription | None = None
        self._refused_reported: frozenset[str] = frozenset()
        self._assignments: list[Assignment] = []
        self._want_labels: dict[str, str] = {}
        self._want_resources: dict[str, str] = {}
        self._health_seen: dict[str, bool] = {}  # GPU UUID → health last published (events on change)

    # node state ---------------------------------------------------------------------------------
    def _current(self) -> NodeView:
        if self._latest is None or self._watch is None:
            self._latest = self.node.get()
        written = self.status_stage.written_view() if self.status_stage is not None else None
        if written is not None and written.name == self.node.name and _rv_newer(written, self._latest):
            self._latest = written  # the conditions writer wrote our staged values since
        return self._latest

    def _net(self) -> NetFacts | None:
        if self.fixed_net is not None:
            return self.fixed_net
        try:
            s = read_nics(self.paths)
        except OSError as e:
            log.warning("cannot read network facts: %s", e)
            return None
        return NetFacts(s.fastest_nic_speed_mbps, s.rdma_nics)

    def _read_assignments(self) -> list[Assignment]:
        if self.pod_resources is None:
            return []
        try:
            self._assignments = self.pod_resources.list()
        except KubeletError as e:
            log.warning("PodResources unavailable, keeping the last known allocations: %s", e)
        return self._assignments

    # publishing ---------------------------------------------------------------------------------
    def publish(
        self,
        inventory: Inventory,
        served_resources: Iterable[str] = (),
        plugin_config: PluginConfig | None = None,
        *,
        health: Mapping[int, bool] | None = None,
    ) -> PublishResult:
        """Bring labels, status and GPU objects in line with ``inventory``; writes only differences."""
        with self._lock:
            self._inputs = _Inputs(inventory, frozenset(served_resources), plugin_config, health)
            return self._publish(self._inputs)

    apublish = _in_worker_thread(publish)

    def _publish(self, inp: _Inputs) -> PublishResult:
        res = PublishResult()
        cfg = self.settings
        node = self._current()
        sharing = sharing_facts(inp.plugin_config)

        labels_meta: dict[str, str | None] = {}
        annotations: dict[str, str | None] = {}
        feature_labels: dict[str, str] | None = None
        if cfg.labels:
            wanted = desired_labels(inp.inventory, sharing, self._net())
            if cfg.through_nodefeature:
                # NFD's master applies them: the labels nodeagent wrote on the Node before are given up first
                feature_labels, self._want_labels = wanted, {}
            else:
                self._want_labels = wanted
            lp = plan_label_patch(node.labels, node.annotations, self._want_labels)
            labels_meta, annotations = dict(lp.labels), dict(lp.annotations)

        want_res = desired_resources(inp.inventory, self.resources) if cfg.extended_resources else {}
        self._want_resources = {k: v for k, v in want_res.items() if k not in inp.served}
        sp = plan_status(
            node.capacity, node.allocatable, node.annotations, want_res, inp.served,
            has_capacity=bool(node.capacity), has_allocatable=bool(node.allocatable),
        )
        status_ops: list[dict[str, Any]] = sp.ops
        if sp.annotation_before is not None:
            annotations[MANAGED_RESOURCES_ANNOTATION] = sp.annotation_before
        after: str | None = sp.annotation_after
        res.refused = sp.refused

        if labels_meta or annotations:
            view = self.node.patch_metadata(labels=labels_meta, annotations=annotations)
            res.metadata_writes += 1
            res.label_changes = labels_meta
            if view is not None:
                node = self._remember(view)
        if self.status_stage is not None:
            # the conditions writer sends these with its next patch; the ownership annotation shrinks only
            # once the Node shows the removal (a later pass), never before the removal is written
            self.status_stage.stage(merge_fields(status_ops))
            res.status_staged = bool(status_ops)
            res.status_ops = status_ops
            if status_ops:
                after = None
        elif status_ops:
            view = self.node.patch_status(status_ops)
            res.status_writes += 1
            res.status_ops = status_ops
            if view is not None:
                node = self._remember(view)
        if after is not None:
            view = self.node.patch_metadata(annotations={MANAGED_RESOURCES_ANNOTATION: after or None})
            res.metadata_writes += 1
            if view is not None:
                node = self._remember(view)

        if sp.refused and frozenset(sp.refused) != self._refused_reported:
            self.events.record(
                RESOURCE_REFUSED,
                "not publishing " + ", ".join(sp.refused) + ": a device plugin serves these names",
                "Warning",
            )
        self._refused_reported = frozenset(sp.refused)

        self._health_events(inp)
        self._publish_node_feature(feature_labels, node.uid, res)

        if cfg.gpu_objects:
            desired = desired_gpu_objects(
                self.node.name, inp.inventory, sharing, self._read_assignments(), inp.health
            )
            try:
                res.gpu_objects = self.gpus.sync(desired, node.uid or self.node.uid())
            except KubeError as e:
                log.warning("GPU objects not published: %s", e)
                res.errors.append(str(e))
        return res

    def _publish_node_feature(self, labels: dict[str, str] | None, node_uid: str | None, res: PublishResult) -> None:
        """The NodeFeature holds ``labels``; with None (labels on the Node, or none) an earlier run's is deleted
        once."""
        try:
            if labels is not None:
                self._node_feature_gone = False
                if self.node_feature.sync(labels, node_uid or self.node.uid()):
                    res.metadata_writes += 1
            elif not self._node_feature_gone:
                self._node_feature_gone = True
                if self.node_feature.remove():
                    log.info("deleted the NodeFeature %s/%s: labels go on the Node", self.node_feature.namespace,
                             self.node.name)
        except KubeError as e:
            if labels is None and e.status in (403, 404):  # no NFD CRD, or a role without NodeFeatures
                return
            log.warning("NodeFeature of node %s not written: %s", self.node.name, e)
            res.errors.append(str(e))

    def _health_events(self, inp: _Inputs) -> None:
        """A Node Event for every GPU whose health changed since the last pass (a GPU first seen unhealthy
        counts as a change; one first seen healthy does not)."""
        if inp.health is None:
            return
        for g in sorted(inp.inventory.gpus, key=lambda x: x.index):
            healthy = inp.health.get(g.index, True)
            before = self._health_seen.get(g.uuid, True)
            self._health_seen[g.uuid] = healthy
            if healthy == before:
                continue
            detail = ("the kubelet no longer allocates its devices" if not healthy
                      else "its devices are allocatable again")
            pods = self._pods_on(g.index, inp) if not healthy else ()
            if pods:
                detail += f"; pods holding it: {', '.join(pods)}"
            self.events.health_changed(f"{g.index} ({g.uuid}, {g.name})", healthy, detail)

    def _pods_on(self, gpu: int, inp: _Inputs) -> tuple[str, ...]:
        """``namespace/name`` of the pods the kubelet's PodResources shows holding a device of ``gpu`` (one
        of the served resources)."""
        pods = {f"{a.namespace}/{a.pod}" for a in self._read_assignments()
                if a.resource in inp.served
                and any(gpu_of_device(d, inp.inventory) == gpu for d in a.device_ids)}
        return tuple(sorted(pods))

    def _remember(self, view: NodeView) -> NodeView:
        if self._latest is None or not self._latest.resource_version or _rv_newer(view, self._latest):
            self._latest = view
        return view

    # watching -----------------------------------------------------------------------------------
    def drifted(self, view: NodeView) -> bool:
        """True when ``view`` lacks a label or resource value this publisher last wanted."""
        for k, v in self._want_labels.items():
            if view.labels.get(k) != v:
                return True
        owned = parse_managed(view.annotations.get(MANAGED_LABELS_ANNOTATION))
        if self._want_labels and owned != set(self._want_labels):
            return True
        if self.status_stage is not None and self.status_stage.peek():
            return False  # the resource values are staged, not written yet: that is no reset
        for k, v in self._want_resources.items():
            if view.capacity.get(k) != v or view.allocatable.get(k) != v:
                return True
        return False

    def on_node(self, view: NodeView) -> None:
        """Watch callback: keep the newest Node; re-apply our values if they were reset."""
        if view.deleted:
            with self._lock:
                self._latest = None
                self.gpus.invalidate()
            return
        with self._lock:
            self._latest = view
            if self._inputs is None or not self.drifted(view):
                return
            now = time.monotonic()
            recent = [t for t in self._reapplies if now - t < 60.0]
            if len(recent) >= self.reapply_per_minute:
                # something keeps resetting our values: do not fight it faster than this
                log.warning("node %s keeps losing values nodeagent set; next resync re-applies",
                            self.node.name)
                return
            self._reapplies = [*recent, now]
            log.info("node %s lost values nodeagent set; re-applying", self.node.name)
            self.reapplied += 1
            try:
                self._publish(self._inputs)
            except KubeError as e:
                log.warning("re-applying to node %s failed: %s", self.node.name, e)

    def start_watch(self, **kwargs: Any) -> NodeSubscription:
        if self._watch is None:
            self._watch = self.node.watch(self.on_node, **kwargs)
        return self._watch

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None


def _rv_newer(a: NodeView, b: NodeView) -> bool:
    try:
        return int(a.resource_version) >= int(b.resource_version)
    except ValueError:
        return True
