"""Events on the own Node for what people need to know without logging in: reconfigurations, health
changes, refused input. Never raised: the same event (reason, type, message) is not repeated within
``dedupe_window`` seconds, so a flapping input cannot flood etcd. An event the API could not take for a
passing reason (no answer, 5xx, 429) is queued and sent again with backoff from a background thread once
the API answers, in order, under the same de-duplication; the queue is bounded (the oldest is dropped).
An event refused for good (403, 422, ...) is logged and dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nodeagent.backoff import Backoff
from nodeagent.errors import KubeError
from nodeagent.kube.node import NodeClient

log = logging.getLogger(__name__)

# reasons (CamelCase, as kubectl shows them)
MIG_RECONFIGURED = "MigReconfigured"
MIG_RECONFIGURE_FAILED = "MigReconfigureFailed"
RUNTIME_CONFIGURED = "RuntimeConfigured"
RUNTIME_CONFIGURE_FAILED = "RuntimeConfigureFailed"
GPU_HEALTHY = "GpuHealthy"
GPU_UNHEALTHY = "GpuUnhealthy"
RESOURCE_REFUSED = "ExtendedResourceRefused"


MAX_PENDING = 100
RETRY_START_S = 1.0
RETRY_MAX_S = 60.0


@dataclass(frozen=True)
class _Pending:
    reason: str
    message: str
    type: str
    action: str | None


class EventRecorder:
    """Records Node events through a ``NodeClient`` with de-duplication and retries; thread-safe."""

    def __init__(
        self,
        node: NodeClient,
        *,
        enabled: bool = True,
        dedupe_window: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        retry_start_s: float = RETRY_START_S,
        retry_max_s: float = RETRY_MAX_S,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self.node = node
        self.enabled = enabled
        self.dedupe_window = dedupe_window
        self.clock = clock
        self.retry_start_s = retry_start_s
        self.retry_max_s = retry_max_s
        self.max_pending = max_pending
        self.sent = 0
        self.suppressed = 0
        self.dropped = 0
        self._recent: dict[tuple[str, str, str], float] = {}
        self._lock = threading.Lock()
        self._pending: deque[_Pending] = deque()
        self._retrier: threading.Thread | None = None
        self._wake = threading.Event()
        self._closed = False

    def record(self, reason: str, message: str, type: str = "Normal", action: str | None = None) -> bool:
        """Create the event unless disabled or repeated; True when an event was written."""
        if not self.enabled:
            return False
        key = (reason, type, message)
        now = self.clock()
        ev = _Pending(reason, message, type, action)
        with self._lock:
            last = self._recent.get(key)
            if (last is not None and now - last < self.dedupe_window) or ev in self._pending:
                self.suppressed += 1
                return False
            self._recent[key] = now
            if len(self._recent) > 512:  # forget the oldest half
                for k, _ in sorted(self._recent.items(), key=lambda kv: kv[1])[:256]:
                    del self._recent[k]
            if self._pending:  # keep the order: this one waits behind the queued ones
                self._queue(ev)
                return False
        return self._send(ev, first=True)

    @property
    def pending(self) -> int:
        """Events waiting for the API to answer again."""
        with self._lock:
            return len(self._pending)

    def _send(self, ev: _Pending, *, first: bool) -> bool:
        try:
            self.node.create_event(ev.reason, ev.message, ev.type, ev.action)
        except KubeError as e:
            if e.retryable and not self._closed:
                if first:
                    log.warning("could not record event %s on node %s yet (retrying until the API answers): %s",
                                ev.reason, self.node.name, e)
                    with self._lock:
                        self._queue(ev)
                return False
            log.warning("could not record event %s on node %s: %s", ev.reason, self.node.name, e)
            with self._lock:
                self._recent.pop((ev.reason, ev.type, ev.message), None)
                if not first and self._pending and self._pending[0] is ev:
                    self._pending.popleft()
            return False
        with self._lock:
            self.sent += 1
            if not first and self._pending and self._pending[0] is ev:
                self._pending.popleft()
        return True

    def _queue(self, ev: _Pending) -> None:
        """With the lock held: append, drop the oldest beyond the bound, make sure the retrier runs."""
        self._pending.append(ev)
        while len(self._pending) > self.max_pending:
            old = self._pending.popleft()
            self.dropped += 1
            self._recent.pop((old.reason, old.type, old.message), None)
            log.warning("event %s on node %s dropped: more than %d events wait for the API", old.reason,
                        self.node.name, self.max_pending)
        if self._retrier is None or not self._retrier.is_alive():
            self._retrier = threading.Thread(target=self._retry_loop, name="event-retry", daemon=True)
            self._retrier.start()

    def _retry_loop(self) -> None:
        backoff = Backoff(self.retry_start_s, self.retry_max_s, jitter=False)
        delay = backoff.next()
        while not self._closed:
            self._wake.wait(delay)
            self._wake.clear()
            with self._lock:
                head = self._pending[0] if self._pending else None
            if head is None or self._closed:
                return
            if self._send(head, first=False):
                backoff.reset()
                delay = backoff.next()
                continue  # the next one at once
            with self._lock:
                still_failing = bool(self._pending) and self._pending[0] is head
            if still_failing:
                delay = backoff.next()

    def close(self, timeout: float = 2.0) -> None:
        """Stop retrying; events still queued are logged as lost."""
        self._closed = True
        self._wake.set()
        if self._retrier is not None:
            self._retrier.join(timeout)
        with self._lock:
            lost, self._pending = list(self._pending), deque()
        for ev in lost:
            log.warning("event %s on node %s not recorded: the API did not answer before shutdown", ev.reason,
                        self.node.name)

    # the situations the agent reports -----------------------------------------------------------
    def reconfigured(self, component: str, message: str, *, ok: bool = True) -> bool:
        """A MIG / runtime (or other component) reconfiguration finished or failed."""
        reasons = {
            "mig": (MIG_RECONFIGURED, MIG_RECONFIGURE_FAILED),
            "runtime": (RUNTIME_CONFIGURED, RUNTIME_CONFIGURE_FAILED),
        }
        good, bad = reasons.get(component, (f"{component.capitalize()}Reconfigured", f"{component.capitalize()}ReconfigureFailed"))
        return self.record(good if ok else bad, message, "Normal" if ok else "Warning", action="Reconfigure")

    def health_changed(self, gpu: str, healthy: bool, detail: str = "") -> bool:
        msg = f"GPU {gpu} is {'healthy' if healthy else 'unhealthy'}" + (f": {detail}" if detail else "")
        return self.record(GPU_HEALTHY if healthy else GPU_UNHEALTHY, msg, "Normal" if healthy else "Warning",
                           action="HealthCheck")
