"""The running agent's record, ``/run/nodeagent/agent.json``: its pid and start, its last config reload with
the outcome, the GPUs its health monitor holds unhealthy (with their last XID), the other agents its conflict
detection found, the resources its device plugin serves (registered with the kubelet, or why not), whether it
stopped cleanly, and how many of its runs since boot ended without a clean stop.

While it runs the agent holds a POSIX lock on ``/run/nodeagent/agent.lock`` (``lock_holder`` names the holder):
doctor learns from it whether the record's run is still on, and its pid, without a ``/proc`` under the root
(a sandbox's has only the simulator's files) and without reading anything outside the root. The kernel drops
the lock when the process ends, however it ends.

``nodeagent run`` writes it (``AgentRecorder``) at its start, after each SIGHUP reload, at each change of the
GPUs' health and at a clean stop;
``nodeagent doctor`` reads it (``read_record``), also from inside the DaemonSet's pod where the host's
processes are not under its root. The file describes this boot's processes, so it lives under ``/run`` (a
tmpfs, the unit's RuntimeDirectory, mounted into the pod) and is replaced atomically without fsync: a reader
never sees half a record, and a power loss takes nothing that still matters. A record that cannot be written
is logged once and never stops the agent.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import posixpath
import stat
import struct
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from nodeagent import fileio
from nodeagent.errors import InputError, NodeAgentError
from nodeagent.hostpaths import HostPaths

log = logging.getLogger(__name__)

RECORD = "/run/nodeagent/agent.json"
LOCK = "/run/nodeagent/agent.lock"  # locked by the running agent (fcntl), empty
VERSION = 1
MAX_RECORD_BYTES = 64 << 10
MAX_DETAIL = 300
MAX_LISTED = 32  # conflicts, and resources, kept in the record
ReloadOutcome = Literal["applied", "unchanged", "rejected", "failed"]
OUTCOMES = ("applied", "unchanged", "rejected", "failed")


@dataclass(frozen=True)
class Reload:
    time: float  # seconds since the epoch
    outcome: str  # one of OUTCOMES
    detail: str = ""  # the sections that changed, or why the new config was refused


@dataclass(frozen=True)
class Fault:
    """A GPU (``gi`` set: one of its GPU instances) the agent serves as Unhealthy."""

    gpu: int
    xid: int | None = None  # the last XID the GPU reported
    gi: int | None = None
    recovery: str | None = None  # the driver's recovery action, None when it asks for none
    lost: bool = False  # fallen off the bus


@dataclass(frozen=True)
class OtherAgent:
    """Another agent acting on what this one acts on, as the agent's conflict detection found it
    (``nodeagent.adopt.detect.Conflict``: kind, what both act on, who the other is, one line)."""

    kind: str
    subject: str
    owner: str
    detail: str


@dataclass(frozen=True)
class Registration:
    """A resource the agent's device plugin serves or would serve: its socket's name in the device-plugin
    directory, whether the kubelet holds its registration, and why not (held back for another plugin, no
    kubelet, the socket taken, ...)."""

    resource: str
    socket: str
    registered: bool = False
    why: str = ""


@dataclass(frozen=True)
class AgentRecord:
    pid: int
    started: float  # seconds since the epoch
    config: str  # the config file in use, "defaults" without one
    starts: int = 1  # starts recorded since boot (since /run was emptied)
    reloads: int = 0  # SIGHUP reloads of this run
    last_reload: Reload | None = None
    stopped: float | None = None  # a clean stop of this run
    unclean_ends: int = 0  # earlier runs since boot that ended without a clean stop (killed, crashed)
    last_unclean: dict[str, Any] = field(default_factory=dict)  # {"pid", "started", "seen"} of the latest
    unhealthy: tuple[Fault, ...] = ()
    health_changed: float | None = None  # when ``unhealthy`` last changed
    conflicts: tuple[OtherAgent, ...] = ()
    resources: tuple[Registration, ...] = ()

    def to_json(self) -> str:
        doc = {"version": VERSION, **asdict(self)}
        return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def _number(doc: dict[str, Any], key: str, *, optional: bool = False) -> Any:
    value = doc.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number")
    return value


def parse_record(raw: bytes) -> AgentRecord:
    """An agent record from the file's bytes; ``ValueError`` in one line when it is none."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON ({str(e)[:100]})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"not an agent record of format {VERSION}")
    last = doc.get("last_reload")
    reload = None
    if last is not None:
        if not isinstance(last, dict) or last.get("outcome") not in OUTCOMES:
            raise ValueError("last_reload must be an object with an outcome of " + ", ".join(OUTCOMES))
        reload = Reload(float(_number(last, "time")), str(last["outcome"]), str(last.get("detail", ""))[:MAX_DETAIL])
    unclean = doc.get("last_unclean") or {}
    if not isinstance(unclean, dict):
        raise ValueError("last_unclean must be an object")
    faults = doc.get("unhealthy") or []
    if not isinstance(faults, list) or not all(isinstance(f, dict) for f in faults):
        raise ValueError("unhealthy must be a list of objects")
    unhealthy = tuple(Fault(gpu=int(_number(f, "gpu")), xid=_int_or_none(f, "xid"), gi=_int_or_none(f, "gi"),
                            recovery=None if f.get("recovery") is None else str(f["recovery"])[:100],
                            lost=f.get("lost") is True) for f in faults[:1024])
    conflicts = tuple(OtherAgent(*(_text(c, k) for k in ("kind", "subject", "owner", "detail")))
                      for c in _objects(doc, "conflicts"))
    resources = tuple(Registration(_text(r, "resource"), _text(r, "socket"), r.get("registered") is True,
                                   _text(r, "why")) for r in _objects(doc, "resources"))
    return AgentRecord(
        pid=int(_number(doc, "pid")),
        started=float(_number(doc, "started")),
        config=str(doc.get("config", "")),
        starts=int(_number(doc, "starts")),
        reloads=int(_number(doc, "reloads")),
        last_reload=reload,
        stopped=_number(doc, "stopped", optional=True),
        unclean_ends=int(_number(doc, "unclean_ends")),
        last_unclean={k: unclean[k] for k in ("pid", "started", "seen")
                      if isinstance(unclean.get(k), int | float) and not isinstance(unclean.get(k), bool)},
        unhealthy=unhealthy,
        health_changed=_number(doc, "health_changed", optional=True),
        conflicts=conflicts,
        resources=resources,
    )


def _objects(doc: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = doc.get(key) or []
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ValueError(f"{key} must be a list of objects")
    return items[:256]


def _text(doc: dict[str, Any], key: str) -> str:
    value = doc.get(key)
    return "" if value is None else " ".join(str(value).split())[:1000]


def _cut(text: str, limit: int = 2 * MAX_DETAIL) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _int_or_none(doc: dict[str, Any], key: str) -> int | None:
    value = _number(doc, key, optional=True)
    return None if value is None else int(value)


def read_record(paths: HostPaths) -> AgentRecord | None:
    """The record under the root; None when there is none; ``InputError`` naming the file when it is not one."""
    path = paths(RECORD)
    try:
        raw = fileio.read_regular(path, max_bytes=MAX_RECORD_BYTES)
    except fileio.UnreadableFileError as e:
        raise InputError(str(e), subject=RECORD) from None
    if raw is None:
        return None
    try:
        return parse_record(raw)
    except ValueError as e:
        raise InputError(f"{RECORD} is no agent record: {e}", subject=RECORD) from None


_FLOCK = "hhqqi4x"  # struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid


@dataclass(frozen=True)
class LockView:
    """What ``LOCK`` says: ``present`` False when there is no lock file (no agent of this version ran since
    boot: nothing can be told from it); ``holder`` the pid that holds it (0: a process that doctor's pid
    namespace does not show), None when none does (the run is over, however it ended)."""

    present: bool
    holder: int | None = None


def lock_holder(paths: HostPaths) -> LockView:
    """Who holds the running agent's lock under the root (read-only: ``F_GETLK`` on a read-only descriptor)."""
    try:
        fd = os.open(paths(posixpath.dirname(LOCK)) / posixpath.basename(LOCK),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except (OSError, NodeAgentError):
        return LockView(False)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return LockView(False)
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except OSError:
        return LockView(False)
    finally:
        os.close(fd)
    kind, _, _, _, pid = struct.unpack(_FLOCK, answer)
    return LockView(True, None if kind == fcntl.F_UNLCK else max(pid, 0))


class AgentRecorder:
    """Writes the running agent's record (the daemon's one writer of ``RECORD``); a recorder of this process
    (no ``pid`` given) also holds ``LOCK`` from its start to its clean stop."""

    def __init__(self, paths: HostPaths, *, clock: Any = time.time, pid: int | None = None) -> None:
        self._paths = paths
        self._clock = clock
        self._own = pid is None
        self._pid = os.getpid() if pid is None else pid
        self._record: AgentRecord | None = None
        self._failed = False
        self._replaced = False
        self._lock_fd: int | None = None

    @property
    def record(self) -> AgentRecord | None:
        return self._record

    def started(self, config_source: str) -> None:
        now = self._clock()
        try:
            previous = read_record(self._paths)
        except NodeAgentError as e:  # junk, a FIFO, a link loop: the agent's own file never stops the agent
            log.debug("previous agent record ignored: %s", e)
            previous = None
        if self._own:
            self._hold_lock()
        starts, unclean, last_unclean = 1, 0, {}
        if previous is not None:
            starts = previous.starts + 1
            unclean, last_unclean = previous.unclean_ends, previous.last_unclean
            if previous.stopped is None and previous.pid != self._pid:
                unclean += 1
                last_unclean = {"pid": previous.pid, "started": previous.started, "seen": now}
        self._write(AgentRecord(pid=self._pid, started=now, config=config_source or "defaults", starts=starts,
                                unclean_ends=unclean, last_unclean=last_unclean))

    def reloaded(self, outcome: ReloadOutcome, detail: str = "", config_source: str | None = None) -> None:
        """A SIGHUP reload ended: its outcome, what changed or why it was refused, the config now in use."""
        if self._record is None:
            return
        text = " ".join(detail.split())
        reload = Reload(self._clock(), outcome, text if len(text) <= MAX_DETAIL else text[: MAX_DETAIL - 3] + "...")
        config = self._record.config if config_source is None else config_source or "defaults"
        self._write(replace(self._record, reloads=self._record.reloads + 1, last_reload=reload, config=config))

    def health(self, unhealthy: tuple[Fault, ...]) -> None:
        """The GPUs the health monitor holds unhealthy now (written only when that changed)."""
        if self._record is not None and unhealthy != self._record.unhealthy:
            self._write(replace(self._record, unhealthy=unhealthy, health_changed=self._clock()))

    def observed(self, conflicts: tuple[OtherAgent, ...], resources: tuple[Registration, ...]) -> None:
        """The other agents the conflict detection finds now and the device plugin's resources with their
        registration (written only when either changed)."""
        # bounded, so that the record stays well within what doctor reads (MAX_RECORD_BYTES)
        conflicts = tuple(replace(c, detail=_cut(c.detail)) for c in conflicts[:MAX_LISTED])
        resources = tuple(replace(r, why=_cut(r.why)) for r in resources[:MAX_LISTED])
        if self._record is not None and (conflicts, resources) != (self._record.conflicts, self._record.resources):
            self._write(replace(self._record, conflicts=conflicts, resources=resources))

    def stopped(self) -> None:
        if self._record is not None:
            self._write(replace(self._record, stopped=self._clock()))
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _hold_lock(self) -> None:
        """Lock ``LOCK`` for this run (an entry that is no regular file is replaced); a lock that cannot be
        had is one warning: doctor then tells the run from /proc as before."""
        try:
            path = self._paths(posixpath.dirname(LOCK)) / posixpath.basename(LOCK)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._clear(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                         0o644)
        except (OSError, NodeAgentError) as e:
            log.warning("cannot lock %s (doctor will tell this run from /proc only): %s", LOCK, e)
            return
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            held = lock_holder(self._paths).holder
            why = (f"pid {held} holds it: another nodeagent run on this root?" if held
                   else e.strerror if e.errno not in (errno.EAGAIN, errno.EACCES) else "another process holds it")
            log.warning("cannot lock %s (%s); doctor will tell this run from /proc only", LOCK, why)
            return
        self._lock_fd = fd

    def _clear(self, path: Path) -> None:
        """Remove what is at one of the agent's own file names and is no regular file (a link, a FIFO, a
        socket): replaced by the next write, with one warning."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
            return  # (a directory is not removed: the write fails and says so)
        os.unlink(path)
        if not self._replaced:
            kind = next((name for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                                                 (stat.S_ISSOCK, "a socket")) if test(st.st_mode)), "a device")
            log.warning("%s was %s, not the agent's file: replaced", self._paths.to_host(path), kind)
        self._replaced = True

    def _write(self, record: AgentRecord) -> None:
        self._record = record
        try:
            # the record's own name is never followed: a link (a loop) or a FIFO there is replaced
            path = self._paths(posixpath.dirname(RECORD)) / posixpath.basename(RECORD)
            fileio.makedirs(path.parent, root=self._paths)
            self._clear(path)
            fileio.atomic_write(path, record.to_json(), mode=0o644, backup=False, durable=False, root=self._paths)
        except (OSError, NodeAgentError) as e:
            if not self._failed:
                log.warning("cannot write the agent record %s (doctor will not see this run): %s", RECORD, e)
            self._failed = True
        else:
            self._failed = False
