"""NodeWatch control flow (resourceVersion, 410 relist, back-off) against a scripted NodeClient wrapper."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

from nodeagent.errors import KubeError
from nodeagent.kube.node import Backoff, NodeView, NodeWatch


class ScriptedStream:
    def __init__(self, events: list[dict[str, Any]], block: threading.Event | None = None) -> None:
        self.events = events
        self.block = block
        self.closed = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        yield from self.events
        if self.block is not None:
            self.block.wait(5)

    def close(self) -> None:
        self.closed = True
        if self.block is not None:
            self.block.set()


def node(rv: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": "n1", "uid": "u1", "resourceVersion": rv, "labels": labels}}


class ScriptedNode:
    """Stands in for NodeClient: list_one/open_watch answer from a script."""

    name = "n1"

    def __init__(self, watches: list[Any]) -> None:
        self.watches = watches
        self.lists = 0
        self.opened: list[str] = []
        self.done = threading.Event()

    def list_one(self) -> tuple[NodeView | None, str]:
        self.lists += 1
        return NodeView.from_json(node(f"{100 * self.lists}")), f"{100 * self.lists}"

    def open_watch(self, rv: str, timeout_s: int) -> Any:
        self.opened.append(rv)
        if not self.watches:
            self.done.set()
            return ScriptedStream([], threading.Event())
        w = self.watches.pop(0)
        if isinstance(w, Exception):
            raise w
        return w


def run(watches: list[Any]) -> tuple[ScriptedNode, list[NodeView], NodeWatch]:
    fake = ScriptedNode(watches)
    seen: list[NodeView] = []
    w = NodeWatch(fake, seen.append, backoff=Backoff(0.001, 0.01, random.Random(1)))  # type: ignore[arg-type]
    w.start()
    assert fake.done.wait(5)
    w.stop()
    return fake, seen, w


def test_resumes_from_last_resource_version_and_relists_after_410() -> None:
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}
    fake, seen, w = run([
        ScriptedStream([{"type": "MODIFIED", "object": node("101", a="1")},
                        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "150"}}}]),
        ScriptedStream([gone]),
        ScriptedStream([{"type": "MODIFIED", "object": node("201", a="2")}]),
    ])
    assert fake.opened[:3] == ["100", "150", "200"]
    assert fake.lists == 2 and w.relists == 2
    assert [v.resource_version for v in seen] == ["100", "101", "200", "201"]
    assert seen[1].labels == {"a": "1"}


def test_errors_back_off_and_recover() -> None:
    fake, seen, w = run([
        KubeError("boom", status=503, retryable=True),
        KubeError("boom", status=0, retryable=True),
        ScriptedStream([{"type": "DELETED", "object": node("120")}]),
    ])
    assert w.errors == 2
    assert fake.opened[:3] == ["100", "100", "100"]
    assert seen[-1].deleted


def test_backoff_grows_with_jitter_and_caps() -> None:
    b = Backoff(1.0, 8.0, random.Random(7))
    delays = [b.next() for _ in range(6)]
    assert 0.5 <= delays[0] <= 1.0
    assert 4.0 <= delays[3] <= 8.0
    assert all(d <= 8.0 for d in delays)
    assert len(set(delays)) == len(delays)
    b.reset()
    assert b.next() <= 1.0
