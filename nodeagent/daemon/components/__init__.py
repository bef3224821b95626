"""The real parts of the node, one module each; ``nodeagent.daemon.wiring`` builds them from the config."""

from __future__ import annotations

import contextlib
from typing import Protocol


class Closable(Protocol):
    def close(self) -> None: ...


def close_quietly(obj: Closable) -> None:
    """Close a client on the way out; a failure there changes nothing anymore."""
    with contextlib.suppress(Exception):
        obj.close()
