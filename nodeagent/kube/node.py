"""The own Node: read it, patch its labels/annotations/status, record Events on it, watch it.

Every method of ``NodeClient`` is blocking (one HTTP request each); async callers either use the ``a*``
wrappers (``asyncio.to_thread``) or run them in threads themselves. ``NodeWatch`` keeps exactly one
watch open on the own Node (field selector ``metadata.name``) through the one watch loop (kube/watch.py):
it resumes from the last resourceVersion, relists only that one node after ``410 Gone`` and backs off with
jitter after errors (a 410 right after a relist too, so a server that always answers 410 is not hammered).
The back-off starts over only once a watch has stayed open for ``healthy_after_s``, not at every event.

``NodeClient.watch`` / ``NodeClient.updates`` subscribe through a ``NodeWatchHub`` to ONE shared
``NodeWatch`` per API client and node: the daemon owns one hub and hands it to every ``NodeClient`` it
makes, so the publisher (re-applying reset values) and the MIG reconciler (the ``mig.config`` label)
share a single watch request; a late subscriber gets the newest known version at once, and the watch ends
with its last subscriber. ``updates`` keeps only the newest version not yet taken (bounded, whatever the
consumer's pace).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from nodeagent.backoff import Backoff
from nodeagent.errors import KubeError
from nodeagent.kube.client import JSON_PATCH, MERGE_PATCH, KubeClient, WatchStream
from nodeagent.kube.watch import WatchLoop

log = logging.getLogger(__name__)

EVENT_NAMESPACE = "default"  # where the kubelet records Node events too
COMPONENT = "nodeagent"
EVENT_MESSAGE_MAX = 1024
EVENT_TYPES = ("Normal", "Warning")
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class NodeView:
    """What nodeagent needs to know about a Node, decoded from its JSON."""

    name: str
    uid: str = ""
    resource_version: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    capacity: Mapping[str, str] = field(default_factory=dict)
    allocatable: Mapping[str, str] = field(default_factory=dict)
    deleted: bool = False
    conditions: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, deleted: bool = False) -> NodeView:
        meta = obj.get("metadata") or {}
        status = obj.get("status") or {}
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            resource_version=str(meta.get("resourceVersion", "")),
            labels=dict(meta.get("labels") or {}),
            annotations=dict(meta.get("annotations") or {}),
            capacity=dict(status.get("capacity") or {}),
            allocatable=dict(status.get("allocatable") or {}),
            deleted=deleted,
            conditions=tuple(dict(c) for c in status.get("conditions") or () if isinstance(c, Mapping)),
        )


class NodeClient:
    """Blocking operations on one Node, the node nodeagent runs on."""

    def __init__(self, kube: KubeClient, node_name: str, *, watches: NodeWatchHub | None = None) -> None:
        if not node_name:
            raise ValueError("node name must not be empty")
        self.kube = kube
        self.name = node_name
        # Without a hub given, this client has its own: only its own subscribers share one watch.
        self.watches = watches if watches is not None else NodeWatchHub()
        self._uid = ""

    @property
    def path(self) -> str:
        return f"/api/v1/nodes/{self.name}"

    def _view(self, obj: Mapping[str, Any]) -> NodeView:
        view = NodeView.from_json(obj)
        if view.uid:
            self._uid = view.uid
        return view

    # reads ------------------------------------------------------------------------------------
    def get(self) -> NodeView:
        return self._view(self.kube.request("GET", self.path, action=f"read node {self.name}",
                                            subject=self.name))

    def list_one(self) -> tuple[NodeView | None, str]:
        """List with a field selector for this node only: (the node or None, list resourceVersion)."""
        data = self.kube.request(
            "GET",
            "/api/v1/nodes",
            query={"fieldSelector": f"metadata.name={self.name}"},
            action=f"list node {self.name}",
            subject=self.name,
        )
        items = data.get("items") or []
        rv = str((data.get("metadata") or {}).get("resourceVersion", ""))
        return (self._view(items[0]) if items else None), rv

    # writes -----------------------------------------------------------------------------------
    def patch_metadata(
        self,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> NodeView | None:
        """One JSON merge patch of labels and/or annotations (``None`` removes a key).

        Returns the patched node, or None when there was nothing to send (no request is made).
        """
        meta: dict[str, Any] = {}
        if labels:
            meta["labels"] = dict(labels)
        if annotations:
            meta["annotations"] = dict(annotations)
        if not meta:
            return None
        return self._view(
            self.kube.request(
                "PATCH",
                self.path,
                body={"metadata": meta},
                content_type=MERGE_PATCH,
                action=f"patch labels of node {self.name}",
                subject=self.name,
            )
        )

    def patch_labels(self, changes: Mapping[str, str | None]) -> NodeView | None:
        """Set (str) or remove (None) labels in one merge patch; None when ``changes`` is empty."""
        return self.patch_metadata(labels=changes)

    def patch_status(self, ops: list[dict[str, Any]]) -> NodeView | None:
        """One JSON patch on the status subresource; None when ``ops`` is empty."""
        if not ops:
            return None
        return self._view(
            self.kube.request(
                "PATCH",
                self.path + "/status",
                body=ops,
                content_type=JSON_PATCH,
                action=f"patch status of node {self.name}",
                subject=self.name,
            )
        )

    def patch_status_conditions(
        self, conditions: list[dict[str, Any]], fields: Mapping[str, Mapping[str, str | None]] | None = None
    ) -> NodeView | None:
        """One strategic-merge patch of ``status.conditions``: merged by ``type`` (the list's patch merge
        key), so conditions of other types (the kubelet's) stay as they are. ``fields`` rides along in the
        same request: status maps such as ``capacity``/``allocatable`` (name -> value, None removes the
        name; other names stay). None when there is nothing to send (no request is made)."""
        status: dict[str, Any] = {k: dict(v) for k, v in (fields or {}).items() if v}
        if conditions:
            status["conditions"] = conditions
        if not status:
            return None
        return self._view(
            self.kube.request(
                "PATCH",
                self.path + "/status",
                body={"status": status},
                content_type=STRATEGIC_MERGE_PATCH,
                action=f"patch {'conditions' if conditions else 'status'} of node {self.name}",
                subject=self.name,
            )
        )

    def uid(self) -> str:
        if not self._uid:
            self.get()
        return self._uid

    def create_event(self, reason: str, message: str, type: str = "Normal", action: str | None = None) -> str:
        """Record a core/v1 Event about this Node (``kubectl describe node`` shows it); its name."""
        if type not in EVENT_TYPES:
            raise ValueError(f"event type must be Normal or Warning, not {type!r}")
        if not reason:
            raise ValueError("event reason must not be empty")
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        micro = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        if len(message.encode()) > EVENT_MESSAGE_MAX:
            message = message.encode()[: EVENT_MESSAGE_MAX - 3].decode(errors="ignore") + "..."
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{self.name}.", "namespace": EVENT_NAMESPACE},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self.uid()},
            "reason": reason,
            "message": message,
            "type": type,
            "source": {"component": COMPONENT, "host": self.name},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "eventTime": micro,
            "count": 1,
            "reportingComponent": COMPONENT,
            "reportingInstance": self.name,
            "action": action or reason,
        }
        out = self.kube.request(
            "POST",
            f"/api/v1/namespaces/{EVENT_NAMESPACE}/events",
            body=body,
            action=f"create event {reason} on node {self.name}",
            subject=self.name,
        )
        return str((out.get("metadata") or {}).get("name", ""))

    def list_events(self) -> list[dict[str, Any]]:
        """Events recorded about this Node (any component)."""
        data = self.kube.request(
            "GET",
            f"/api/v1/namespaces/{EVENT_NAMESPACE}/events",
            query={"fieldSelector": f"involvedObject.kind=Node,involvedObject.name={self.name}"},
            action=f"list events of node {self.name}",
            subject=self.name,
        )
        return list(data.get("items") or [])

    def open_watch(self, resource_version: str, timeout_s: int) -> WatchStream:
        query: dict[str, str | int | bool] = {
            "fieldSelector": f"metadata.name={self.name}",
            "allowWatchBookmarks": True,
            "timeoutSeconds": timeout_s,
        }
        if resource_version:
            query["resourceVersion"] = resource_version
        return self.kube.stream(
            "/api/v1/nodes",
            query=query,
            timeout=(10.0, float(timeout_s) + 30.0),
            action=f"watch node {self.name}",
            subject=self.name,
        )

    # async wrappers ---------------------------------------------------------------------------
    async def aget(self) -> NodeView:
        return await asyncio.to_thread(self.get)

    async def apatch_labels(self, changes: Mapping[str, str | None]) -> NodeView | None:
        return await asyncio.to_thread(self.patch_labels, changes)

    async def acreate_event(
        self, reason: str, message: str, type: str = "Normal", action: str | None = None
    ) -> str:
        return await asyncio.to_thread(self.create_event, reason, message, type, action)

    def watch(self, on_node: Callable[[NodeView], None], **kwargs: Any) -> NodeSubscription:
        """Deliver every version of this node to ``on_node`` (first the newest known, then each change).

        All subscribers through the same hub on the same ``KubeClient`` and node share one ``NodeWatch``
        (``kwargs`` of the first subscriber configure it); ``stop`` on the returned subscription unsubscribes.
        """
        return self.watches.subscribe(self, on_node, **kwargs)

    async def updates(self, **kwargs: Any) -> AsyncIterator[NodeView]:
        """Async iterator over versions of this node: first the current one, then the newest at each step.

        Versions that arrive while the consumer is busy are not queued up: only the newest one waits (a
        consumer acts on the node's current state, and memory stays bounded however slow it is)."""
        loop = asyncio.get_running_loop()
        box = _Newest(loop)
        w = self.watch(box.put_threadsafe, **kwargs)
        try:
            while True:
                yield await box.take()
        finally:
            await asyncio.to_thread(w.stop)


class _Newest:
    """A one-slot mailbox from the watch thread to the loop: a newer version replaces one not yet taken."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._view: NodeView | None = None
        self._ready = asyncio.Event()
        self.replaced = 0  # versions dropped for a newer one before they were taken

    def _put(self, view: NodeView) -> None:
        if self._view is not None:
            self.replaced += 1
        self._view = view
        self._ready.set()

    def put_threadsafe(self, view: NodeView) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone while the watch stops
            self._loop.call_soon_threadsafe(self._put, view)

    async def take(self) -> NodeView:
        while self._view is None:
            self._ready.clear()
            await self._ready.wait()
        view, self._view = self._view, None
        return view


class NodeWatch(WatchLoop):
    """One thread keeping one watch open on the own Node and handing each version to ``on_node`` (the loop,
    resume, 410 relist and back-off are ``WatchLoop``'s)."""

    def __init__(
        self,
        node: NodeClient,
        on_node: Callable[[NodeView], None],
        *,
        watch_timeout_s: int = 300,
        backoff: Backoff | None = None,
        on_error: Callable[[KubeError], None] | None = None,
        healthy_after_s: float = 10.0,
    ) -> None:
        super().__init__(f"node {node.name}", watch_timeout_s=watch_timeout_s, backoff=backoff, on_error=on_error,
                         healthy_after_s=healthy_after_s)
        self.thread_name = f"node-watch-{node.name}"
        self.node = node
        self.on_node = on_node

    def _deliver(self, view: NodeView) -> None:
        try:
            self.on_node(view)
        except Exception:
            log.exception("node watch callback failed for node %s", self.node.name)

    def _list(self) -> str:
        view, rv = self.node.list_one()
        if view is not None:
            self._deliver(view)
        return rv

    def _open(self, resource_version: str, timeout_s: int) -> WatchStream:
        return self.node.open_watch(resource_version, timeout_s)

    def _event(self, kind: str, obj: Mapping[str, Any]) -> None:
        self._deliver(NodeView.from_json(obj, deleted=kind == "DELETED"))


def _rv_int(view: NodeView) -> int | None:
    try:
        return int(view.resource_version)
    except ValueError:
        return None


class NodeSubscription:
    """One subscriber of the shared watch on a Node. Versions arrive in order (an older one than the last
    delivered is dropped); ``stop`` unsubscribes, and the last one to leave stops the watch."""

    def __init__(self, hub: _SharedWatch, on_node: Callable[[NodeView], None]) -> None:
        self._hub = hub
        self._on_node = on_node
        self._lock = threading.Lock()
        self._last_rv: int | None = None
        self._stopped = False

    @property
    def watch(self) -> NodeWatch:
        """The shared watch (its ``relists``/``errors`` counters)."""
        return self._hub.watch

    def deliver(self, view: NodeView) -> None:
        with self._lock:
            if self._stopped:
                return
            rv = _rv_int(view)
            if rv is not None and self._last_rv is not None and rv <= self._last_rv and not view.deleted:
                return
            if rv is not None:
                self._last_rv = rv
            try:
                self._on_node(view)
            except Exception:
                log.exception("node watch subscriber failed for node %s", self._hub.watch.node.name)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped = True
        self._hub.unsubscribe(self, timeout)


class _SharedWatch:
    """One ``NodeWatch`` fanned out to every subscriber; remembers the newest version for late ones."""

    def __init__(self, owner: NodeWatchHub, node: NodeClient, kwargs: dict[str, Any]) -> None:
        self._owner = owner
        self.watch = NodeWatch(node, self._fanout, **kwargs)
        self._subs: list[NodeSubscription] = []
        self._latest: NodeView | None = None
        self._lock = threading.Lock()
        self.closed = False

    def _fanout(self, view: NodeView) -> None:
        with self._lock:
            self._latest = None if view.deleted else view
            subs = list(self._subs)
        for sub in subs:
            sub.deliver(view)

    def add(self, on_node: Callable[[NodeView], None]) -> tuple[NodeSubscription, NodeView | None] | None:
        """Register a subscriber (None when this watch already ended); with the newest known version."""
        with self._lock:
            if self.closed:
                return None
            sub = NodeSubscription(self, on_node)
            self._subs.append(sub)
            return sub, self._latest

    def unsubscribe(self, sub: NodeSubscription, timeout: float) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
            last = not self._subs and not self.closed
            if last:
                self.closed = True
        if last:
            self._owner.forget(self)
            self.watch.stop(timeout)


class NodeWatchHub:
    """The shared watches of Nodes: one per (API client, node name) while it has subscribers.

    The daemon owns one for its lifetime (reloads included) and passes it to every ``NodeClient`` it makes;
    an entry goes away with its last subscriber, so a client replaced by a reload leaves nothing behind."""

    def __init__(self) -> None:
        self._watches: dict[tuple[KubeClient, str], _SharedWatch] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._watches)

    def subscribe(self, node: NodeClient, on_node: Callable[[NodeView], None],
                  **kwargs: Any) -> NodeSubscription:
        key = (node.kube, node.name)
        with self._lock:
            shared = self._watches.get(key)
            added = shared.add(on_node) if shared is not None else None
            if shared is None or added is None:
                shared = _SharedWatch(self, node, kwargs)
                self._watches[key] = shared
                added = shared.add(on_node)
            assert added is not None
        sub, latest = added
        shared.watch.start()
        if latest is not None:
            sub.deliver(latest)
        return sub

    def forget(self, shared: _SharedWatch) -> None:
        key = (shared.watch.node.kube, shared.watch.node.name)
        with self._lock:
            if self._watches.get(key) is shared:
                del self._watches[key]


def internal_ips(nodes: Iterable[Mapping[str, Any]]) -> dict[str, str | None]:
    """Node name → its first ``InternalIP`` address (None when it reports none), from Node JSON objects."""
    out: dict[str, str | None] = {}
    for n in nodes:
        name = str((n.get("metadata") or {}).get("name", ""))
        if not name:
            continue
        addresses = (n.get("status") or {}).get("addresses") or []
        out[name] = next((str(a.get("address")) for a in addresses
                          if isinstance(a, Mapping) and a.get("type") == "InternalIP" and a.get("address")), None)
    return out
