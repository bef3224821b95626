"""Crash-safe file writes for node-critical files (containerd config, toolkit config, state, checkpoints).

``atomic_write`` never leaves a half-written file behind: the new bytes go to a temporary file in the
same directory, are flushed to disk, get the previous file's mode and owner, and only then replace the
target with one ``rename``; the directory is flushed afterwards so the rename itself survives a crash.
A process killed at any point leaves either the whole old file or the whole new one (plus, at worst, a
stray ``.<name>.nodeagent-tmp-*`` file that ``atomic_write`` ignores and the next write does not need).

Backups: with ``backup=True`` the exact previous bytes are kept next to the file as
``<name>.nodeagent.bak`` (same mode and owner, written atomically too). Only the most recent previous
version is kept; callers that need the original across several writes (``runtime unconfigure``) keep it
in their own state file.

Under a root: every function here takes ``root`` (the ``HostPaths`` of the command, or anything with its
``within``) and then resolves the path inside that root at the moment it opens, creates, lists or renames it,
as a chroot would: a symlink under the root never leads out of it, whatever it was when the path was built.
Without ``root`` a path is the host's (the user's own input files, the real node's ``/``).

Reading input: ``read_regular`` reads only regular files and at most a given number of bytes. A FIFO,
device, socket or directory where a file is expected is refused with one line before it is opened (a FIFO
would block the reader; a device may do anything on open), and so is a file larger than the cap.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

from nodeagent.errors import ConfigError

BACKUP_SUFFIX = ".nodeagent.bak"
TMP_MARKER = ".nodeagent-tmp-"
DEFAULT_MODE = 0o644
# Default cap of ``read_regular``: far above any config or state file nodeagent reads (a few KiB).
MAX_READ_BYTES = 4 << 20
_CHUNK = 1 << 16


class Root(Protocol):
    """Where host paths live (``HostPaths``): ``within`` resolves a path under it, inside it, now."""

    def within(self, path: Path | str) -> Path: ...


def _within(root: Root, path: Path | str) -> Path:
    try:
        return root.within(path)
    except ValueError as e:  # a loop of links under the root: what the kernel would say of it
        if "symbolic links" in str(e):
            raise OSError(errno.ELOOP, str(e), str(path)) from e
        raise


def _at(path: Path | str, root: Root | None) -> Path:
    return Path(path) if root is None else _within(root, path)


class UnreadableFileError(ConfigError):
    """A file nodeagent must read is not a regular file, is too large, or cannot be opened."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: Path | str, *, max_bytes: int = MAX_READ_BYTES, root: Root | None = None) -> bytes | None:
    """The bytes of a regular file, ``None`` when it does not exist; never blocks, never reads more than
    ``max_bytes``. Anything else raises ``UnreadableFileError`` with one line naming the file."""
    try:
        p = _at(path, root)
    except OSError as e:  # a loop of links under the root
        raise UnreadableFileError(f"{path}: cannot read: {e.strerror}", subject=str(path)) from e
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UnreadableFileError(f"{p}: cannot read: {e.strerror}", subject=str(p)) from e
    if not stat.S_ISREG(st.st_mode):
        raise UnreadableFileError(f"{p}: is {_kind(st.st_mode)}, expected a regular file", subject=str(p))
    if st.st_size > max_bytes:
        raise UnreadableFileError(f"{p}: {st.st_size} bytes, more than the {max_bytes} bytes nodeagent reads",
                                  subject=str(p))
    try:
        # O_NONBLOCK: if the path was swapped for a FIFO since the stat, the open still returns at once.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UnreadableFileError(f"{p}: cannot read: {e.strerror}", subject=str(p)) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFileError(f"{p}: is {_kind(st.st_mode)}, expected a regular file", subject=str(p))
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(_CHUNK, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise UnreadableFileError(f"{p}: more than the {max_bytes} bytes nodeagent reads",
                                          subject=str(p))
        return b"".join(chunks)
    except OSError as e:
        raise UnreadableFileError(f"{p}: cannot read: {e.strerror}", subject=str(p)) from e
    finally:
        os.close(fd)


def read_stream(stream: BinaryIO, name: str, *, max_bytes: int = MAX_READ_BYTES) -> bytes:
    """At most ``max_bytes`` of a stream (standard input), like a file: more is ``UnreadableFileError``."""
    data = bytearray()
    while len(data) <= max_bytes:
        chunk = stream.read(min(_CHUNK, max_bytes + 1 - len(data)))
        if not chunk:
            return bytes(data)
        data += chunk
    raise UnreadableFileError(f"{name}: more than the {max_bytes} bytes nodeagent reads", subject=name)


def check_writable(path: Path | str, *, root: Root | None = None) -> None:
    """Raise ``UnreadableFileError`` unless ``atomic_write``/``remove`` could replace ``path`` now: the
    existing file opens for writing (not immutable, not on a read-only mount) and its directory (or the
    nearest existing parent, for a directory still to be created) takes a new file. Writes nothing that
    stays."""
    p = _at(path, root)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise UnreadableFileError(f"{p}: cannot write: {e.strerror}", subject=str(p)) from e
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFileError(f"{p}: is {_kind(st.st_mode)}, expected a regular file", subject=str(p))
        try:
            os.close(os.open(p, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC))
        except OSError as e:
            raise UnreadableFileError(f"{p}: cannot write: {e.strerror}", subject=str(p)) from e
    directory = p.parent
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    try:
        fd, probe = tempfile.mkstemp(prefix="." + p.name + TMP_MARKER, dir=directory)
    except OSError as e:
        raise UnreadableFileError(f"{p}: cannot write in {directory}: {e.strerror}", subject=str(p)) from e
    os.close(fd)
    os.unlink(probe)


def backup_path(path: Path) -> Path:
    """Where ``atomic_write`` keeps the previous bytes of ``path``."""
    return path.with_name(path.name + BACKUP_SUFFIX)


def read_bytes(path: Path, *, max_bytes: int = MAX_READ_BYTES, root: Root | None = None) -> bytes | None:
    """The bytes of a regular file (``read_regular``: never blocks, bounded), ``None`` when it does not
    exist."""
    return read_regular(path, max_bytes=max_bytes, root=root)


def read_text(path: Path, *, max_bytes: int = MAX_READ_BYTES, root: Root | None = None) -> str | None:
    """The file's text (UTF-8, newlines untouched), or ``None`` when it does not exist; a file that is not
    UTF-8 is ``UnreadableFileError`` too."""
    data = read_bytes(path, max_bytes=max_bytes, root=root)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableFileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})",
                                  subject=str(path)) from e


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry change (create, rename, unlink) to disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _target(path: Path, root: Root | None) -> Path:
    # Writing through a symlink replaces the file it points to, not the link itself: under a root the link
    # is followed inside the root (every component, the directory of the temporary file included).
    if root is not None:
        return _within(root, path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def makedirs(path: Path | str, *, mode: int = 0o777, root: Root | None = None) -> Path:
    """``mkdir -p`` (existing directories kept); under ``root`` each component is resolved inside it first.
    Returns the directory as made."""
    p = _at(path, root)
    p.mkdir(parents=True, exist_ok=True, mode=mode)
    return p


def _write_replace(
    target: Path,
    data: bytes,
    mode: int,
    owner: tuple[int, int] | None,
    before_rename: Callable[[Path], None] | None,
    durable: bool = True,
) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix="." + target.name + TMP_MARKER, dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if owner is not None:
                # Only root may give a file away; an unprivileged caller keeps its own ownership.
                with contextlib.suppress(PermissionError):
                    os.fchown(f.fileno(), owner[0], owner[1])
            if durable:
                os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(target.parent)


def atomic_write(
    path: Path | str,
    data: bytes | str,
    *,
    mode: int | None = None,
    backup: bool = True,
    before_rename: Callable[[Path], None] | None = None,
    durable: bool = True,
    root: Root | None = None,
    parents: bool = False,
) -> Path | None:
    """Replace ``path`` with ``data`` atomically; return the backup path if a backup was written.

    ``mode``: file mode for the new file; default is the previous file's mode, else 0644. The previous
    owner is kept when the caller may set it. The parent directory must exist. ``str`` data is written
    as UTF-8 exactly as given (no newline translation). ``before_rename`` is a test hook called with the
    fully written temporary file just before it replaces the target. ``durable=False`` skips the
    fsyncs: the replacement is still atomic for readers and against a killed process (the page cache
    survives it), but a power loss may bring back the previous file; only for files whose content ends
    with the boot anyway. ``root``: the path is resolved inside it (see the module's text); ``parents``:
    make the missing directories first (inside the root too).
    """
    target = _target(Path(path), root)
    if parents:
        target.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise IsADirectoryError(f"not a regular file: {target}")
    new_mode = mode if mode is not None else (stat.S_IMODE(st.st_mode) if st is not None else DEFAULT_MODE)
    owner = (st.st_uid, st.st_gid) if st is not None else None

    written_backup: Path | None = None
    if backup and st is not None:
        old = target.read_bytes()
        written_backup = backup_path(target)
        _write_replace(written_backup, old, stat.S_IMODE(st.st_mode), owner, None)
    _write_replace(target, payload, new_mode, owner, before_rename, durable)
    return written_backup


def remove(path: Path | str, *, durable: bool = True, root: Root | None = None) -> bool:
    """Delete a file durably (directory flushed unless ``durable=False``); ``False`` when it was already
    gone. Under ``root`` the directory is resolved inside it, never the file's own link (the link goes)."""
    p = Path(path) if root is None else _within(root, Path(path).parent) / Path(path).name
    try:
        p.unlink()
    except FileNotFoundError:
        return False
    if durable:
        fsync_dir(p.parent)
    return True


def remove_tree(path: Path | str, *, root: Root | None = None) -> bool:
    """Delete a directory and everything in it (links inside are removed, never followed); ``False`` when it
    was already gone. Under ``root`` the directory is resolved inside it first."""
    p = Path(path) if root is None else _within(root, Path(path).parent) / Path(path).name
    if p.is_symlink() or not p.is_dir():
        return False
    shutil.rmtree(p)
    return True
