"""The daemon's small helpers: where it records its run for doctor (``RunRecorder``), closing a replaced
client quietly, giving the C heap back after start-up, one bounded log line for an exception."""

from __future__ import annotations

import contextlib
from typing import Literal, Protocol

from nodeagent.agentrecord import Fault, OtherAgent, Registration
from nodeagent.errors import NodeAgentError


class RunRecorder(Protocol):
    """Where the daemon leaves its start, reloads and stop for ``nodeagent doctor`` (``agentrecord``)."""

    def started(self, config_source: str) -> None: ...

    def reloaded(self, outcome: Literal["applied", "unchanged", "rejected", "failed"], detail: str = "",
                 config_source: str | None = None) -> None: ...

    def health(self, unhealthy: tuple[Fault, ...]) -> None: ...

    def observed(self, conflicts: tuple[OtherAgent, ...], resources: tuple[Registration, ...]) -> None: ...

    def stopped(self) -> None: ...


class Closable(Protocol):
    def close(self) -> None: ...


def close_quietly(obj: Closable) -> None:
    """Close a client on the way out (a GPU source or API client being replaced, a component's channel);
    a failure there changes nothing anymore."""
    with contextlib.suppress(Exception):
        obj.close()


TRIM_AFTER_READY_S = 5.0  # start-up publishing has settled by then


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the kernel (glibc ``malloc_trim``). Start-up (imports, the first
    discovery and publish) frees about 1 MiB that glibc would otherwise keep resident for good in an idle
    daemon. False where the C library has no ``malloc_trim``."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one bounded line for the log (its traceback goes to the debug level): nodeagent's
    own errors as their message, anything else with its type (``OSError: [Errno 5] ...``)."""
    text = str(e) if isinstance(e, NodeAgentError) else f"{type(e).__name__}: {e}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
