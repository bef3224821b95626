"""The disruption budget an operator writes, validated, and the pure math on it.

The budget is one YAML document, the key ``budget.yaml`` of the ConfigMap ``nodeagent-fleet`` in the
agent's namespace (docs/fleet.md)::

    leaseDurationSeconds: 60         # a slot whose holder stops renewing is free again after this
    pools:                           # a node belongs to the FIRST pool whose selector matches its labels
      - name: a100
        nodeSelector: "pool=a100,nvidia.com/gpu.present"
        maxUnavailable: 5%           # a count (3) or a percentage of the pool's nodes (rounded down, >= 1)
        maxFailures: 2               # the brake: more failed changes than this and no slot is taken
        windows:                     # none: always open. A window may cross midnight (end <= start).
          - {days: [sat, sun], start: "01:00", end: "05:00", timeZone: Europe/Berlin}
        blockingPods: "app=critical-training"   # a node running such a pod does not start (as Kured's)

Every bad entry is one ``ConfigError`` naming the field (``pools[0].maxUnavailable``) and nothing of the
budget is used. Nothing here reads a clock or the API: callers pass ``now`` and the pool's node count.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from nodeagent.boundedyaml import load_document, shown
from nodeagent.errors import ConfigError

CONFIGMAP = "nodeagent-fleet"
CONFIGMAP_KEY = "budget.yaml"
SOURCE = f"ConfigMap {CONFIGMAP} key {CONFIGMAP_KEY}"
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
DEFAULT_LEASE_S = 60
DEFAULT_MAX_FAILURES = 2
# a pool name becomes part of Lease names (``nf-slot-<pool>-<i>``): a DNS label, short enough for the rest
_POOL_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_HHMM = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])$")


# -- label selectors (the string form kubectl -l takes) ------------------------------------------------------

@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "!":
            return self.key not in labels
        if self.op in ("=", "in"):
            return labels.get(self.key) in self.values
        return labels.get(self.key) not in self.values  # "!=", "notin": an absent key matches


@dataclass(frozen=True)
class Selector:
    """A parsed label selector; ``text`` is sent to the API server as is."""

    text: str
    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)


_SET_REQ = re.compile(r"^\s*(\S+)\s+(in|notin)\s+\(([^()]*)\)\s*$")


def parse_selector(text: str, where: str) -> Selector:
    """``a=b,c!=d,e in (x,y),f notin (z),g,!h`` (kubectl's syntax); ``ConfigError`` naming ``where``."""
    if not isinstance(text, str):
        raise ConfigError(f"{SOURCE}: {where}: a label selector string like 'pool=a100', not {shown(text)}",
                          subject=where)
    parts: list[str] = []
    depth, cur = 0, ""
    for ch in text:  # split at commas outside parentheses
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += 1 if ch == "(" else -1 if ch == ")" else 0
        cur += ch
    parts.append(cur)
    reqs: list[Requirement] = []
    for raw in (p.strip() for p in parts):
        if not raw:
            if text.strip():
                raise ConfigError(f"{SOURCE}: {where}: empty requirement in selector {shown(text)}", subject=where)
            continue
        req = _requirement(raw)
        if req is None or not _LABEL_KEY.match(req.key) or not all(_LABEL_VALUE.match(v) for v in req.values):
            raise ConfigError(f"{SOURCE}: {where}: {shown(raw)} is not a label requirement (key=value, key!=value, "
                              "key in (a,b), key notin (a,b), key, !key)", subject=where)
        reqs.append(req)
    return Selector(text.strip(), tuple(reqs))


def _requirement(raw: str) -> Requirement | None:
    m = _SET_REQ.match(raw)
    if m:
        values = tuple(v.strip() for v in m.group(3).split(","))
        return Requirement(m.group(1), m.group(2), values) if all(values) else None
    for op in ("!=", "==", "="):
        if op in raw:
            key, _, value = raw.partition(op)
            return Requirement(key.strip(), "!=" if op == "!=" else "=", (value.strip(),))
    if raw.startswith("!"):
        return Requirement(raw[1:].strip(), "!")
    return Requirement(raw, "exists")


# -- maintenance windows -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    """Days (when the window opens), ``start``..``end`` local time in ``zone``; end <= start crosses midnight."""

    days: frozenset[int]  # 0 = Monday
    start: time
    end: time
    zone: str

    def _span(self, day: datetime) -> tuple[datetime, datetime]:
        tz = ZoneInfo(self.zone)
        opens = datetime.combine(day.date(), self.start, tz)
        closes = datetime.combine(day.date(), self.end, tz)
        if closes <= opens:
            closes += timedelta(days=1)
        return opens, closes

    def is_open(self, now: datetime) -> bool:
        local = now.astimezone(ZoneInfo(self.zone))
        for back in (0, 1):  # a window opened yesterday may still be open after midnight
            day = local - timedelta(days=back)
            if day.weekday() in self.days:
                opens, closes = self._span(day)
                if opens <= now < closes:
                    return True
        return False

    def next_open(self, now: datetime) -> datetime | None:
        local = now.astimezone(ZoneInfo(self.zone))
        for ahead in range(0, 8):
            day = local + timedelta(days=ahead)
            if day.weekday() in self.days:
                opens, _ = self._span(day)
                if opens > now:
                    return opens
        return None

    def describe(self) -> str:
        days = ",".join(DAYS[d] for d in sorted(self.days))
        return f"{days} {self.start:%H:%M}-{self.end:%H:%M} {self.zone}"


def windows_open(windows: Sequence[Window], now: datetime) -> bool:
    return not windows or any(w.is_open(now) for w in windows)


def next_opening(windows: Sequence[Window], now: datetime) -> datetime | None:
    times = [t for w in windows if (t := w.next_open(now)) is not None]
    return min(times) if times else None


# -- the budget --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MaxUnavailable:
    value: int
    percent: bool

    def slots(self, pool_size: int) -> int:
        """How many of the pool's nodes may change at once: a count as given; a percentage of the pool's
        nodes rounded down, but at least 1 when the percentage is not 0 (else a small pool never moves)."""
        if not self.percent:
            return self.value
        if self.value == 0:
            return 0
        return max(1, math.floor(pool_size * self.value / 100))

    def __str__(self) -> str:
        return f"{self.value}%" if self.percent else str(self.value)


@dataclass(frozen=True)
class Pool:
    name: str
    selector: Selector
    max_unavailable: MaxUnavailable
    max_failures: int = DEFAULT_MAX_FAILURES
    windows: tuple[Window, ...] = ()
    blocking_pods: Selector | None = None


@dataclass(frozen=True)
class FleetBudget:
    pools: tuple[Pool, ...] = ()
    lease_duration_s: int = DEFAULT_LEASE_S
    source: str = SOURCE

    def pool_for(self, labels: Mapping[str, str]) -> Pool | None:
        """The first pool whose selector matches these Node labels (None: the node is in no pool)."""
        return next((p for p in self.pools if p.selector.matches(labels)), None)

    def pool(self, name: str) -> Pool | None:
        return next((p for p in self.pools if p.name == name), None)


def parse_budget(text: str, source: str = SOURCE) -> FleetBudget:
    """The budget of ``budget.yaml``'s text; one ``ConfigError`` naming the field for any bad entry."""
    doc = load_document(text, source)
    if doc is None:
        return FleetBudget(source=source)
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: a mapping with 'pools' is expected, not {shown(doc)}", subject=source)
    unknown = sorted(set(doc) - {"pools", "leaseDurationSeconds"})
    if unknown:
        raise ConfigError(f"{source}: unknown field {unknown[0]!r} (known: leaseDurationSeconds, pools)",
                          subject=str(unknown[0]))
    lease = doc.get("leaseDurationSeconds", DEFAULT_LEASE_S)
    if isinstance(lease, bool) or not isinstance(lease, int) or not 5 <= lease <= 3600:
        raise ConfigError(f"{source}: leaseDurationSeconds: a whole number of seconds from 5 to 3600, "
                          f"not {shown(lease)}", subject="leaseDurationSeconds")
    pools_raw = doc.get("pools") or []
    if not isinstance(pools_raw, list):
        raise ConfigError(f"{source}: pools: a list of pools, not {shown(pools_raw)}", subject="pools")
    pools: list[Pool] = []
    for i, raw in enumerate(pools_raw):
        pool = _pool(raw, f"pools[{i}]", source)
        if any(p.name == pool.name for p in pools):
            raise ConfigError(f"{source}: pools[{i}].name: {pool.name!r} is the name of an earlier pool",
                              subject=f"pools[{i}].name")
        pools.append(pool)
    return FleetBudget(tuple(pools), lease, source)


_POOL_FIELDS = ("name", "nodeSelector", "maxUnavailable", "maxFailures", "windows", "blockingPods")


def _pool(raw: Any, where: str, source: str) -> Pool:
    def bad(fld: str, what: str) -> ConfigError:
        return ConfigError(f"{source}: {where}.{fld}: {what}", subject=f"{where}.{fld}")

    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where}: a mapping (name, nodeSelector, maxUnavailable, ...), not "
                          f"{shown(raw)}", subject=where)
    unknown = sorted(set(raw) - set(_POOL_FIELDS))
    if unknown:
        raise bad(str(unknown[0]), f"unknown field (known: {', '.join(_POOL_FIELDS)})")
    name = raw.get("name")
    if not isinstance(name, str) or not _POOL_NAME.match(name):
        raise bad("name", f"a lower-case DNS label of at most 32 characters, not {shown(name)}")
    if "nodeSelector" not in raw:
        raise bad("nodeSelector", "missing (a label selector such as 'pool=a100'; '' selects every node)")
    selector = parse_selector(raw["nodeSelector"], f"{where}.nodeSelector")
    mu = raw.get("maxUnavailable")
    if mu is None:
        raise bad("maxUnavailable", "missing (a count such as 2, or a percentage such as '5%')")
    if isinstance(mu, bool):
        raise bad("maxUnavailable", f"a count or a percentage, not {shown(mu)}")
    if isinstance(mu, int):
        if mu < 0:
            raise bad("maxUnavailable", f"a count must not be negative, not {mu}")
        max_unavailable = MaxUnavailable(mu, False)
    elif isinstance(mu, str) and re.fullmatch(r"\d{1,3}%", mu.strip()) and int(mu.strip()[:-1]) <= 100:
        max_unavailable = MaxUnavailable(int(mu.strip()[:-1]), True)
    else:
        raise bad("maxUnavailable", f"a count (2) or a percentage from 0% to 100% ('5%'), not {shown(mu)}")
    mf = raw.get("maxFailures", DEFAULT_MAX_FAILURES)
    if isinstance(mf, bool) or not isinstance(mf, int) or mf < 0:
        raise bad("maxFailures", f"a count of failed changes (0 or more), not {shown(mf)}")
    wins = raw.get("windows") or []
    if not isinstance(wins, list):
        raise bad("windows", f"a list of windows, not {shown(wins)}")
    windows = tuple(_window(w, f"{where}.windows[{j}]", source) for j, w in enumerate(wins))
    blocking = raw.get("blockingPods")
    blocking_sel = None
    if blocking is not None:
        blocking_sel = parse_selector(blocking, f"{where}.blockingPods")
        if not blocking_sel.requirements:
            raise bad("blockingPods", "an empty selector would make every pod block; leave the field out")
    return Pool(name, selector, max_unavailable, mf, windows, blocking_sel)


def _window(raw: Any, where: str, source: str) -> Window:
    def bad(fld: str, what: str) -> ConfigError:
        return ConfigError(f"{source}: {where}.{fld}: {what}", subject=f"{where}.{fld}")

    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where}: a mapping with days, start, end, timeZone, not {shown(raw)}",
                          subject=where)
    unknown = sorted(set(raw) - {"days", "start", "end", "timeZone"})
    if unknown:
        raise bad(str(unknown[0]), "unknown field (known: days, start, end, timeZone)")
    days_raw = raw.get("days", list(DAYS))
    if not isinstance(days_raw, list) or not days_raw:
        raise bad("days", f"a list of days (mon ... sun), not {shown(days_raw)}")
    days: set[int] = set()
    for d in days_raw:
        if not isinstance(d, str) or d.strip().lower()[:3] not in DAYS:
            raise bad("days", f"{shown(d)} is not a day (mon, tue, wed, thu, fri, sat, sun)")
        days.add(DAYS.index(d.strip().lower()[:3]))
    bounds: list[time] = []
    for fld in ("start", "end"):
        value = raw.get(fld)
        m = _HHMM.match(value) if isinstance(value, str) else None
        if m is None:
            raise bad(fld, f"a time of day HH:MM (24 h), not {shown(value)}")
        bounds.append(time(int(m.group(1)), int(m.group(2))))
    zone = raw.get("timeZone", "UTC")
    try:
        if not isinstance(zone, str) or not zone:
            raise ValueError
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise bad("timeZone", f"an IANA time zone such as Europe/Berlin or UTC, not {shown(zone)}") from None
    if bounds[0] == bounds[1]:
        raise bad("end", "equals start: a window of no time (leave 'windows' out for a pool that is always open)")
    return Window(frozenset(days), bounds[0], bounds[1], zone)


# -- the fair order of requests ----------------------------------------------------------------------------

QUEUE_PREFIX = "nf-q-"
SLOT_PREFIX = "nf-slot-"
POOL_PREFIX = "nf-pool-"


def queue_name(pool: str, node: str, requested_ms: int, gpu_pods: int) -> str:
    """The name of a node's request in ``pool``. The API server lists a namespace's Leases in name order,
    so the name IS the place in line: nodes running no GPU pod (``0``) before the others (``1``), then the
    oldest request first (milliseconds since the epoch, 13 digits), the node's name breaking ties."""
    return f"{QUEUE_PREFIX}{pool}-{0 if gpu_pods == 0 else 1}-{requested_ms:013d}-{node}"[:253]


def slot_name(pool: str, index: int) -> str:
    return f"{SLOT_PREFIX}{pool}-{index:04d}"


def pool_lease_name(pool: str) -> str:
    return f"{POOL_PREFIX}{pool}"


@dataclass(frozen=True)
class SlotView:
    """One slot Lease as read: its holder ("" = free) and whether that holder's time has run out."""

    name: str
    holder: str
    renewed: datetime | None
    duration_s: int
    resource_version: str = ""
    transitions: int = 0
    reason: str = ""

    def live(self, now: datetime) -> bool:
        return bool(self.holder) and self.renewed is not None and now < self.renewed + timedelta(
            seconds=self.duration_s)


@dataclass(frozen=True)
class PoolState:
    """The pool Lease: the slots counted for the pool's size, and the brake."""

    size: int = 0
    slots: int = 0
    sized_at: datetime | None = None
    failures: int = 0
    failed: tuple[str, ...] = ()
    brake: bool = False
    brake_reason: str = ""
    rollout: str = ""
    resource_version: str = ""
    exists: bool = False


@dataclass
class Tally:
    """Per pool, what ``nodeagent fleet status`` shows."""

    pool: str
    nodes: int = 0
    slots: int = 0
    done: int = 0
    changing: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    brake: bool = False
    brake_reason: str = ""
    failures: int = 0
    max_failures: int = 0
    window: str = "always open"
