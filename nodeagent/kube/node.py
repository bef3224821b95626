"""The own Node: read it, patch its labels/annotations/status, record Events on it, watch it.

Every method of ``NodeClient`` is blocking (one HTTP request each); async callers either use the ``a*``
wrappers (``asyncio.to_thread``) or run them in threads themselves. ``NodeWatch`` keeps exactly one
watch open on the own Node (field selector ``metadata.name``), resumes from the last resourceVersion,
relists only that one node after ``410 Gone`` and backs off with jitter after errors.

``NodeClient.watch`` / ``NodeClient.updates`` subscribe to ONE shared ``NodeWatch`` per API client and
node: the publisher (re-applying reset values) and the MIG reconciler (the ``mig.config`` label) in one
agent share a single watch request; a late subscriber gets the newest known version at once, and the
watch ends with its last subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nodeagent.errors import KubeError
from nodeagent.kube.client import JSON_PATCH, MERGE_PATCH, KubeClient, WatchStream

log = logging.getLogger(__name__)

EVENT_NAMESPACE = "default"  # where the kubelet records Node events too
COMPONENT = "nodeagent"
EVENT_MESSAGE_MAX = 1024
EVENT_TYPES = ("Normal", "Warning")


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
        )


class NodeClient:
    """Blocking operations on one Node, the node nodeagent runs on."""

    def __init__(self, kube: KubeClient, node_name: str) -> None:
        if not node_name:
            raise ValueError("node name must not be empty")
        self.kube = kube
        self.name = node_name
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
        return self._view(self.kube.request("GET", self.path, action=f"read node {self.name}", subject=self.name))

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

    def labels(self) -> dict[str, str]:
        return dict(self.get().labels)

    def annotations(self) -> dict[str, str]:
        return dict(self.get().annotations)

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
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        micro = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
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

    async def apatch_status(self, ops: list[dict[str, Any]]) -> NodeView | None:
        return await asyncio.to_thread(self.patch_status, ops)

    async def acreate_event(
        self, reason: str, message: str, type: str = "Normal", action: str | None = None
    ) -> str:
        return await asyncio.to_thread(self.create_event, reason, message, type, action)

    def watch(self, on_node: Callable[[NodeView], None], **kwargs: Any) -> NodeSubscription:
        """Deliver every version of this node to ``on_node`` (first the newest known, then each change).

        All subscribers on the same ``KubeClient`` and node share one ``NodeWatch`` (``kwargs`` of the
        first subscriber configure it); ``stop`` on the returned subscription unsubscribes.
        """
        return _subscribe(self, kwargs, on_node)

    async def updates(self, **kwargs: Any) -> AsyncIterator[NodeView]:
        """Async iterator over versions of this node (first the current one, then each change)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[NodeView] = asyncio.Queue()

        def put(view: NodeView) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone while the watch stops
                loop.call_soon_threadsafe(queue.put_nowait, view)

        w = self.watch(put, **kwargs)
        try:
            while True:
                yield await queue.get()
        finally:
            await asyncio.to_thread(w.stop)


class Backoff:
    """Exponential back-off with equal jitter: half the step fixed, half random."""

    def __init__(
        self, initial: float = 0.5, maximum: float = 30.0, rng: random.Random | None = None
    ) -> None:
        self.initial = initial
        self.maximum = maximum
        self.rng = rng or random.Random()
        self.attempt = 0

    def next(self) -> float:
        step = min(self.maximum, self.initial * (2**self.attempt))
        self.attempt = min(self.attempt + 1, 32)
        return float(step / 2 + self.rng.uniform(0, step / 2))

    def reset(self) -> None:
        self.attempt = 0


class NodeWatch:
    """One thread keeping one watch on the own Node open and handing each version to ``on_node``."""

    def __init__(
        self,
        node: NodeClient,
        on_node: Callable[[NodeView], None],
        *,
        watch_timeout_s: int = 300,
        backoff: Backoff | None = None,
        on_error: Callable[[KubeError], None] | None = None,
    ) -> None:
        self.node = node
        self.on_node = on_node
        self.watch_timeout_s = watch_timeout_s
        self.backoff = backoff or Backoff()
        self.on_error = on_error
        self.relists = 0
        self.errors = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stream: WatchStream | None = None
        self._thread: threading.Thread | None = None
        self._rv = ""

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self.run, name=f"node-watch-{self.node.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _deliver(self, view: NodeView) -> None:
        try:
            self.on_node(view)
        except Exception:
            log.exception("node watch callback failed for node %s", self.node.name)

    def _relist(self) -> None:
        view, rv = self.node.list_one()
        self.relists += 1
        self._rv = rv
        if view is not None:
            self._deliver(view)

    def _watch_once(self) -> bool:
        """One watch request until the server ends it; True if anything at all arrived."""
        stream = self.node.open_watch(self._rv, self.watch_timeout_s)
        with self._lock:
            self._stream = stream
        if self._stop.is_set():
            stream.close()
            return False
        got = False
        try:
            for ev in stream:
                got = True
                kind = ev.get("type")
                obj = ev.get("object") or {}
                if kind == "ERROR":
                    code = obj.get("code")
                    msg = obj.get("message", "")
                    raise KubeError(
                        f"watch node {self.node.name}: {code} {msg}".strip(),
                        subject=self.node.name,
                        retryable=True,
                        status=int(code) if isinstance(code, int) else None,
                    )
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self._rv = str(rv)
                if kind in ("ADDED", "MODIFIED"):
                    self._deliver(NodeView.from_json(obj))
                elif kind == "DELETED":
                    self._deliver(NodeView.from_json(obj, deleted=True))
                self.backoff.reset()
        finally:
            with self._lock:
                self._stream = None
            stream.close()
        return got

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._rv:
                    self._relist()
                started = time.monotonic()
                got = self._watch_once()
                if not got and time.monotonic() - started < 1.0 and not self._stop.is_set():
                    # a stream that closes at once without a word is treated as an error
                    raise KubeError(f"watch node {self.node.name}: closed immediately", retryable=True)
            except KubeError as e:
                if self._stop.is_set():
                    break
                if e.status == 410:
                    log.info("watch of node %s expired (410); relisting it", self.node.name)
                    self._rv = ""
                    continue
                self.errors += 1
                if self.on_error is not None:
                    self.on_error(e)
                delay = self.backoff.next()
                log.warning("watch of node %s failed: %s; retrying in %.1fs", self.node.name, e, delay)
                self._stop.wait(delay)
            except Exception:
                # a bug below us must not end the only watch on the node: log it and try again later
                if self._stop.is_set():
                    break
                self.errors += 1
                delay = self.backoff.next()
                log.exception("watch of node %s broke unexpectedly; retrying in %.1fs", self.node.name, delay)
                self._stop.wait(delay)


def _rv_int(view: NodeView) -> int | None:
    try:
        return int(view.resource_version)
    except ValueError:
        return None


class NodeSubscription:
    """One subscriber of the shared watch on a Node. Versions arrive in order (an older one than the last
    delivered is dropped); ``stop`` unsubscribes, and the last one to leave stops the watch."""

    def __init__(self, hub: _NodeWatchHub, on_node: Callable[[NodeView], None]) -> None:
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


class _NodeWatchHub:
    """One ``NodeWatch`` fanned out to every subscriber; remembers the newest version for late ones."""

    def __init__(self, node: NodeClient, kwargs: dict[str, Any]) -> None:
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
        """Register a subscriber (None when this hub already ended); with the newest known version."""
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
            _forget_hub(self)
            self.watch.stop(timeout)


# KubeClient → node name → the shared watch of that node (entries go away with the client or the watch)
_HUBS: weakref.WeakKeyDictionary[KubeClient, dict[str, _NodeWatchHub]] = weakref.WeakKeyDictionary()
_HUBS_LOCK = threading.Lock()


def _subscribe(node: NodeClient, kwargs: dict[str, Any], on_node: Callable[[NodeView], None]) -> NodeSubscription:
    with _HUBS_LOCK:
        hubs = _HUBS.setdefault(node.kube, {})
        hub = hubs.get(node.name)
        added = hub.add(on_node) if hub is not None else None
        if hub is None or added is None:
            hub = _NodeWatchHub(node, kwargs)
            hubs[node.name] = hub
            added = hub.add(on_node)
        assert added is not None
    sub, latest = added
    hub.watch.start()
    if latest is not None:
        sub.deliver(latest)
    return sub


def _forget_hub(hub: _NodeWatchHub) -> None:
    with _HUBS_LOCK:
        hubs = _HUBS.get(hub.watch.node.kube)
        if hubs is not None and hubs.get(hub.watch.node.name) is hub:
            del hubs[hub.watch.node.name]
