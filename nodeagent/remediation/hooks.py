"""``ServiceHooks`` over the agent's health monitors: a withdrawn GPU is held Unhealthy in every monitor
(the device plugin's sends it Unhealthy to the kubelet; the DRA plane beside it follows the same map), and
offered again by releasing it, its past faults forgotten (no quiet window after a checked reset).

The MPS daemon and the MIG/CDI restore are callables handed in by whoever owns them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from nodeagent.gpu.health import HealthMonitor

UuidAction = Callable[[str], Awaitable[None]]


class MonitorHooks:
    def __init__(
        self,
        monitors: Callable[[], Sequence[HealthMonitor]],
        index_of: Callable[[str], int],
        *,
        stop_users: UuidAction | None = None,
        restore: UuidAction | None = None,
    ) -> None:
        self.monitors = monitors
        self.index_of = index_of
        self._stop_users = stop_users
        self._restore = restore

    async def withdraw(self, uuid: str, reason: str) -> None:
        for m in self.monitors():
            await m.hold(self.index_of(uuid), f"remediation: {reason}")

    async def offer(self, uuid: str) -> None:
        for m in self.monitors():
            await m.release(self.index_of(uuid))

    async def stop_users(self, uuid: str) -> None:
        if self._stop_users is not None:
            await self._stop_users(uuid)

    async def restore(self, uuid: str) -> None:
        if self._restore is not None:
            await self._restore(uuid)
