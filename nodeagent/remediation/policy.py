"""What to do about a GPU fault: the driver's recovery action first, else NVIDIA's XID catalog, then the
operator's per-XID overrides; and when a GPU has been reset too often to be trusted (quarantine).

Pure: the catalog is data (``xid_catalog.json`` beside this module, its source named inside), the
decision a function of the fault, the catalog and the settings; the quarantine ledger takes its clock.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from nodeagent.config import REMEDIATION_ACTIONS
from nodeagent.errors import ConfigError


class Action(str, enum.Enum):
    """One remediation, mildest first."""

    NONE = "none"  # nothing beyond the health path (the GPU is marked unhealthy or not, as today)
    RESTART_APP = "restart-app"  # the GPU stays; the pods holding it are told (an event names them)
    RESET_GPU = "reset-gpu"  # withdraw, evict its pods, reset this GPU, check, offer again
    DRAIN_AND_RESET = "drain-and-reset"  # the same with NVML's drain state set before the reset
    REBOOT_NODE = "reboot-node"  # only a reboot helps: the GPU stays out, the node says so
    RECOVER_IMEX = "recover-imex-domain"  # the IMEX domain needs recovery: the node says so

    @property
    def resets(self) -> bool:
        return self in (Action.RESET_GPU, Action.DRAIN_AND_RESET)


assert {a.value for a in Action} == set(REMEDIATION_ACTIONS), "config.REMEDIATION_ACTIONS out of step"

# nvmlDeviceGpuRecoveryAction_t → action. DRAIN_P2P (3) has no step of its own here: the GPU is drained and
# reset, the stronger of the two; a bus reset (6) is a GPU reset; a system reboot (7) a node reboot.
RECOVERY_TO_ACTION: Mapping[int, Action] = {
    1: Action.RESET_GPU,
    2: Action.REBOOT_NODE,
    3: Action.DRAIN_AND_RESET,
    4: Action.DRAIN_AND_RESET,
    5: Action.RECOVER_IMEX,
    6: Action.RESET_GPU,
    7: Action.REBOOT_NODE,
}

FOLLOW_DRIVER = "follow-driver"  # the catalog's entry for XID 154: the recovery action field says it


@dataclass(frozen=True)
class CatalogEntry:
    xid: int
    mnemonic: str
    immediate: str  # the catalog's bucket, as NVIDIA names it
    action: Action | None  # None: follow the driver's recovery action
    # a stronger action when one of these XIDs was seen recently on the same GPU (XID 48 with 63/64)
    with_recent: Mapping[int, Action] = field(default_factory=dict)


@dataclass(frozen=True)
class XidCatalog:
    source: str
    entries: Mapping[int, CatalogEntry]

    def get(self, xid: int) -> CatalogEntry | None:
        return self.entries.get(xid)


def parse_catalog(doc: Mapping[str, Any], where: str = "xid_catalog.json") -> XidCatalog:
    """The catalog from its JSON form; ConfigError naming the entry for anything malformed."""
    def action(value: Any, key: str) -> Action | None:
        if value == FOLLOW_DRIVER:
            return None
        try:
            return Action(value)
        except ValueError:
            raise ConfigError(f"{where}: {key}: unknown action {value!r}", subject=key) from None

    source = doc.get("source")
    if not isinstance(source, str) or not source:
        raise ConfigError(f"{where}: the catalog must name its source", subject="source")
    entries: dict[int, CatalogEntry] = {}
    for raw_xid, e in dict(doc.get("xids") or {}).items():
        key = f"xids.{raw_xid}"
        if not str(raw_xid).isdigit() or not isinstance(e, Mapping):
            raise ConfigError(f"{where}: {key}: not an XID entry", subject=key)
        with_recent: dict[int, Action] = {}
        for other, a in dict(e.get("with") or {}).items():
            act = action(a, f"{key}.with.{other}")
            if act is None or not str(other).isdigit():
                raise ConfigError(f"{where}: {key}.with.{other}: must name an XID and an action", subject=key)
            with_recent[int(other)] = act
        entries[int(raw_xid)] = CatalogEntry(int(raw_xid), str(e.get("mnemonic", "")), str(e.get("immediate", "")),
                                             action(e.get("action"), f"{key}.action"), with_recent)
    return XidCatalog(source, entries)


def load_catalog() -> XidCatalog:
    """The catalog shipped with nodeagent."""
    text = resources.files(__package__).joinpath("xid_catalog.json").read_text(encoding="utf-8")
    return parse_catalog(json.loads(text))


@dataclass(frozen=True)
class Decision:
    action: Action
    why: str  # one line for events and logs: where the action came from


def decide(
    xid: int | None,
    recovery_action: int,
    catalog: XidCatalog,
    overrides: Mapping[int, Action] | None = None,
    recent_xids: Collection[int] = (),
) -> Decision:
    """The action for a fault. ``xid``: the XID that raised it (None: the recovery-action event alone);
    ``recovery_action``: the driver's field 230 now (0 = none or not reported); ``recent_xids``: other
    XIDs seen on the same GPU lately (XID 48 next to 63/64 asks for a drain first).

    Order: an operator's override for the XID wins; else a recovery action the driver reports; else the
    catalog's immediate action; an XID the catalog does not know gets no action beyond the health path."""
    if xid is not None and overrides and xid in overrides:
        return Decision(overrides[xid], f"XID {xid}: configured action {overrides[xid].value}")
    if recovery_action in RECOVERY_TO_ACTION:
        act = RECOVERY_TO_ACTION[recovery_action]
        return Decision(act, f"the driver reports recovery action {recovery_action} ({act.value})")
    if xid is None:
        return Decision(Action.NONE, "no XID and no recovery action")
    entry = catalog.get(xid)
    if entry is None:
        return Decision(Action.NONE, f"XID {xid} is not in NVIDIA's XID catalog")
    if entry.action is None:  # XID 154 without a recovery action (any more)
        return Decision(Action.NONE, f"XID {xid} ({entry.mnemonic}): the driver reports no recovery action")
    for other, act in sorted(entry.with_recent.items()):
        if other in recent_xids:
            return Decision(act, f"XID {xid} ({entry.mnemonic}) after XID {other}: {entry.immediate} → {act.value}")
    return Decision(entry.action, f"XID {xid} ({entry.mnemonic}): {entry.immediate} → {entry.action.value}")


def parse_overrides(raw: Mapping[str, str]) -> dict[int, Action]:
    """``remediation.xid_actions`` (already validated by the config) as XID → action."""
    return {int(k): Action(v) for k, v in raw.items()}


class QuarantineLedger:
    """Reset times per GPU UUID (wall-clock seconds, so a restarted agent can carry them over): a GPU reset
    ``max_resets`` times within ``window_s`` is quarantined instead of reset again."""

    def __init__(self, max_resets: int, window_s: float, history: Mapping[str, Iterable[float]] | None = None) -> None:
        self.max_resets = max_resets
        self.window_s = window_s
        self._resets: dict[str, list[float]] = {u: sorted(t) for u, t in (history or {}).items()}

    def _recent(self, uuid: str, now: float) -> list[float]:
        kept = [t for t in self._resets.get(uuid, []) if now - t < self.window_s]
        if kept:
            self._resets[uuid] = kept
        else:
            self._resets.pop(uuid, None)
        return kept

    def record(self, uuid: str, now: float) -> None:
        self._recent(uuid, now)
        self._resets.setdefault(uuid, []).append(now)

    def quarantined(self, uuid: str, now: float) -> bool:
        return self.max_resets > 0 and len(self._recent(uuid, now)) >= self.max_resets

    def count(self, uuid: str, now: float) -> int:
        return len(self._recent(uuid, now))

    def history(self) -> dict[str, list[float]]:
        return {u: list(t) for u, t in self._resets.items()}
