"""The hook for a disruption budget wider than this node (a fleet's): before a GPU is taken out of service
the pipeline asks for a slot, and holds it until the GPU is back or given up.

The protocol is all this package knows of any such budget; the default grants every slot at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Protocol


class DisruptionGate(Protocol):
    def slot(self, reason: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Wait until one more GPU may be disrupted (``reason`` says which and why); the slot is held
        while the context is open. May raise (e.g. TimeoutError) to refuse."""
        ...


class AlwaysGrant:
    """No budget beyond this node: every slot is granted at once."""

    @contextlib.asynccontextmanager
    async def slot(self, reason: str) -> AsyncIterator[None]:
        yield
