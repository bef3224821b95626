"""NodeWatch control flow (resourceVersion, 410 relist, back-off), the hub that shares one watch, and the
bounded ``updates`` mailbox, against a scripted NodeClient wrapper."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Iterator
from typing import Any

from nodeagent.backoff import Backoff
from nodeagent.errors import KubeError
from nodeagent.kube.node import NodeClient, NodeView, NodeWatch, NodeWatchHub


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


GONE = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}
UNAVAILABLE = {"type": "ERROR", "object": {"kind": "Status", "code": 503, "message": "try later"}}


class CountingBackoff(Backoff):
    """Waits (almost) nothing, and records the attempt number of every back-off and every reset."""

    def __init__(self) -> None:
        super().__init__(0.001, 0.002, random.Random(3))
        self.asked: list[int] = []
        self.resets = 0

    def next(self) -> float:
        self.asked.append(self.attempt)
        return super().next()

    def reset(self) -> None:
        self.resets += 1
        super().reset()


def run_with(watches: list[Any], backoff: Backoff, **kwargs: Any) -> tuple[ScriptedNode, NodeWatch]:
    fake = ScriptedNode(watches)
    w = NodeWatch(fake, lambda v: None, backoff=backoff, **kwargs)  # type: ignore[arg-type]
    w.start()
    assert fake.done.wait(5)
    w.stop()
    return fake, w


def test_a_server_that_always_answers_410_is_relisted_with_back_off() -> None:
    backoff = CountingBackoff()
    fake, w = run_with([ScriptedStream([GONE]) for _ in range(6)], backoff)
    assert w.gone == 6 and fake.lists == 7  # the first list, then one relist per 410
    # the first 410 relists at once (the usual expiry); every further one in a row waits, growing
    assert backoff.asked == [0, 1, 2, 3, 4] and backoff.resets == 0


def test_events_in_a_short_lived_watch_do_not_reset_the_back_off() -> None:
    flapping = [ScriptedStream([{"type": "MODIFIED", "object": node(str(101 + i))}, UNAVAILABLE])
                for i in range(4)]
    backoff = CountingBackoff()
    _, w = run_with(flapping, backoff)
    assert w.errors == 4
    assert backoff.asked == [0, 1, 2, 3] and backoff.resets == 0


def test_a_watch_that_stayed_open_starts_the_back_off_over() -> None:
    backoff = CountingBackoff()
    _, w = run_with([ScriptedStream([GONE]), ScriptedStream([GONE]),
                     ScriptedStream([{"type": "MODIFIED", "object": node("301")}, UNAVAILABLE]),
                     ScriptedStream([GONE]), ScriptedStream([GONE])], backoff, healthy_after_s=0.0)
    # healthy at once (healthy_after_s=0): each event resets, so the 410 streak starts over
    assert backoff.resets >= 1 and w.gone == 4
    # 410, 410 (waits, attempt 0) | event: reset | 503 (waits, attempt 0), 410 (a new streak: at once),
    # 410 (waits, attempt 1)
    assert backoff.asked == [0, 0, 1]


class FakeSubscription:
    def __init__(self) -> None:
        self.stopped = False

    def stop(self, timeout: float = 10.0) -> None:
        self.stopped = True


class CapturingHub(NodeWatchHub):
    """Hands the subscriber's callback to the test instead of opening a watch."""

    def __init__(self) -> None:
        super().__init__()
        self.deliver: Any = None
        self.sub = FakeSubscription()

    def subscribe(self, node: Any, on_node: Any, **kwargs: Any) -> Any:
        self.deliver = on_node
        return self.sub


async def test_updates_keeps_only_the_newest_version_for_a_slow_consumer() -> None:
    hub = CapturingHub()
    nc = NodeClient(object(), "n1", watches=hub)  # type: ignore[arg-type]
    agen = nc.updates()
    first = asyncio.ensure_future(agen.__anext__())
    await asyncio.sleep(0)
    assert hub.deliver is not None

    def storm() -> None:  # the watch thread delivers 10,000 versions while the consumer is busy
        for i in range(10_000):
            hub.deliver(NodeView.from_json(node(str(1000 + i), n=str(i))))

    await asyncio.to_thread(storm)
    view = await asyncio.wait_for(first, 5)
    await asyncio.sleep(0.05)  # let every call_soon_threadsafe land
    newest = await asyncio.wait_for(agen.__anext__(), 5)
    assert newest.labels == {"n": "9999"}
    assert int(view.resource_version) <= int(newest.resource_version)
    pending = asyncio.ensure_future(agen.__anext__())
    await asyncio.sleep(0.02)
    assert not pending.done()  # nothing was queued up behind the newest
    pending.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pending
    await agen.aclose()  # type: ignore[attr-defined]
    assert hub.sub.stopped


class KubeStandIn:
    pass


def test_one_hub_shares_one_watch_and_forgets_it_with_the_last_subscriber() -> None:
    kube = KubeStandIn()
    fake = ScriptedNode([])
    fake.kube = kube  # type: ignore[attr-defined]
    hub = NodeWatchHub()
    seen_a: list[NodeView] = []
    seen_b: list[NodeView] = []
    a = hub.subscribe(fake, seen_a.append)  # type: ignore[arg-type]
    b = hub.subscribe(fake, seen_b.append)  # type: ignore[arg-type]
    assert a.watch is b.watch and len(hub) == 1
    assert fake.done.wait(5)
    assert seen_a[0].resource_version == "100" and seen_b[0].resource_version == "100"
    other = NodeWatchHub()  # another owner (e.g. another daemon in the same process) has its own
    c = other.subscribe(fake, lambda v: None)  # type: ignore[arg-type]
    assert c.watch is not a.watch
    a.stop(1)
    assert len(hub) == 1
    b.stop(1)
    assert len(hub) == 0 and a.watch.stopped
    c.stop(1)
    assert len(other) == 0
