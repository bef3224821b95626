"""Apply a MIG plan through the NVML adapter: checkpoint, busy check, mode, instances, verify, rollback.

Order for the GPUs a plan touches (the others are never called):

1. checkpoint each touched GPU's exact layout (mode, pending mode, every instance's profile and start)
   and persist it, with the layout the plan aims at, as the *in-flight record* of a small state file
   before the first change; the record is removed when the run ends (done, rolled back, or waiting for
   a reboot), so a record found later means an agent died mid-apply;
2. refuse when a GPU whose instances or mode must change runs processes — naming pid, command and pod;
3. ``pre-apply-mode`` hook, then per GPU: destroy its instances, set the mode; a pending mode (Ampere)
   is made effective by resetting THAT GPU only; when no reset is possible → ``RebootRequired``;
4. ``pre-apply-config`` hook, then destroy and create instances at the planned placement starts;
5. re-read the GPUs and check that they match the plan;
6. on any failure, restore every touched GPU to its checkpoint (same mode, same profiles at the same
   starts) and report the failure together with the restore result.

Hooks ``apply-start`` / ``apply-exit`` wrap the whole run (``apply-exit`` always runs).

Crash recovery (``recover_interrupted``, run before planning): every GPU named by a leftover in-flight
record is brought back to its checkpoint exactly — orphan GPU instances without a compute instance and
instances not in the checkpoint destroyed, checkpointed ones recreated at their starts, the mode set
back — unless it already is exactly at the layout the interrupted run aimed at. Each GPU therefore ends
in its old or its new layout, never a mix; the caller then applies the selected config again. A new
``apply`` that finds a leftover record (a caller that skipped recovery) keeps the recorded checkpoints
as its rollback targets, so a failure still returns to the last layout known to be whole.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.errors import (
    GpuBusyError,
    NodeAgentError,
    NvmlError,
    NvmlPermissionError,
    OperationError,
    RebootRequired,
    ResetRequiredError,
)
from nodeagent.fileio import Root, UnreadableFileError, atomic_write, read_bytes, read_text
from nodeagent.gpu.inventory import Gpu, GpuProcess, Inventory
from nodeagent.gpu.ports import MigAdministration
from nodeagent.mig.hooks import HookRunner
from nodeagent.mig.planner import GpuPlan, Plan

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# Checkpoints and the persisted progress


@dataclass(frozen=True)
class GpuCheckpoint:
    index: int
    uuid: str
    mig_current: bool
    mig_pending: bool
    instances: tuple[tuple[str, int], ...]  # (profile, placement start), sorted

    @classmethod
    def of(cls, gpu: Gpu) -> GpuCheckpoint:
        return cls(gpu.index, gpu.uuid, gpu.mig_current, gpu.mig_pending, layout_of(gpu))

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "mig_current": self.mig_current,
                "mig_pending": self.mig_pending, "instances": [list(i) for i in self.instances]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GpuCheckpoint:
        return cls(int(d["index"]), str(d["uuid"]), bool(d["mig_current"]), bool(d["mig_pending"]),
                   tuple(sorted((str(p), int(s)) for p, s in d["instances"])))

    @classmethod
    def target(cls, g: GpuPlan) -> GpuCheckpoint:
        """The layout ``g`` aims at: its mode (current and pending), kept plus created instances."""
        on = g.desired.enabled
        inst = sorted([(d.profile, d.placement_start) for d in g.keep] + [(s.profile, s.start) for s in g.create])
        return cls(g.index, g.uuid, on, on, tuple(inst) if on else ())

    def matches(self, gpu: Gpu) -> bool:
        """``gpu`` is exactly this layout: same mode and pending mode, same instances, no orphan GPU instance."""
        return GpuCheckpoint.of(gpu) == self and not (gpu.mig_current and gpu.bare_gpu_instances)

    def describe(self) -> str:
        return f"MIG {'on' if self.mig_current else 'off'} {_fmt(list(self.instances))}"


@dataclass(frozen=True)
class InFlight:
    """One GPU of an interrupted (or running) apply: where it came from and where it was going."""

    checkpoint: GpuCheckpoint
    target: GpuCheckpoint | None

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint.to_dict(),
                "target": self.target.to_dict() if self.target is not None else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> InFlight:
        t = d.get("target")
        return cls(GpuCheckpoint.from_dict(d["checkpoint"]), GpuCheckpoint.from_dict(t) if t else None)


def layout_of(gpu: Gpu) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((d.profile, d.placement_start) for d in gpu.mig_devices))


class MigStateFile:
    """``<state_dir>/mig-state.json``: selected config, phase and checkpoints, written atomically.

    Phases: ``applying`` (a run is in progress — after a crash the reconciler applies the same
    config again), ``rebooting`` (a mode change waits for a reboot), ``success``, ``failed``.
    ``inflight`` (``{"config", "gpus": [{"checkpoint", "target"}]}`` or null) is present exactly while
    GPUs may be half-changed; see ``recover_interrupted``.
    """

    NAME = "mig-state.json"

    def __init__(self, state_dir: Path, root: Root | None = None) -> None:
        self.path = state_dir / self.NAME
        self.root = root  # the path (and /proc, for the busy GPUs' processes) resolved inside it at each use

    def load(self) -> dict[str, Any] | None:
        try:
            text = read_text(self.path, root=self.root)
            if text is None:
                return None
            doc = json.loads(text)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnreadableFileError, RecursionError) as e:
            log.warning("ignoring unreadable MIG state file %s: %s", self.path, e)
            return None
        return doc if isinstance(doc, dict) else None

    def save(self, doc: Mapping[str, Any]) -> None:
        atomic_write(self.path, json.dumps(dict(doc), indent=1, sort_keys=True) + "\n", mode=0o600, backup=False,
                     root=self.root, parents=True)

    def update(self, **changes: Any) -> None:
        doc = self.load() or {}
        doc.update(changes)
        doc["updated"] = time.time()
        self.save(doc)

    def inflight(self) -> list[InFlight]:
        """The in-flight record: GPUs an apply was changing when it last wrote (empty: none)."""
        doc = self.load() or {}
        raw = doc.get("inflight")
        if not raw:
            return []
        try:
            return [InFlight.from_dict(x) for x in raw["gpus"]]
        except (KeyError, TypeError, ValueError) as e:
            log.warning("ignoring a malformed in-flight record in %s: %s", self.path, e)
            return []


# --------------------------------------------------------------------------------------------------
# Who is using a GPU

_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


def pod_uid_from_cgroup(text: str) -> str | None:
    """The pod UID in a ``/proc/<pid>/cgroup`` text (systemd ``…pod<uid_with_underscores>.slice`` or
    cgroupfs ``/kubepods/…/pod<uid>/…``)."""
    m = _POD_UID.search(text)
    return m.group(1).replace("_", "-") if m else None


def describe_process(proc: GpuProcess, proc_root: Path, pod_name: Callable[[str], str | None] | None = None,
                     root: Root | None = None) -> str:
    """``pid 42 (python train.py) in pod default/train-0`` from /proc under the host root."""
    base = proc_root / str(proc.pid)
    command = proc.name
    try:
        raw = read_bytes(base / "cmdline", root=root) or b""
        argv = [a for a in raw.decode(errors="replace").split("\0") if a]
        if argv:
            command = " ".join(argv)
    except (OSError, UnreadableFileError):
        pass
    where = ""
    try:
        uid = pod_uid_from_cgroup(read_text(base / "cgroup", root=root) or "")
    except (OSError, UnreadableFileError):
        uid = None
    if uid:
        name = pod_name(uid) if pod_name else None
        where = f" in pod {name} (uid {uid})" if name else f" in pod uid {uid}"
    return f"pid {proc.pid} ({command}){where}"


# --------------------------------------------------------------------------------------------------
# Apply


@dataclass
class ApplyResult:
    inventory: Inventory
    touched: tuple[int, ...]
    resets: tuple[int, ...]


class Applier:
    """Applies one plan; construct per run."""

    def __init__(
        self,
        adapter: MigAdministration,
        *,
        hooks: HookRunner | None = None,
        state: MigStateFile | None = None,
        proc_root: Path = Path("/proc"),
        pod_name: Callable[[str], str | None] | None = None,
        on_step: Callable[[str], None] | None = None,
    ) -> None:
        self.adapter = adapter
        self.hooks = hooks
        self.state = state
        self.proc_root = proc_root
        self.pod_name = pod_name
        self.on_step = on_step
        self.resets: list[int] = []

    def _step(self, what: str) -> None:
        log.info("mig: %s", what)
        if self.on_step:
            self.on_step(what)

    def check_busy(self, plan: Plan) -> None:
        """Raise ``GpuBusyError`` naming the processes on GPUs whose mode or instances must go."""
        busy: list[str] = []
        for g in plan.touched:
            if g.mode is None and not g.destroy:
                continue  # only new instances: running work is not disturbed
            procs = self.adapter.processes(g.index)
            if procs:
                names = "; ".join(describe_process(p, self.proc_root, self.pod_name,
                                                    self.state.root if self.state else None) for p in procs)
                busy.append(f"GPU {g.index}: {names}")
        if busy:
            raise GpuBusyError(
                "refusing to change MIG layout, processes are using GPUs that must change: " + " | ".join(busy),
                subject=",".join(str(g.index) for g in plan.touched),
            )

    def apply(self, plan: Plan, inventory: Inventory) -> ApplyResult:
        """Apply ``plan`` (made from ``inventory``); returns the re-read inventory."""
        touched = plan.touched
        if not touched:
            return ApplyResult(inventory, (), ())
        restricted = self.adapter.restricted_facts
        if restricted:
            raise NvmlPermissionError(
                "changing MIG needs root: NVML refused to show this user " + "; ".join(restricted),
            )
        self.check_busy(plan)
        # A leftover in-flight record (an earlier run died and nobody recovered): its checkpoints are the
        # last layouts known to be whole, so they stay the rollback targets of the GPUs it names.
        leftover = {r.checkpoint.index: r for r in (self.state.inflight() if self.state else [])
                    if r.checkpoint.uuid == _uuid(inventory, r.checkpoint.index)}
        records = [InFlight(leftover[g.index].checkpoint if g.index in leftover
                            else GpuCheckpoint.of(inventory.gpu(g.index)), GpuCheckpoint.target(g))
                   for g in touched]
        planned = {g.index for g in touched}
        records += [r for i, r in sorted(leftover.items()) if i not in planned]
        checkpoints = [r.checkpoint for r in records]
        if self.state:
            self.state.update(config=plan.config, phase="applying", touched=[g.index for g in touched],
                              checkpoint=[c.to_dict() for c in checkpoints], started=time.time(),
                              inflight={"config": plan.config, "gpus": [r.to_dict() for r in records]})
        if self.hooks:
            self.hooks.run("apply-start")
        try:
            try:
                self._apply_modes(touched)
                self._apply_instances(touched)
                new = self.adapter.discover()
                self._verify(touched, new)
            except RebootRequired:
                if self.state:  # the half-done change is meant to wait for the reboot: nothing to recover
                    self.state.update(phase="rebooting", inflight=None)
                raise
            except NodeAgentError as e:
                self._rollback_and_raise(e, checkpoints)
            except Exception as e:  # an adapter bug must not leave GPUs half-changed either
                self._rollback_and_raise(OperationError(f"unexpected error: {e!r}"), checkpoints)
        finally:
            if self.hooks:
                try:
                    self.hooks.run("apply-exit")
                except NodeAgentError as e:
                    log.error("apply-exit hook failed: %s", e)
        if self.state:
            # GPUs named only by a leftover record stay recorded unless they are whole again.
            rest = [r for r in records[len(touched):]
                    if not r.checkpoint.matches(new.gpu(r.checkpoint.index))
                    and not (r.target is not None and r.target.matches(new.gpu(r.checkpoint.index)))]
            self.state.update(phase="success", step="done",
                              inflight={"config": plan.config, "gpus": [r.to_dict() for r in rest]} if rest else None)
        return ApplyResult(new, tuple(g.index for g in touched), tuple(self.resets))

    # -- steps ---------------------------------------------------------------------------------

    def _set_mode(self, index: int, enabled: bool) -> None:
        word = "on" if enabled else "off"
        self._step(f"GPU {index}: MIG mode {word}")
        try:
            pending = self.adapter.set_mig_mode(index, enabled)
        except ResetRequiredError as e:
            raise RebootRequired(f"GPU {index}: MIG mode {word} needs a reboot to take effect",
                                 subject=str(index)) from e
        if pending:
            # The new mode waits for a reset of this GPU (and only this one).
            self._step(f"GPU {index}: reset to activate MIG mode {word}")
            try:
                self.adapter.reset_gpu(index)
            except ResetRequiredError as e:
                raise RebootRequired(f"GPU {index}: MIG mode {word} is pending until the host reboots",
                                     subject=str(index)) from e
            self.resets.append(index)

    def _apply_modes(self, touched: tuple[GpuPlan, ...]) -> None:
        changing = [g for g in touched if g.mode is not None]
        if not changing:
            return
        if self.hooks:
            self.hooks.run("pre-apply-mode")
        for g in changing:
            for d in g.destroy:  # a GPU leaving MIG mode must be empty first
                self._step(f"GPU {g.index}: destroy {d.profile}@{d.placement_start} (GI {d.gi_id})")
                self.adapter.destroy_mig_device(g.index, d.gi_id)
            assert g.mode is not None
            self._set_mode(g.index, g.mode)

    def _apply_instances(self, touched: tuple[GpuPlan, ...]) -> None:
        work = [g for g in touched if (g.destroy and g.mode is None) or g.create]
        if not work:
            return
        if self.hooks:
            self.hooks.run("pre-apply-config")
        for g in work:
            if g.mode is None:
                for d in g.destroy:
                    self._step(f"GPU {g.index}: destroy {d.profile}@{d.placement_start} (GI {d.gi_id})")
                    self.adapter.destroy_mig_device(g.index, d.gi_id)
        for g in work:
            for s in g.create:
                self._step(f"GPU {g.index}: create {s.profile}@{s.start}")
                self.adapter.create_mig_device(g.index, s.profile, s.start)

    def _verify(self, touched: tuple[GpuPlan, ...], inv: Inventory) -> None:
        for g in touched:
            gpu = inv.gpu(g.index)
            want_on = g.desired.enabled
            if gpu.mig_current != want_on:
                raise OperationError(f"GPU {g.index}: MIG mode is still {'on' if gpu.mig_current else 'off'} "
                                     "after the change", subject=str(g.index))
            want = sorted([(d.profile, d.placement_start) for d in g.keep] + [(s.profile, s.start) for s in g.create])
            have = list(layout_of(gpu))
            if want_on and have != want:
                raise OperationError(f"GPU {g.index}: layout after apply is {_fmt(have)}, expected {_fmt(want)}",
                                     subject=str(g.index))
            if want_on and gpu.bare_gpu_instances:
                orphans = _fmt([(d.profile, d.placement_start) for d in gpu.bare_gpu_instances])
                raise OperationError(f"GPU {g.index}: GPU instances without a compute instance remain after "
                                     f"apply: {orphans}", subject=str(g.index))

    # -- rollback ------------------------------------------------------------------------------

    def _rollback_and_raise(self, error: NodeAgentError, checkpoints: list[GpuCheckpoint]) -> None:
        log.error("mig: apply failed (%s); restoring %d GPU(s)", error, len(checkpoints))
        problems: list[str] = []
        for cp in checkpoints:
            try:
                self.restore(cp)
            except Exception as e:
                problems.append(f"GPU {cp.index}: {e}")
        gpus = ", ".join(str(c.index) for c in checkpoints)
        if problems:
            if self.state:
                self.state.update(phase="failed", error=str(error), restore_failed=problems)
            raise OperationError(
                f"{error}; restoring the previous layout FAILED ({'; '.join(problems)}) — check GPU(s) {gpus}",
                subject=error.subject,
            ) from error
        if self.state:
            self.state.update(phase="failed", error=str(error), inflight=None)
        cls = type(error) if isinstance(error, OperationError) else OperationError
        try:
            new_error: NodeAgentError = cls(f"{error}; GPU(s) {gpus} restored to their previous layout",
                                            subject=error.subject)
        except TypeError:
            new_error = OperationError(f"{error}; GPU(s) {gpus} restored to their previous layout",
                                       subject=error.subject)
        if isinstance(error, NvmlError) and isinstance(new_error, NvmlError):
            new_error.code = error.code
        raise new_error from error

    def restore(self, cp: GpuCheckpoint) -> None:
        """Bring one GPU back to ``cp``: same mode and pending mode, same profiles at the same starts,
        and no GPU instance without a compute instance."""
        gpu = self.adapter.discover().gpu(cp.index)
        if gpu.uuid != cp.uuid:
            raise OperationError(f"GPU {cp.index} is {gpu.uuid}, the checkpoint was taken of {cp.uuid}",
                                 subject=str(cp.index))
        want = set(cp.instances) if cp.mig_current else set()
        if gpu.mig_current:
            for d in gpu.bare_gpu_instances:
                self._step(f"GPU {cp.index}: destroy orphan GPU instance {d.profile}@{d.placement_start} "
                           f"(GI {d.gi_id})")
                self.adapter.destroy_mig_device(cp.index, d.gi_id)
            for d in gpu.mig_devices:
                if (d.profile, d.placement_start) not in want:
                    self._step(f"GPU {cp.index}: destroy {d.profile}@{d.placement_start} (GI {d.gi_id})")
                    self.adapter.destroy_mig_device(cp.index, d.gi_id)
        if gpu.mig_current != cp.mig_current:
            if self.adapter.set_mig_mode(cp.index, cp.mig_current):
                self.adapter.reset_gpu(cp.index)
            gpu = self.adapter.discover().gpu(cp.index)
        if gpu.mig_pending != cp.mig_pending:
            self.adapter.set_mig_mode(cp.index, cp.mig_pending)  # only the pending value differs: no reset
        gpu = self.adapter.discover().gpu(cp.index)
        if cp.mig_current:
            have = set(layout_of(gpu))
            for prof, start in sorted(want - have, key=lambda x: x[1]):
                self._step(f"GPU {cp.index}: recreate {prof}@{start}")
                self.adapter.create_mig_device(cp.index, prof, start)
        gpu = self.adapter.discover().gpu(cp.index)
        if not cp.matches(gpu):
            got = GpuCheckpoint.of(gpu)
            raise OperationError(f"GPU {cp.index} is {_fmt(list(got.instances))} (mode {got.mig_current}), "
                                 f"checkpoint was {_fmt(list(cp.instances))} (mode {cp.mig_current})")


# --------------------------------------------------------------------------------------------------
# Recovery after an agent died mid-apply


@dataclass(frozen=True)
class Recovery:
    """What ``recover_interrupted`` did with each GPU of the in-flight record."""

    config: str
    restored: tuple[int, ...] = ()  # brought back to their checkpoint
    at_target: tuple[int, ...] = ()  # already exactly in the new layout: left as they are
    intact: tuple[int, ...] = ()  # still in their checkpoint layout: nothing to do
    ignored: tuple[int, ...] = ()  # the record does not belong to this GPU (another board, gone)

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(sorted(self.restored + self.at_target + self.intact))

    def describe(self) -> str:
        parts = []
        if self.restored:
            parts.append("restored GPU " + ", ".join(map(str, self.restored)) + " to the previous layout")
        if self.at_target:
            parts.append("GPU " + ", ".join(map(str, self.at_target)) + " already complete in the new layout")
        if self.intact:
            parts.append("GPU " + ", ".join(map(str, self.intact)) + " not changed yet")
        if self.ignored:
            parts.append("ignored the record of GPU " + ", ".join(map(str, self.ignored)) + " (different GPU)")
        what = "; ".join(parts) or "nothing to do"
        return f"recovered from an interrupted apply of MIG config {self.config or '?'}: {what}"


def recover_interrupted(
    adapter: MigAdministration, state: MigStateFile, *, on_step: Callable[[str], None] | None = None
) -> Recovery | None:
    """Undo what an agent that died mid-apply left behind (see the module doc); None when no apply was
    interrupted. Raises ``OperationError`` naming the GPUs that could not be restored; the in-flight record
    then stays, so the next attempt tries again."""
    records = state.inflight()
    if not records:
        return None
    doc = state.load() or {}
    config = str((doc.get("inflight") or {}).get("config") or doc.get("config") or "")
    inventory = adapter.discover()
    restorer = Applier(adapter, on_step=on_step)
    restored: list[int] = []
    at_target: list[int] = []
    intact: list[int] = []
    ignored: list[int] = []
    problems: list[str] = []
    for r in records:
        cp = r.checkpoint
        uuid = _uuid(inventory, cp.index)
        if uuid != cp.uuid:
            log.warning("mig: in-flight record of GPU %d names %s but the GPU is %s; ignoring it",
                        cp.index, cp.uuid, uuid or "gone")
            ignored.append(cp.index)
            continue
        gpu = inventory.gpu(cp.index)
        if cp.matches(gpu):
            intact.append(cp.index)
        elif r.target is not None and r.target.matches(gpu):
            at_target.append(cp.index)
        else:
            log.warning("mig: GPU %d was left half-changed by an interrupted apply; restoring %s",
                        cp.index, cp.describe())
            try:
                restorer.restore(cp)
            except Exception as e:
                problems.append(f"GPU {cp.index}: {e}")
            else:
                restored.append(cp.index)
    if problems:
        msg = ("restoring the layout an interrupted MIG apply left half-changed FAILED: " + "; ".join(problems))
        state.update(phase="failed", error=msg, restore_failed=problems)
        raise OperationError(msg, subject=",".join(str(r.checkpoint.index) for r in records))
    state.update(inflight=None)
    return Recovery(config, tuple(restored), tuple(at_target), tuple(intact), tuple(ignored))


def _uuid(inventory: Inventory, index: int) -> str | None:
    try:
        return inventory.gpu(index).uuid
    except KeyError:
        return None


def _fmt(layout: list[tuple[str, int]]) -> str:
    return "[" + ", ".join(f"{p}@{s}" for p, s in layout) + "]" if layout else "[]"
