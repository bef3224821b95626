"""Blocking waits for changes of one file, with Linux inotify and no thread.

The simulator's event wait uses this so an idle daemon sleeps in ``poll(2)`` until the state file is
replaced (``atomic_write`` renames a temp file over it), written in place, created or removed, instead of
waking every few milliseconds to ``stat`` it. The directory is watched rather than the file because an
atomic replace gives the path a new inode; events for other names in the directory are ignored.

Only two libc calls are bound (``inotify_init1``, ``inotify_add_watch``); reading and closing use ``os``.
``FileWatch`` raises ``OSError`` where inotify is unavailable so the caller can fall back to polling.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import struct
import time
from pathlib import Path
from typing import Any

IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_Q_OVERFLOW = 0x00004000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

# not IN_MODIFY: every write(2) to any file in the directory (a log next to the state file) would wake us
WATCH_MASK = IN_CLOSE_WRITE | IN_MOVED_TO | IN_MOVED_FROM | IN_CREATE | IN_DELETE
_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name

_libc: Any = None


def _bindings() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_init1.restype = ctypes.c_int
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        lib.inotify_add_watch.restype = ctypes.c_int
        _libc = lib
    return _libc


def _raise_errno(what: str, path: Path) -> None:
    code = ctypes.get_errno() or errno.EIO
    raise OSError(code, f"{what}: {os.strerror(code)}", str(path))


def names_changed(buf: bytes, name: bytes) -> bool:
    """True when the inotify records in ``buf`` concern ``name`` (or the queue overflowed) (pure)."""
    off = 0
    while off + _HEADER.size <= len(buf):
        _wd, mask, _cookie, length = _HEADER.unpack_from(buf, off)
        raw = buf[off + _HEADER.size : off + _HEADER.size + length]
        off += _HEADER.size + length
        if mask & IN_Q_OVERFLOW or raw.rstrip(b"\0") == name:
            return True
    return False


class FileWatch:
    """Watches ``path`` from the moment it is built; ``wait`` blocks until a change or the timeout."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._name = os.fsencode(path.name)
        try:
            lib = _bindings()
        except (OSError, AttributeError) as e:  # no libc symbol: not Linux, or a libc without inotify
            raise OSError(errno.ENOSYS, f"inotify unavailable: {e}", str(path)) from e
        fd = int(lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
        if fd < 0:
            _raise_errno("inotify_init1", path)
        self._fd = fd
        if lib.inotify_add_watch(fd, os.fsencode(path.parent), WATCH_MASK) < 0:
            self.close()
            _raise_errno("inotify_add_watch", path.parent)
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s``; True as soon as the file changed since the watch (or the last wait)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            if self._drain():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._poll.poll(max(1, int(remaining * 1000 + 0.999)))

    def _drain(self) -> bool:
        changed = False
        while True:
            try:
                buf = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                return changed
            if not buf:
                return changed
            changed = names_changed(buf, self._name) or changed

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> FileWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
