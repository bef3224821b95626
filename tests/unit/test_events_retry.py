"""EventRecorder: what a refused event and a full queue do (the outage itself is tested against the real
API server in tests/integration/test_kube_events_outage.py)."""

from __future__ import annotations

import time

from nodeagent.errors import KubeError
from nodeagent.kube.events import EventRecorder


class ScriptedNode:
    """Stands in for NodeClient: fails while ``down``; ``refuse`` answers 422 for good."""

    name = "node-a"

    def __init__(self) -> None:
        self.down = False
        self.refuse = False
        self.created: list[str] = []

    def create_event(self, reason: str, message: str, type: str = "Normal", action: str | None = None) -> str:
        if self.refuse:
            raise KubeError("create event: HTTP 422", status=422, retryable=False)
        if self.down:
            raise KubeError("create event: connection refused", status=0, retryable=True)
        self.created.append(reason)
        return reason


def wait(cond: object, timeout: float = 5.0) -> bool:
    assert callable(cond)
    end = time.monotonic() + timeout
    while time.monotonic() < end and not cond():
        time.sleep(0.01)
    return bool(cond())


def test_a_refused_event_is_dropped_not_retried() -> None:
    node = ScriptedNode()
    node.refuse = True
    rec = EventRecorder(node, retry_start_s=0.01)  # type: ignore[arg-type]
    assert rec.record("Bad", "x") is False
    assert rec.pending == 0
    node.refuse = False
    assert rec.record("Bad", "x") is True  # not de-duplicated against a refusal
    assert node.created == ["Bad"]


def test_the_queue_is_bounded_and_keeps_the_newest() -> None:
    node = ScriptedNode()
    node.down = True
    rec = EventRecorder(node, retry_start_s=0.01, retry_max_s=0.02, max_pending=3)  # type: ignore[arg-type]
    for i in range(5):
        rec.record(f"R{i}", "m")
    assert rec.pending == 3 and rec.dropped == 2
    node.down = False
    assert wait(lambda: rec.pending == 0)
    assert node.created == ["R2", "R3", "R4"]
    rec.close()


def test_close_stops_retrying() -> None:
    node = ScriptedNode()
    node.down = True
    rec = EventRecorder(node, retry_start_s=0.01, retry_max_s=0.02)  # type: ignore[arg-type]
    rec.record("R", "m")
    rec.close()
    node.down = False
    time.sleep(0.1)
    assert node.created == [] and rec.pending == 0
