"""The remediation state record: what runs on which GPU and which steps are done, plus the reset history
behind quarantine. Written atomically (``fileio``) before and after every step, so an agent killed in the
middle of a reset leaves its successor enough to finish the plan or roll it back.

One small JSON file, ``/var/lib/nodeagent/remediation.json`` under the host root.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent import fileio
from nodeagent.errors import ConfigError
from nodeagent.hostpaths import HostPaths
from nodeagent.remediation.planner import Plan, Step
from nodeagent.remediation.policy import Action

RECORD_VERSION = 1
MAX_RECORD_BYTES = 1 << 20


@dataclass(frozen=True)
class RunRecord:
    """One plan in flight."""

    plan: Plan
    done: tuple[Step, ...] = ()
    persistence: Mapping[str, bool] = field(default_factory=dict)  # UUID → persistence mode before the run
    started: float = 0.0  # wall clock


@dataclass
class RecordFile:
    runs: dict[str, RunRecord] = field(default_factory=dict)  # target UUID → its run
    resets: dict[str, list[float]] = field(default_factory=dict)  # UUID → wall-clock reset times
    quarantined: dict[str, str] = field(default_factory=dict)  # UUID → why


def record_path(paths: HostPaths) -> Path:
    return paths.state_dir / "remediation.json"


def _plan_json(p: Plan) -> dict[str, Any]:
    return {"action": p.action.value, "why": p.why, "gpus": list(p.gpus), "pods": list(p.pods),
            "steps": [s.value for s in p.steps]}


def _plan_of(d: Mapping[str, Any]) -> Plan:
    return Plan(Action(d["action"]), str(d["why"]), tuple(str(g) for g in d["gpus"]),
                tuple(str(p) for p in d["pods"]), tuple(Step(s) for s in d["steps"]))


def dumps(rec: RecordFile) -> str:
    doc = {
        "version": RECORD_VERSION,
        "runs": {u: {"plan": _plan_json(r.plan), "done": [s.value for s in r.done],
                     "persistence": dict(r.persistence), "started": r.started} for u, r in rec.runs.items()},
        "resets": rec.resets,
        "quarantined": rec.quarantined,
    }
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def loads(text: str, where: str) -> RecordFile:
    """The record in ``text``; ConfigError naming the file when it is not one."""
    try:
        doc = json.loads(text)
        if doc.get("version") != RECORD_VERSION:
            raise ValueError(f"unknown version {doc.get('version')!r}")
        runs = {str(u): RunRecord(_plan_of(r["plan"]), tuple(Step(s) for s in r["done"]),
                                  {str(k): bool(v) for k, v in dict(r.get("persistence") or {}).items()},
                                  float(r.get("started", 0.0)))
                for u, r in dict(doc.get("runs") or {}).items()}
        resets = {str(u): [float(t) for t in ts] for u, ts in dict(doc.get("resets") or {}).items()}
        quarantined = {str(u): str(w) for u, w in dict(doc.get("quarantined") or {}).items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{where}: not a remediation record: {e}", subject=where) from None
    return RecordFile(runs, resets, quarantined)


class RecordStore:
    """Reads and writes the record file atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> RecordFile:
        try:
            data = fileio.read_text(self.path, max_bytes=MAX_RECORD_BYTES)
        except ConfigError:
            logging.getLogger(__name__).warning("%s is unreadable; starting without a remediation record",
                                                self.path)
            return RecordFile()
        if data is None:
            return RecordFile()
        try:
            return loads(data, str(self.path))
        except ConfigError as e:
            logging.getLogger(__name__).warning("%s; starting without it", e)
            return RecordFile()

    def save(self, rec: RecordFile) -> None:
        fileio.atomic_write(self.path, dumps(rec), mode=0o600, backup=False, parents=True)


def step_done(rec: RecordFile, target: str, step: Step) -> None:
    run = rec.runs[target]
    rec.runs[target] = RunRecord(run.plan, (*run.done, step), run.persistence, run.started)


def held_out(rec: RecordFile) -> dict[str, str]:
    """The GPUs a previous agent took out of service (UUID → the reason its health monitors held them with):
    every GPU of a run past its withdrawal, and the quarantined ones. Its successor holds them out from its
    very first answer to the kubelet, before its remediation resumes the runs."""
    out = {u: f"remediation: quarantined: {why}" for u, why in rec.quarantined.items()}
    for run in pending_runs(rec):
        if Step.WITHDRAW in run.done:
            for u in run.plan.gpus:
                out.setdefault(u, f"remediation: {run.plan.why}")
    return out


def pending_runs(rec: RecordFile) -> Sequence[RunRecord]:
    return [rec.runs[u] for u in sorted(rec.runs)]
