"""Blocking waits for changes of one file, on watchdog's inotify observer.

The simulator's event wait uses this so an idle daemon sleeps until the state file is replaced
(``atomic_write`` renames a temp file over it), written in place, created or removed, instead of waking
every few milliseconds to ``stat`` it. The directory is watched rather than the file because an atomic
replace gives the path a new inode; events for other names in the directory are ignored.

Only the inotify events that can mean a new content are asked for (a write closed, a rename, a create, a
delete), not every ``write(2)``: a log next to the state file does not wake watchdog's threads. A path
renamed away out of the directory is seen after watchdog's half-second wait for a matching rename; a
kernel queue overflow is not reported, so a waiter then sees the change at its next timeout.

``FileWatch`` raises ``OSError`` where inotify is unavailable (no inotify in the C library, the
per-user instance or watch limit reached) so the caller can fall back to polling; it never falls back
to watchdog's polling observer itself.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
from pathlib import Path
from typing import Any

JOIN_TIMEOUT_S = 2.0


class _Changed:
    """Set for every event that names ``name`` as its source or destination."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.event = threading.Event()

    def see(self, event: Any) -> None:
        for path in (event.src_path, event.dest_path):
            if path and os.path.basename(os.fsdecode(path)) == self.name:
                self.event.set()
                return


@functools.cache
def _watchdog() -> tuple[Any, Any, list[Any]]:
    """watchdog's inotify observer, a handler class feeding ``_Changed``, and the event kinds that may
    change what a file holds (their inotify mask leaves IN_MODIFY out). Imported on the first watch: a
    command that never waits (``discover --simulate``) does not load watchdog."""
    from watchdog.events import (
        FileClosedEvent,
        FileCreatedEvent,
        FileDeletedEvent,
        FileMovedEvent,
        FileSystemEvent,
        FileSystemEventHandler,
    )
    from watchdog.utils import UnsupportedLibcError

    class Handler(FileSystemEventHandler):
        def __init__(self, changed: _Changed) -> None:
            super().__init__()
            self.changed = changed

        def on_any_event(self, event: FileSystemEvent) -> None:
            self.changed.see(event)

    try:
        from watchdog.observers.inotify import InotifyObserver
    except UnsupportedLibcError as e:  # not Linux, or a C library without inotify
        raise OSError(errno.ENOSYS, f"inotify unavailable: {e}") from e
    return InotifyObserver, Handler, [FileClosedEvent, FileMovedEvent, FileCreatedEvent, FileDeletedEvent]


class FileWatch:
    """Watches ``path`` from the moment it is built; ``wait`` blocks until a change or the timeout."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._changed = _Changed(path.name)
        observer_type, handler_type, kinds = _watchdog()
        self._observer = observer_type()
        self._observer.schedule(
            handler_type(self._changed), str(path.parent), recursive=False, event_filter=kinds
        )
        self._observer.start()  # adds the inotify watch before it returns (OSError at a limit)

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s``; True as soon as the file changed since the watch (or the last wait)."""
        if not self._changed.event.wait(max(0.0, timeout_s)):
            return False
        self._changed.event.clear()  # the caller reads the file after this: a change meanwhile is seen
        return True

    def close(self) -> None:
        if self._observer.is_alive():
            self._observer.stop()
            self._observer.join(JOIN_TIMEOUT_S)

    def __enter__(self) -> FileWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
