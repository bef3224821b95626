"""The real parts of the node, one module each; ``nodeagent.daemon.wiring`` builds them from the config."""

from __future__ import annotations

import contextlib
from typing import Any


def close_quietly(obj: Any) -> None:
    """Close a client on the way out; a failure there changes nothing anymore."""
    close = getattr(obj, "close", None)
    if callable(close):
        with contextlib.suppress(Exception):
            close()
