"""The daemon's adapters from the fleet's gate to the slot protocols of the remediation pipeline and the
label-driven switches: a slot is held exactly from acquire to release (or for the pipeline's block), under the
rollout name each change reports failures as."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from nodeagent.daemon.components.fleetlink import RemediationSlots, SwitchSlots


class Gate:
    """FleetGate's ``slot`` as the adapters use it, recording what happens."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []

    @contextlib.asynccontextmanager
    async def slot(self, reason: str, *, rollout: str = "", gpu_pods: int = 0) -> AsyncIterator[str | None]:
        self.log.append(("take", reason, rollout))
        try:
            yield "nf-slot-pool-0"
        except BaseException as e:
            self.log.append(("failed", reason, type(e).__name__))
            raise
        finally:
            self.log.append(("give back", reason, rollout))


async def test_a_switch_holds_its_slot_from_acquire_to_release() -> None:
    gate = Gate()
    slots = SwitchSlots(cast(Any, gate))
    await slots.acquire("nvidia.com/cc.mode=on")
    assert gate.log == [("take", "nvidia.com/cc.mode=on", "nvidia.com/cc.mode=on")]
    await slots.release("nvidia.com/cc.mode=on")
    assert gate.log[-1] == ("give back", "nvidia.com/cc.mode=on", "nvidia.com/cc.mode=on")
    await slots.release("nvidia.com/cc.mode=on")  # a second release has nothing to give back
    assert len(gate.log) == 2


async def test_a_remediation_holds_its_slot_for_the_block_and_a_failure_leaves_through_the_gate() -> None:
    gate = Gate()
    slots = RemediationSlots(cast(Any, gate))
    async with slots.slot("reset GPU-1"):
        assert gate.log == [("take", "reset GPU-1", "remediation")]
    assert gate.log[-1] == ("give back", "reset GPU-1", "remediation")
    with pytest.raises(RuntimeError):
        async with slots.slot("reset GPU-2"):
            raise RuntimeError("reset failed")
    assert ("failed", "reset GPU-2", "RuntimeError") in gate.log
