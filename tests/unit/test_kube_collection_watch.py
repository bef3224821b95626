"""CollectionWatch (kube/watch.py) against a scripted client: it lists, watches from the list's
resourceVersion, reports only changes of what the owner reads, relists after 410 Gone (telling the owner
"LIST") and resumes from the last resourceVersion after an error; the controller's Node relevance ignores
heartbeats."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from nodeagent.backoff import Backoff
from nodeagent.computedomain.controller import node_relevance
from nodeagent.errors import KubeError
from nodeagent.kube.watch import CollectionWatch
from nodeagent.remediation import evictreq


class Stream:
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events

    def __iter__(self) -> Iterator[dict[str, Any]]:
        yield from self.events

    def close(self) -> None:
        pass


class Idle(Stream):
    """The last watch: stays open (without events) until closed."""

    def __init__(self, done: threading.Event) -> None:
        super().__init__([])
        self.done = done
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.done.set()
        self.closed.wait(5)
        yield from ()

    def close(self) -> None:
        self.closed.set()


def node(name: str, rv: str, clique: str = "", report: str | None = None, heartbeat: str = "") -> dict[str, Any]:
    ann = {"nodeagent.io/computedomains": report} if report else {}
    return {"metadata": {"name": name, "resourceVersion": rv, "labels": {"nvidia.com/gpu.clique": clique},
                         "annotations": ann},
            "status": {"conditions": [{"type": "Ready", "lastHeartbeatTime": heartbeat}]}}


class ScriptedKube:
    def __init__(self, watches: list[Any]) -> None:
        self.watches = watches
        self.lists = 0
        self.opened: list[str] = []
        self.done = threading.Event()

    def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        self.lists += 1
        rv = str(100 * self.lists)
        return {"metadata": {"resourceVersion": rv}, "items": [node("a", rv, "c.1")]}

    def stream(self, path: str, *, query: Mapping[str, Any], **kwargs: Any) -> Any:
        self.opened.append(str(query.get("resourceVersion", "")))
        assert query["timeoutSeconds"] == 300 and query["allowWatchBookmarks"] is True  # bounded in time
        if not self.watches:
            return Idle(self.done)
        w = self.watches.pop(0)
        if isinstance(w, Exception):
            raise w
        return w


def run(watches: list[Any]) -> tuple[ScriptedKube, list[tuple[str, str]], CollectionWatch]:
    kube = ScriptedKube(watches)
    seen: list[tuple[str, str]] = []

    def changed(kind: str, obj: Mapping[str, Any] | None) -> None:
        seen.append((kind, "" if obj is None else obj["metadata"]["resourceVersion"]))

    w = CollectionWatch(kube, "/api/v1/nodes", changed, what="Nodes", relevant=node_relevance,  # type: ignore[arg-type]
                        backoff=Backoff(0.001, 0.01, random.Random(1)))
    w.start()
    assert kube.done.wait(5)
    w.stop()
    assert not w._thread or not w._thread.is_alive()
    return kube, seen, w


GONE = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}


def test_only_relevant_changes_are_reported_410_relists_errors_resume() -> None:
    kube, seen, w = run([
        Stream([{"type": "MODIFIED", "object": node("a", "101", "c.1", heartbeat="t1")},  # heartbeat: nothing
                {"type": "MODIFIED", "object": node("a", "102", "c.1", report='{"u":"Ready"}')},
                {"type": "ADDED", "object": node("b", "103")},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "150"}}}]),
        KubeError("unavailable", status=503, retryable=True),
        Stream([{"type": "DELETED", "object": node("b", "160")}, GONE]),
        Stream([{"type": "MODIFIED", "object": node("a", "201", "c.2")}]),
    ])
    # the list, the report change, the new node; the error resumes from the bookmark; the delete; after the
    # 410 a relist ("LIST": the owner looks at everything again) and the watch from the new list
    assert seen == [("LIST", ""), ("MODIFIED", "102"), ("ADDED", "103"), ("DELETED", "160"), ("LIST", ""),
                    ("MODIFIED", "201")]
    assert kube.opened == ["100", "150", "150", "200", "201"]
    assert (w.relists, w.errors, w.gone) == (2, 1, 1) and w.synced.is_set()


def test_eviction_relevance_is_the_two_annotations() -> None:
    n = node("a", "1")
    assert evictreq.node_relevance(n) == (None, None)
    n["metadata"]["annotations"][evictreq.REQUESTS] = "{}"
    assert evictreq.node_relevance(n) == ("{}", None)
    assert node_relevance(node("a", "1", "c.1", heartbeat="x")) == node_relevance(node("a", "2", "c.1", heartbeat="y"))
