"""Events on the own Node for what people need to know without logging in: reconfigurations, health
changes, refused input. Best effort: a failed event is logged, never raised. The same event (reason,
type, message) is not repeated within ``dedupe_window`` seconds, so a flapping input cannot flood etcd.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

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
INPUT_REFUSED = "InputRefused"
RESOURCE_REFUSED = "ExtendedResourceRefused"


class EventRecorder:
    """Records Node events through a ``NodeClient`` with de-duplication; thread-safe."""

    def __init__(
        self,
        node: NodeClient,
        *,
        enabled: bool = True,
        dedupe_window: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.enabled = enabled
        self.dedupe_window = dedupe_window
        self.clock = clock
        self.sent = 0
        self.suppressed = 0
        self._recent: dict[tuple[str, str, str], float] = {}
        self._lock = threading.Lock()

    def record(self, reason: str, message: str, type: str = "Normal", action: str | None = None) -> bool:
        """Create the event unless disabled or repeated; True when an event was written."""
        if not self.enabled:
            return False
        key = (reason, type, message)
        now = self.clock()
        with self._lock:
            last = self._recent.get(key)
            if last is not None and now - last < self.dedupe_window:
                self.suppressed += 1
                return False
            self._recent[key] = now
            if len(self._recent) > 512:  # forget the oldest half
                for k, _ in sorted(self._recent.items(), key=lambda kv: kv[1])[:256]:
                    del self._recent[k]
        try:
            self.node.create_event(reason, message, type, action)
        except KubeError as e:
            log.warning("could not record event %s on node %s: %s", reason, self.node.name, e)
            with self._lock:
                self._recent.pop(key, None)
            return False
        self.sent += 1
        return True

    async def arecord(self, reason: str, message: str, type: str = "Normal", action: str | None = None) -> bool:
        return await asyncio.to_thread(self.record, reason, message, type, action)

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

    def refused_input(self, what: str, message: str) -> bool:
        return self.record(INPUT_REFUSED, f"{what}: {message}", "Warning", action="Validate")
