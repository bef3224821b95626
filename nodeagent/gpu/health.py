"""GPU health from NVML: critical XID events, lost GPUs, and recovery.

XID events come from the adapter's ``wait_events`` (a blocking call, run in a dedicated thread); a poll
asks ``gpu_healthy`` for every GPU. Which XIDs count as critical follows NVIDIA's plugin, including
its ``DP_DISABLE_HEALTHCHECKS`` / ``DP_ENABLE_HEALTHCHECKS`` variables. Unlike NVIDIA's plugin, an
unhealthy GPU (or MIG device) becomes healthy again once NVML has shown it healthy for
``recovery_window_s`` with no new critical XID.

A monitor can be stopped and replaced while its last ``wait_events`` call is still blocked (NVML waits
cannot be interrupted; the daemon rebuilds the device plugin on SIGHUP). So the waiting thread belongs to
the source, not to one monitor: ``_EventPump`` keeps one thread per source, delivers to whichever monitor
is attached, and holds what arrives while none is, for the next one. A replaced monitor also hands its
unhealthy set over, so neither an XID in flight nor one already applied is lost by a reload.

A reload may also replace the adapter itself (closed, and a new one opened on the same GPUs). Then the
hand-over goes by GPU UUID: a monitor starting on a new source of the same ``fault_domain`` adopts what
an idle pump of that domain holds (faults and late events, re-keyed to the GPUs' current indices), and
that pump forwards whatever its last wait still returns to the new one.

The pumps live in an ``EventPumps`` registry owned by whoever outlives the monitors (the daemon, across
reloads) and handed to each ``HealthMonitor``; monitors given none share one process-wide registry.

Recovery also follows the driver: after an XID it may ask for a recovery action (GPU reset, node reboot,
drain; NVML field 230). A GPU whose recovery action is not "none" stays unhealthy until the driver
reports "none"; then the quiet window applies as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from nodeagent.deadline import cancel_all
from nodeagent.errors import ConfigError
from nodeagent.gpu.ports import RECOVERY_NONE, recovery_action_name

log = logging.getLogger(__name__)

DEFAULT_SKIPPED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
ENV_DISABLE = "DP_DISABLE_HEALTHCHECKS"
ENV_ENABLE = "DP_ENABLE_HEALTHCHECKS"
_NO_INSTANCE = 0xFFFFFFFF  # NVML's "not a MIG event" GPU/compute-instance id
_RECOVERY_NOTE = " (recovery: "


class HealthSource(Protocol):
    """What health monitoring needs from the NVML adapter (its ``HealthEvents`` port plus GPU identity)."""

    def wait_events(self, timeout_ms: int) -> Sequence[Any]: ...

    def gpu_healthy(self, index: int) -> bool: ...

    def recovery_action(self, index: int) -> int:
        """The driver's recovery action for the GPU (0: none needed)."""
        ...

    @property
    def fault_domain(self) -> str | None:
        """Where a GPU UUID names the same device across sources (None: UUIDs are not comparable)."""
        ...

    def gpu_uuid(self, index: int) -> str: ...


@dataclass(frozen=True)
class HealthMonitorSettings:
    """Which XIDs are critical, and how a device recovers."""

    enabled: bool = True  # False: DP_DISABLE_HEALTHCHECKS=all — every device stays Healthy
    ignore_all_xids: bool = False  # DP_DISABLE_HEALTHCHECKS=xids
    skipped_xids: frozenset[int] = DEFAULT_SKIPPED_XIDS
    all_xids_critical: bool = False  # DP_ENABLE_HEALTHCHECKS=all|xids
    forced_xids: frozenset[int] = frozenset()  # DP_ENABLE_HEALTHCHECKS=<list>
    recovery_window_s: float | None = 60.0  # None: never recover (NVIDIA's behaviour)
    poll_interval_s: float = 1.0
    # How long one blocking wait_events call may last. Events end the wait at once, so this only sets how
    # often the idle waiting thread wakes and how long a stopped monitor's last wait can linger.
    event_wait_ms: int = 1000

    def is_critical(self, xid: int) -> bool:
        if not self.enabled:
            return False
        if self.all_xids_critical or xid in self.forced_xids:
            return True
        if self.ignore_all_xids:
            return False
        return xid not in self.skipped_xids

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> HealthMonitorSettings:
        """Settings from NVIDIA's variables; ``overrides`` set the remaining fields."""
        env = os.environ if environ is None else environ
        disabled = _tokens(env.get(ENV_DISABLE, ""), ENV_DISABLE)
        enabled = _tokens(env.get(ENV_ENABLE, ""), ENV_ENABLE)
        fields: dict[str, Any] = {
            "enabled": "all" not in disabled,
            "ignore_all_xids": "xids" in disabled,
            "skipped_xids": DEFAULT_SKIPPED_XIDS | {int(t) for t in disabled if t.isdigit()},
            "all_xids_critical": bool({"all", "xids"} & enabled),
            "forced_xids": frozenset(int(t) for t in enabled if t.isdigit()),
        }
        fields.update(overrides)
        return cls(**fields)


def _tokens(value: str, name: str) -> set[str]:
    out: set[str] = set()
    for raw in value.split(","):
        t = raw.strip().lower()
        if not t:
            continue
        if t not in ("all", "xids") and not t.isdigit():
            raise ConfigError(f"{name}: {raw.strip()!r} is not 'all', 'xids' or an XID number", subject=name)
        out.add(t)
    return out


@dataclass(frozen=True)
class XidEvent:
    """A critical-event report for a GPU; ``gi_id`` set when NVML tied it to one MIG instance."""

    gpu_index: int
    xid: int
    gi_id: int | None = None


def to_xid_event(raw: Any) -> XidEvent | None:
    """Normalise an adapter event (object or mapping); None for events that are not XIDs."""

    def get(*names: str) -> Any:
        for n in names:
            v = raw.get(n) if isinstance(raw, Mapping) else getattr(raw, n, None)
            if v is not None:
                return v
        return None

    kind = get("kind", "type")
    if kind is not None and str(kind).lower() not in ("xid", "critical_xid", "xid_critical_error"):
        return None
    gpu = get("gpu_index", "gpu", "index")
    xid = get("xid", "event_data", "data")
    if gpu is None or xid is None:
        return None
    gi = get("gi_id", "gpu_instance_id")
    if gi is not None and int(gi) == _NO_INSTANCE:
        gi = None
    return XidEvent(gpu_index=int(gpu), xid=int(xid), gi_id=None if gi is None else int(gi))


HealthKey = tuple[int, int | None]  # (gpu index, GPU-instance id or None for the whole GPU)


@dataclass
class _Fault:
    reason: str
    last_bad: float
    healthy_since: float | None = None


_Item = Sequence[Any] | Exception  # one wait's events, or the error that ended it
MAX_HELD_BATCHES = 256  # events held for a monitor that has not attached yet (oldest dropped beyond)


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    inbox: asyncio.Queue[_Item]
    wait_ms: int
    retry_s: float


def _gpu_uuids(source: HealthSource, indices: Iterable[int]) -> dict[int, str]:
    """GPU index -> UUID as far as the source can tell (blocking)."""
    out: dict[int, str] = {}
    for index in sorted(indices):
        with contextlib.suppress(Exception):  # a lost GPU keeps no UUID; it is marked again by the poll
            uuid = source.gpu_uuid(index)
            if uuid:
                out[index] = uuid
    return out


def _rekey(batch: Sequence[Any], old: Mapping[int, str], new: Mapping[str, int]) -> list[XidEvent]:
    """A batch's XIDs re-addressed from one adapter's GPU indices to another's, by UUID."""
    out: list[XidEvent] = []
    for raw in batch:
        ev = to_xid_event(raw)
        index = None if ev is None else new.get(old.get(ev.gpu_index, ""))
        if ev is not None and index is not None:
            out.append(replace(ev, gpu_index=index))
    return out


class _EventPump:
    """The one thread waiting on one source's events, outliving the monitors that come and go on it."""

    def __init__(self, source: HealthSource) -> None:
        try:
            ref: Callable[[], HealthSource | None] = weakref.ref(source)
        except TypeError:  # not weak-referenceable: the registry keeps it alive
            ref = lambda: source  # noqa: E731
        self.source_ref = ref  # only the running thread holds the source itself
        self._lock = threading.Lock()
        self._sink: _Sink | None = None
        self._held: list[Sequence[Any]] = []
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self.handed_over: dict[HealthKey, _Fault] = {}  # the last stopped monitor's unhealthy set
        self.domain: str | None = None  # see _fault_domain; set with ``uuids`` by a monitor's stop
        self.uuids: dict[int, str] = {}  # GPU index -> UUID on this source
        self.successor: _EventPump | None = None  # a pump on a new source that adopted this one

    def idle(self) -> bool:
        return self._sink is None

    def adopt_from(self, old: _EventPump) -> tuple[dict[HealthKey, _Fault], list[list[XidEvent]]]:
        """Take ``old``'s (an idle pump of the same domain) hand-over, re-keyed to this source's GPUs, and
        have it forward what its last wait still returns."""
        by_uuid = {u: i for i, u in self.uuids.items()}
        with old._lock:
            faults = {(by_uuid[old.uuids[k[0]]], k[1]): replace(f) for k, f in old.handed_over.items()
                      if old.uuids.get(k[0]) in by_uuid}
            batches = [b for b in (_rekey(h, old.uuids, by_uuid) for h in old._held) if b]
            old.handed_over, old._held, old.successor = {}, [], self
        return faults, batches

    def attach(self, source: HealthSource, sink: _Sink) -> None:
        """Route events to ``sink`` (on its loop's thread), starting with those held meanwhile."""
        with self._lock:
            self._sink, self.successor = sink, None
            held, self._held = self._held, []
            for batch in held:
                sink.inbox.put_nowait(batch)
            if self._thread is None:  # else the running thread keeps going and delivers here from now on
                self._thread = threading.Thread(
                    target=self._run, args=(source,), name="gpu-health-events", daemon=True
                )
                self._thread.start()

    def detach(self, sink: _Sink, unhandled: Iterable[_Item] = ()) -> None:
        """Stop routing to ``sink``; ``unhandled`` (its inbox's leftovers) is kept for the next monitor."""
        batches = [b for b in unhandled if not isinstance(b, Exception)]
        with self._lock:
            if self._sink is sink:
                self._sink = None
            successor = self._sink
            if successor is None:
                self._held[:0] = batches  # older than whatever was held meanwhile
                self._trim()
        if successor is not None:  # a successor attached before this monitor finished stopping
            for batch in batches:
                self._send(successor, batch)
        self._wake.set()

    def _keep(self, item: _Item) -> None:
        """With the lock held: keep events nobody is attached to receive (an error is only worth logging
        by a running monitor), or pass them to the successor on a new source."""
        if isinstance(item, Exception):
            return
        nxt = self.successor
        if nxt is None:
            self._held.append(item)
            self._trim()
            return
        batch = _rekey(item, self.uuids, {u: i for i, u in nxt.uuids.items()})
        if batch:  # locks are only ever taken older pump first, so this cannot deadlock
            nxt.deliver(batch)

    def deliver(self, batch: Sequence[Any]) -> None:
        """From any thread: give ``batch`` to the attached monitor, or hold it for the next one."""
        with self._lock:
            sink = self._sink
            if sink is None:
                self._keep(batch)
                return
        self._send(sink, batch)

    def _trim(self) -> None:
        if len(self._held) > MAX_HELD_BATCHES:
            log.warning("no health monitor attached: dropping %d old event batch(es)",
                        len(self._held) - MAX_HELD_BATCHES)
            del self._held[: len(self._held) - MAX_HELD_BATCHES]

    def _route(self, item: _Item) -> None:
        """On a loop thread: give ``item`` to the monitor attached now (it may have changed in transit)."""
        with self._lock:
            sink = self._sink
            if sink is None:
                self._keep(item)
                return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if sink.loop is running:
            sink.inbox.put_nowait(item)
        else:
            self._send(sink, item)

    def _send(self, sink: _Sink, item: _Item) -> None:
        try:
            sink.loop.call_soon_threadsafe(self._route, item)
        except RuntimeError:  # that loop is closed: its monitor is gone without detaching
            with self._lock:
                if self._sink is sink:
                    self._sink = None
                self._keep(item)

    def _run(self, source: HealthSource) -> None:
        while True:
            with self._lock:
                sink = self._sink
                if sink is None:  # nobody attached: end; the next attach starts a new thread
                    self._thread = None
                    return
                self._wake.clear()
            started = time.monotonic()
            item: _Item
            try:
                item = source.wait_events(sink.wait_ms)
            except Exception as e:
                item = e
            if isinstance(item, Exception) or item:
                with self._lock:
                    now = self._sink
                    if now is None:  # the monitor stopped during this wait: keep them for its successor
                        self._keep(item)
                if now is not None:
                    self._send(now, item)
            if isinstance(item, Exception):
                self._wake.wait(sink.retry_s)
            elif not item:  # a source that returns early with nothing must not make this thread spin
                self._wake.wait(max(0.0, sink.wait_ms / 1000.0 - (time.monotonic() - started)))


class EventPumps:
    """The event pumps of one owner: one per health source, kept while monitors on it come and go, and
    the hand-over of sources that were closed (a reload that reopened the adapter). Create one where the
    monitors' lifetimes end (the daemon) and give it to every ``HealthMonitor``."""

    def __init__(self) -> None:
        self._pumps: dict[int, _EventPump] = {}  # id(source) -> pump; the pump's weak ref proves identity
        self._orphans: list[_EventPump] = []  # pumps of sources gone before a successor adopted them
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._pumps)

    def predecessors(self, pump: _EventPump, domain: str) -> list[_EventPump]:
        """Idle pumps of other sources in ``domain`` with something to hand over, oldest first."""
        with self._lock:
            found = [p for p in (*self._orphans, *self._pumps.values()) if p is not pump and p.domain == domain
                     and p.idle() and (p.handed_over or p._held or p.successor is None)]
            self._orphans[:] = [p for p in self._orphans if p not in found]
            return found

    def pump_for(self, source: HealthSource) -> _EventPump:
        with self._lock:
            for key in [k for k, p in self._pumps.items() if p.source_ref() is None]:
                gone = self._pumps.pop(key)
                if gone.domain is not None and (gone.handed_over or gone._held):  # a closed adapter's hand-over
                    self._orphans.append(gone)
            pump = self._pumps.get(id(source))
            if pump is None or pump.source_ref() is not source:
                pump = self._pumps[id(source)] = _EventPump(source)
            return pump


_SHARED_PUMPS = EventPumps()  # for monitors whose creator keeps no registry of its own


def shared_pumps() -> EventPumps:
    return _SHARED_PUMPS


@dataclass
class HealthMonitor:
    """Tracks unhealthy GPUs / MIG instances and calls ``on_change`` whenever the set changes."""

    source: HealthSource
    settings: HealthMonitorSettings
    on_change: Callable[[], Awaitable[None]]
    clock: Callable[[], float] = time.monotonic
    pumps: EventPumps = field(default_factory=shared_pumps)
    gpu_indices: frozenset[int] = frozenset()
    faults: dict[HealthKey, _Fault] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopping: bool = False
    _logged: set[str] = field(default_factory=set)
    _sink: _Sink | None = None
    # GPUs kept out of service by their remediation (index → why), whatever NVML says, until released
    held: dict[int, str] = field(default_factory=dict)
    # told of every XID event of the monitored GPUs, critical or not (the remediation's fault feed)
    xid_listeners: list[Callable[[XidEvent], None]] = field(default_factory=list)

    def is_healthy(self, gpu_index: int, gi_id: int | None = None) -> bool:
        if gpu_index in self.held or (gpu_index, None) in self.faults:
            return False
        return gi_id is None or (gpu_index, gi_id) not in self.faults

    def unhealthy(self) -> dict[HealthKey, str]:
        out = {k: f.reason for k, f in self.faults.items()}
        for index, why in self.held.items():
            out[(index, None)] = why
        return out

    async def hold(self, gpu_index: int, reason: str) -> None:
        """Keep the GPU (all its devices) Unhealthy until ``release``: its remediation withdrew it."""
        if self.held.get(gpu_index) != reason:
            self.held[gpu_index] = reason
            await self.on_change()

    async def release(self, gpu_index: int) -> None:
        """The GPU was remediated (reset and checked): Healthy again at once, its past faults forgotten."""
        had = self.held.pop(gpu_index, None) is not None
        keys = [k for k in self.faults if k[0] == gpu_index]
        for k in keys:
            del self.faults[k]
        if had or keys:
            await self.on_change()

    async def start(self, gpu_indices: Iterable[int]) -> None:
        self.gpu_indices = frozenset(gpu_indices)
        self._stopping = False
        if not self.settings.enabled:
            log.info("health checks disabled (%s=all)", ENV_DISABLE)
            return
        pump = self.pumps.pump_for(self.source)
        if not self.faults and pump.handed_over:  # a replaced monitor's unhealthy devices stay unhealthy
            self.faults = {k: replace(f) for k, f in pump.handed_over.items() if k[0] in self.gpu_indices}
        pump.handed_over = {}
        late: list[list[XidEvent]] = []
        domain = self.source.fault_domain
        if domain is not None and pump.domain is None:  # a new source: adopt a replaced adapter's hand-over
            old = self.pumps.predecessors(pump, domain)
            if old:
                pump.uuids = await asyncio.to_thread(_gpu_uuids, self.source, self.gpu_indices)
                pump.domain = domain
                for p in old:
                    faults, batches = pump.adopt_from(p)
                    for k, f in faults.items():
                        self.faults.setdefault(k, f)
                    late += batches
        pump.domain = domain
        self._sink = _Sink(asyncio.get_running_loop(), asyncio.Queue(), self.settings.event_wait_ms,
                           self.settings.poll_interval_s)
        self._tasks = [
            asyncio.create_task(self._event_loop(self._sink.inbox), name="health-events"),
            asyncio.create_task(self._poll_loop(), name="health-poll"),
        ]
        for batch in late:
            self._sink.inbox.put_nowait(batch)
        pump.attach(self.source, self._sink)

    def set_gpus(self, gpu_indices: Iterable[int]) -> None:
        self.gpu_indices = frozenset(gpu_indices)
        for key in [k for k in self.faults if k[0] not in self.gpu_indices]:
            del self.faults[key]

    async def stop(self) -> None:
        """Stop at once. A wait still blocked in the source is not waited for: what it returns, and what
        this monitor had received but not applied, goes to the next monitor started on the same source,
        together with the unhealthy set."""
        self._stopping = True
        tasks, self._tasks = self._tasks, []
        sink, self._sink = self._sink, None
        pump = self.pumps.pump_for(self.source) if sink is not None else None
        if pump is not None and sink is not None:
            pump.detach(sink)  # from here the source's events are held for the successor
        await cancel_all(tasks, log)
        if pump is not None and sink is not None:
            leftovers: list[_Item] = []
            while not sink.inbox.empty():
                leftovers.append(sink.inbox.get_nowait())
            if pump.domain is not None:  # so a monitor on a new adapter can adopt by UUID
                pump.uuids = await asyncio.to_thread(_gpu_uuids, self.source, self.gpu_indices)
            pump.handed_over = {k: replace(f) for k, f in self.faults.items()}
            pump.detach(sink, leftovers)

    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)

    async def _event_loop(self, inbox: asyncio.Queue[_Item]) -> None:
        # The blocking waits run in the source's one event thread (``_EventPump``), which wakes the event
        # loop only when events (or an adapter error) arrive: an idle daemon costs one cheap thread wake-up
        # per ``event_wait_ms`` instead of an executor round trip through the loop. It is a daemon thread,
        # so a wait still running when the monitor stops never holds up the process's exit.
        while True:
            item = await inbox.get()
            if isinstance(item, Exception):  # the adapter failing must not kill health monitoring
                self._log_once(f"wait:{type(item).__name__}", "waiting for NVML events failed: %s", item)
            elif await self.handle_events(item):
                await self.on_change()

    async def handle_events(self, events: Iterable[Any]) -> bool:
        """Apply adapter events; True when the unhealthy set changed."""
        changed = False
        now = self.clock()
        for raw in events:
            ev = to_xid_event(raw)
            if ev is not None and ev.gpu_index in self.gpu_indices:
                for listener in list(self.xid_listeners):
                    try:
                        listener(ev)
                    except Exception:  # a listener's failure must not stop health monitoring
                        log.exception("GPU %d: an XID listener failed", ev.gpu_index)
            if ev is None or ev.gpu_index not in self.gpu_indices or not self.settings.is_critical(ev.xid):
                if ev is not None:
                    log.info("GPU %d: XID %d ignored", ev.gpu_index, ev.xid)
                continue
            key: HealthKey = (ev.gpu_index, ev.gi_id)
            where = f"GPU {ev.gpu_index}" + (f" GI {ev.gi_id}" if ev.gi_id is not None else "")
            fault = self.faults.get(key)
            if fault is None:
                window = self.settings.recovery_window_s
                log.warning("%s: critical XID %d, marking unhealthy (%s)", where, ev.xid,
                            "until the agent restarts: no [health] window" if window is None else
                            f"Healthy again once NVML has shown it healthy for {window:.0f}s without another "
                            f"critical XID; checked every {self.settings.poll_interval_s:.0f}s")
                self.faults[key] = _Fault(reason=f"XID {ev.xid}", last_bad=now)
                changed = True
            else:
                fault.last_bad, fault.reason = now, f"XID {ev.xid}"
        return changed

    async def _poll_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.settings.poll_interval_s)
            try:
                if await self.poll_once():
                    await self.on_change()
            except Exception:  # one bad round must not end health monitoring for the agent's lifetime
                log.exception("GPU health poll failed; polling again in %.1fs", self.settings.poll_interval_s)

    async def poll_once(self) -> bool:
        """Ask NVML about every GPU; mark lost ones, recover quiet ones. True when anything changed."""
        changed = False
        now = self.clock()
        window = self.settings.recovery_window_s
        for index in sorted(self.gpu_indices):
            try:
                ok = await asyncio.to_thread(self.source.gpu_healthy, index)
            except Exception as e:
                self._log_once(f"poll:{index}:{type(e).__name__}", "GPU %d: health query failed: %s", index, e)
                ok = False
            keys = [k for k in self.faults if k[0] == index]
            if not ok:
                if (index, None) not in self.faults:
                    log.warning("GPU %d: NVML reports it lost/unhealthy, marking all its devices unhealthy", index)
                    self.faults[(index, None)] = _Fault(reason="GPU lost", last_bad=now)
                    changed = True
                for k in keys:
                    self.faults[k].healthy_since = None
                    self.faults[k].last_bad = now
                continue
            if keys:
                try:
                    action = await asyncio.to_thread(self.source.recovery_action, index)
                except Exception as e:
                    self._log_once(f"recovery:{index}:{type(e).__name__}",
                                   "GPU %d: recovery action query failed: %s", index, e)
                    action = RECOVERY_NONE
                # the faults may have changed while NVML answered (a remediation's ``release``, an XID)
                keys = [k for k in self.faults if k[0] == index]
                if action != RECOVERY_NONE:  # the driver wants a reset/reboot/drain first: stay unhealthy
                    what = recovery_action_name(action)
                    self._log_once(f"recovery:{index}:{action}", "GPU %d: the driver asks for recovery action "
                                   "%r; it stays unhealthy until that is done", index, what)
                    for k in keys:
                        fault = self.faults[k]
                        fault.healthy_since = None
                        fault.last_bad = now
                        fault.reason = f"{fault.reason.split(_RECOVERY_NOTE)[0]}{_RECOVERY_NOTE}{what})"
                    continue
            if window is None:
                for k in keys:
                    self._log_once(f"never:{k}", "GPU %d%s: NVML reports it healthy, but it stays Unhealthy until the "
                                   "agent restarts (no [health] window: NVIDIA's behaviour)", index,
                                   f" GI {k[1]}" if k[1] is not None else "")
                continue
            for k in keys:
                fault = self.faults[k]
                if fault.healthy_since is None:
                    fault.healthy_since = now
                    # said once per episode: the GPU answers again (after an XID, a loss, the driver's recovery
                    # action), and when it will be served Healthy again
                    log.info("GPU %d%s: NVML reports it healthy; it stays Unhealthy until %.0fs pass without a "
                             "critical XID ([health] window): Healthy again in %.0fs unless one comes", index,
                             f" GI {k[1]}" if k[1] is not None else "", window,
                             max(0.0, max(now, fault.last_bad) + window - now))
                if now - max(fault.healthy_since, fault.last_bad) >= window:
                    log.info("GPU %d%s healthy again after %.1fs without critical events", index,
                             f" GI {k[1]}" if k[1] is not None else "", window)
                    del self.faults[k]
                    changed = True
        return changed
