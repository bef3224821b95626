"""What ``nodeagent fleet status`` shows: per pool, nodes done, changing, waiting and failed, and the brake.

Read from the API server only (no agent is asked): the pool's Nodes (by its selector, first matching pool
wins as for the agents), their ``nvidia.com/mig.config.state`` label (``success`` = done, ``failed`` = failed,
with the message of their ``GpuChangeSlot`` condition as the reason), the live slot Leases (changing) and
the requests in line (waiting).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from nodeagent.errors import OperationError
from nodeagent.fleet.budget import QUEUE_PREFIX, FleetBudget, PoolState, Tally, windows_open
from nodeagent.fleet.leases import FleetApi

STATE_LABEL = "nvidia.com/mig.config.state"
CONDITION = "GpuChangeSlot"


def _reason(node: dict[str, Any]) -> str:
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == CONDITION:
            return str(c.get("message", ""))
    return ""


def tally(api: FleetApi, budget: FleetBudget, now: datetime | None = None) -> list[Tally]:
    now = now or datetime.now(timezone.utc)
    out: list[Tally] = []
    for pool in budget.pools:
        t = Tally(pool.name, max_failures=pool.max_failures)
        nodes = [n for n in api.nodes(pool.selector.text)
                 if budget.pool_for((n.get("metadata") or {}).get("labels") or {}) is pool]
        t.nodes = len(nodes)
        t.slots = pool.max_unavailable.slots(t.nodes)
        state, slots = api.pool(pool.name)
        t.changing = sorted(s.holder for s in slots if s.live(now))
        prefix = f"{QUEUE_PREFIX}{pool.name}-"
        t.waiting = [q[len(prefix):].split("-", 2)[2] for q in api.queue(pool.name) if q.startswith(prefix)]
        for n in nodes:
            meta = n.get("metadata") or {}
            state_value = (meta.get("labels") or {}).get(STATE_LABEL)
            if state_value == "success" and meta.get("name") not in t.changing:
                t.done += 1
            elif state_value == "failed":
                t.failed[str(meta.get("name"))] = _reason(n)
        t.brake, t.brake_reason, t.failures = state.brake, state.brake_reason, state.failures
        if pool.windows:
            t.window = ("open" if windows_open(pool.windows, now) else "closed") + ": " + "; ".join(
                w.describe() for w in pool.windows)
        out.append(t)
    return out


def render(tallies: list[Tally]) -> str:
    rows = [("POOL", "NODES", "SLOTS", "DONE", "CHANGING", "WAITING", "FAILED", "BRAKE", "WINDOW")]
    for t in tallies:
        brake = f"on ({t.failures}>{t.max_failures})" if t.brake else f"off ({t.failures}/{t.max_failures})"
        rows.append((t.pool, str(t.nodes), str(t.slots), str(t.done), str(len(t.changing)), str(len(t.waiting)),
                     str(len(t.failed)), brake, t.window))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    for t in tallies:
        if t.brake:
            lines.append(f"pool {t.pool}: brake on: {t.brake_reason}")
        for node, why in sorted(t.failed.items()):
            lines.append(f"pool {t.pool}: {node} failed: {why or '(no reason recorded)'}")
    return "\n".join(lines)


def clear_brake(api: FleetApi, pool: str, now: datetime | None = None) -> PoolState:
    """The operator's act: brake off, the failure count back to zero (the failed nodes stay failed)."""
    now = now or datetime.now(timezone.utc)
    for _ in range(10):
        state = api.get_pool(pool)
        if not state.exists:
            return state
        new = replace(state, brake=False, brake_reason="", failures=0, failed=())
        if api.put_pool(pool, new, now, sized=False):
            return new
    raise OperationError(f"pool {pool}: the pool Lease kept changing; try again", subject=pool)
