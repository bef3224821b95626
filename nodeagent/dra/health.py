"""Device health for the DRA plane: which pool devices are unhealthy, and a stream of snapshots.

The source of truth stays ``nodeagent.gpu.health.HealthMonitor`` (XID events and polls); its
``unhealthy()`` map, keyed ``(gpu index, GPU-instance id or None)``, is mapped onto the pool's device
names here. A whole-GPU fault makes every device of that GPU unhealthy; a fault on one GPU instance makes
the device of that instance unhealthy: a static MIG device, or a dynamic one while a claim holds it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from nodeagent.dra.devices import DraDevice

HealthKey = tuple[int, int | None]
# Called once, yields the current unhealthy map on every change.
HealthUpdates = Callable[[], AsyncIterator[Mapping[HealthKey, str]]]

UNKNOWN = 0
HEALTHY = 1
UNHEALTHY = 2


def unhealthy_devices(
    devices: Iterable[DraDevice], unhealthy: Mapping[HealthKey, str], live: Mapping[str, int] | None = None
) -> dict[str, str]:
    """Device name → reason for every device hit by a fault in ``unhealthy``. ``live``: device name → GPU
    instance id of each dynamic MIG device whose instance exists now (a prepared claim's), so a fault NVML
    reports on that instance hits that device, and only it."""
    out: dict[str, str] = {}
    for d in devices:
        reason = unhealthy.get((d.gpu_index, None))
        gi_id = d.gi_id if d.gi_id is not None else (live or {}).get(d.name)
        if reason is None and gi_id is not None:
            reason = unhealthy.get((d.gpu_index, gi_id))
        if reason is not None:
            out[d.name] = reason
    return out


@dataclass(frozen=True)
class DeviceState:
    name: str
    health: int  # UNKNOWN / HEALTHY / UNHEALTHY (the v1alpha1 enum values)
    since: int  # Unix seconds of the last change


class HealthFeed:
    """Current health of every pool device; ``watch()`` yields a full snapshot now and after each change."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._states: dict[str, DeviceState] = {}
        self._reasons: dict[str, str] = {}
        self._version = 0
        self._changed = asyncio.Condition()

    @property
    def reasons(self) -> dict[str, str]:
        """Unhealthy device name → reason."""
        return dict(self._reasons)

    def snapshot(self) -> list[DeviceState]:
        return [self._states[n] for n in sorted(self._states)]

    async def update(self, names: Sequence[str], unhealthy: Mapping[str, str]) -> bool:
        """Set the device list and the unhealthy ones; True (and watchers woken) when anything changed."""
        now = int(self._clock())
        new: dict[str, DeviceState] = {}
        for n in names:
            health = UNHEALTHY if n in unhealthy else HEALTHY
            old = self._states.get(n)
            new[n] = old if old is not None and old.health == health else DeviceState(n, health, now)
        reasons = {n: r for n, r in unhealthy.items() if n in new}
        if new == self._states and reasons == self._reasons:
            return False
        self._states, self._reasons = new, reasons
        async with self._changed:
            self._version += 1
            self._changed.notify_all()
        return True

    async def watch(self) -> AsyncGenerator[list[DeviceState], None]:
        seen = -1
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda s=seen: self._version != s)  # type: ignore[misc]
                seen = self._version
                snap = self.snapshot()
            yield snap
