"""``ServiceHooks`` over the agent's health monitors: a withdrawn GPU is held Unhealthy in every monitor
(the device plugin's sends it Unhealthy to the kubelet; the DRA plane beside it follows the same map), and
offered again by releasing it, its past faults forgotten (no quiet window after a checked reset).

``planes`` (the DRA plane, when one runs): the GPU's devices carry the taint ``gpu.nodeagent.io/remediation``
(NoSchedule) in the node's ResourceSlices while it is out where the API server keeps device taints, and are left
out of them otherwise (nothing new is allocated on it either way); offered, they are listed untainted again. A GPU
that stays out (quarantined, reboot required) gets the NoExecute effect when ``noexecute_when_out`` is set.

The MPS daemon and the MIG/CDI restore are callables handed in by whoever owns them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from nodeagent.gpu.health import HealthMonitor

UuidAction = Callable[[str], Awaitable[None]]


class Plane(Protocol):
    async def hold_out(self, gpu_indices: set[int], reason: str, effect: str = "NoSchedule") -> None: ...

    async def offer_again(self, gpu_indices: set[int]) -> None: ...


class MonitorHooks:
    def __init__(
        self,
        monitors: Callable[[], Sequence[HealthMonitor]],
        index_of: Callable[[str], int],
        *,
        stop_users: UuidAction | None = None,
        restore: UuidAction | None = None,
        planes: Plane | None = None,
        noexecute_when_out: bool = False,
    ) -> None:
        self.monitors = monitors
        self.index_of = index_of
        self._stop_users = stop_users
        self._restore = restore
        self._planes = planes
        self._noexecute = noexecute_when_out

    async def withdraw(self, uuid: str, reason: str) -> None:
        for m in self.monitors():
            await m.hold(self.index_of(uuid), f"remediation: {reason}")
        if self._planes is not None:
            await self._planes.hold_out({self.index_of(uuid)}, reason)

    async def stays_out(self, uuid: str, reason: str) -> None:
        """The GPU is not coming back before an operator or a reboot: with ``noexecute_when_out`` its DRA
        devices' taint becomes NoExecute (Kubernetes evicts the pods still using them)."""
        if self._planes is not None and self._noexecute:
            await self._planes.hold_out({self.index_of(uuid)}, reason, "NoExecute")

    async def offer(self, uuid: str) -> None:
        if self._planes is not None:
            await self._planes.offer_again({self.index_of(uuid)})
        for m in self.monitors():
            await m.release(self.index_of(uuid))

    async def stop_users(self, uuid: str) -> None:
        if self._stop_users is not None:
            await self._stop_users(uuid)

    async def restore(self, uuid: str) -> None:
        if self._restore is not None:
            await self._restore(uuid)
