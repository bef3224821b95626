"""The running agent's record, ``/run/nodeagent/agent.json``: its pid and start, its last config reload with
the outcome, the GPUs its health monitor holds unhealthy (with their last XID), whether it stopped cleanly,
and how many of its runs since boot ended without a clean stop.

``nodeagent run`` writes it (``AgentRecorder``) at its start, after each SIGHUP reload, at each change of the
GPUs' health and at a clean stop;
``nodeagent doctor`` reads it (``read_record``), also from inside the DaemonSet's pod where the host's
processes are not under its root. The file describes this boot's processes, so it lives under ``/run`` (a
tmpfs, the unit's RuntimeDirectory, mounted into the pod) and is replaced atomically without fsync: a reader
never sees half a record, and a power loss takes nothing that still matters. A record that cannot be written
is logged once and never stops the agent.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from nodeagent import fileio
from nodeagent.errors import InputError
from nodeagent.hostpaths import HostPaths

log = logging.getLogger(__name__)

RECORD = "/run/nodeagent/agent.json"
VERSION = 1
MAX_RECORD_BYTES = 64 << 10
MAX_DETAIL = 300
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
    )


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


class AgentRecorder:
    """Writes the running agent's record (the daemon's one writer of ``RECORD``)."""

    def __init__(self, paths: HostPaths, *, clock: Any = time.time, pid: int | None = None) -> None:
        self._paths = paths
        self._clock = clock
        self._pid = os.getpid() if pid is None else pid
        self._record: AgentRecord | None = None
        self._failed = False

    @property
    def record(self) -> AgentRecord | None:
        return self._record

    def started(self, config_source: str) -> None:
        now = self._clock()
        try:
            previous = read_record(self._paths)
        except InputError as e:
            log.debug("previous agent record ignored: %s", e)
            previous = None
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

    def stopped(self) -> None:
        if self._record is not None:
            self._write(replace(self._record, stopped=self._clock()))

    def _write(self, record: AgentRecord) -> None:
        self._record = record
        path = self._paths(RECORD)
        try:
            fileio.atomic_write(path, record.to_json(), mode=0o644, backup=False, durable=False, root=self._paths,
                                parents=True)
        except OSError as e:
            if not self._failed:
                log.warning("cannot write the agent record %s (doctor will not see this run): %s", RECORD, e)
            self._failed = True
        else:
            self._failed = False
