"""Runs a remediation plan for one GPU (or its reset group), every step bounded in time, an Event per step,
a Node condition while it runs, the state record written around each step.

Everything outside is reached through the ports below, so the pipeline runs the same on a real node, on
the simulator, and in unit tests. Any failed step leaves the GPU withdrawn and ends in the reboot-required
path: a condition and a Warning event, a cordon only when configured, a reboot only when configured.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from nodeagent.deadline import within
from nodeagent.errors import NodeAgentError, OperationError
from nodeagent.remediation.gate import AlwaysGrant, DisruptionGate
from nodeagent.remediation.planner import GpuFacts, Plan, Step, plan, resume_from
from nodeagent.remediation.policy import Action, QuarantineLedger, XidCatalog, decide
from nodeagent.remediation.record import RecordFile, RecordStore, RunRecord, step_done

log = logging.getLogger(__name__)

CONDITION_RUNNING = "nodeagent.io/GPURemediation"
CONDITION_REBOOT = "nodeagent.io/RebootRequired"
RECOVERY_NONE = 0

EvictResult = Literal["evicted", "blocked", "gone"]


# -- ports ----------------------------------------------------------------------------------------------

class GpuControl(Protocol):
    """The NVML side, by GPU UUID (blocking calls: the pipeline runs them in a thread)."""

    def process_count(self, uuid: str) -> int: ...

    def persistence_mode_of(self, uuid: str) -> bool | None: ...

    def set_persistence_mode_of(self, uuid: str, enabled: bool) -> None: ...

    def set_drain(self, uuid: str, draining: bool) -> None: ...

    def healthy(self, uuid: str) -> bool: ...

    def recovery_action_of(self, uuid: str) -> int: ...


class Resetter(Protocol):
    def reset(self, uuids: Sequence[str]) -> None:
        """Reset these GPUs together (one command); raises ``NodeAgentError`` saying why not."""
        ...


class Pods(Protocol):
    async def evict(self, pod: str, grace_s: float) -> EvictResult:
        """Ask the Eviction API to evict ``namespace/name``: "blocked" when a PodDisruptionBudget refuses
        for now (HTTP 429), "gone" when the pod no longer exists."""
        ...

    async def gone(self, pod: str) -> bool: ...


class NodeSide(Protocol):
    async def event(self, reason: str, message: str, warning: bool = False) -> None: ...

    async def condition(self, type: str, status: bool, reason: str, message: str) -> None: ...

    async def cordon(self, reason: str) -> None: ...


class ServiceHooks(Protocol):
    """What the rest of the agent does around a reset."""

    async def withdraw(self, uuid: str, reason: str) -> None:
        """Device plugin: Unhealthy; DRA: the device tainted (or unpublished)."""
        ...

    async def offer(self, uuid: str) -> None: ...

    async def stop_users(self, uuid: str) -> None:
        """Stop nodeagent's own clients of the GPU (its MPS control daemon)."""
        ...

    async def restore(self, uuid: str) -> None:
        """The GPU's MIG layout, CDI entries and nodeagent's own users, as before the reset."""
        ...


class NoServiceHooks:
    """Hooks for a node without device plugin, DRA, MIG or MPS (and for tests): nothing to do."""

    async def withdraw(self, uuid: str, reason: str) -> None:
        return None

    async def offer(self, uuid: str) -> None:
        return None

    async def stop_users(self, uuid: str) -> None:
        return None

    async def restore(self, uuid: str) -> None:
        return None


# -- settings, results ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineSettings:
    eviction_grace_s: float = 30.0
    eviction_timeout_s: float = 300.0
    step_timeout_s: float = 120.0
    max_resets: int = 3
    reset_window_s: float = 3600.0
    fabric_manager: bool = True
    cordon_on_failure: bool = False
    overrides: Mapping[int, Action] = field(default_factory=dict)
    poll_s: float = 0.2  # how often evictions and checks are retried within their deadline


@dataclass(frozen=True)
class Fault:
    uuid: str
    xid: int | None
    recovery_action: int = RECOVERY_NONE
    recent_xids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Outcome:
    plan: Plan
    result: Literal["done", "notified", "nothing", "quarantined", "reboot-required", "imex-recovery",
                    "failed", "busy", "rolled-back"]
    detail: str = ""
    seconds: float = 0.0


class StepFailed(OperationError):
    """A step could not complete; the message says which and why."""


class RemediationMetrics(Protocol):
    def step(self, step: str, result: str, seconds: float) -> None: ...

    def run(self, action: str, result: str, seconds: float) -> None: ...


class _NoMetrics:
    def step(self, step: str, result: str, seconds: float) -> None:
        return None

    def run(self, action: str, result: str, seconds: float) -> None:
        return None


# -- the pipeline -----------------------------------------------------------------------------------------

class Remediator:
    def __init__(
        self,
        settings: PipelineSettings,
        catalog: XidCatalog,
        gpu: GpuControl,
        resetter: Resetter,
        pods: Pods,
        node: NodeSide,
        hooks: ServiceHooks | None = None,
        *,
        store: RecordStore | None = None,
        gate: DisruptionGate | None = None,
        metrics: RemediationMetrics | None = None,
        reboot: Callable[[str], Awaitable[None]] | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.gpu = gpu
        self.resetter = resetter
        self.pods = pods
        self.node = node
        self.hooks: ServiceHooks = hooks or NoServiceHooks()
        self.store = store
        self.gate: DisruptionGate = gate or AlwaysGrant()
        self.metrics: RemediationMetrics = metrics or _NoMetrics()
        self.reboot = reboot  # None: never reboot the node (the default; configured by remediation.reboot_command)
        self._reset_at = 0.0
        self.wall_clock = wall_clock
        self.clock = clock
        self.record = store.load() if store is not None else RecordFile()
        self.ledger = QuarantineLedger(settings.max_resets, settings.reset_window_s, self.record.resets)
        self._busy: set[str] = set()
        self._xids: dict[str, float] = {}  # UUID → monotonic time of its last XID

    # ---- entry points ----
    def note_xid(self, uuid: str) -> None:
        """An XID arrived for the GPU (the verify step wants none after the reset)."""
        self._xids[uuid] = self.clock()

    def plan_for(self, fault: Fault, gpus: Mapping[str, GpuFacts], holders: Mapping[str, Sequence[str]]) -> Plan:
        decision = decide(fault.xid, fault.recovery_action, self.catalog, self.settings.overrides,
                          fault.recent_xids)
        quarantined = decision.action.resets and (
            fault.uuid in self.record.quarantined or self.ledger.quarantined(fault.uuid, self.wall_clock()))
        return plan(decision, gpus[fault.uuid], gpus, holders, fabric_manager=self.settings.fabric_manager,
                    quarantined=quarantined)

    async def handle(self, fault: Fault, gpus: Mapping[str, GpuFacts],
                     holders: Mapping[str, Sequence[str]]) -> Outcome:
        """Decide, plan and run the remediation of one fault."""
        if fault.xid is not None:
            self.note_xid(fault.uuid)
        p = self.plan_for(fault, gpus, holders)
        if any(u in self._busy for u in p.gpus):
            return Outcome(p, "busy", "a remediation of this GPU is already running")
        return await self.run(p)

    async def resume(self) -> list[Outcome]:
        """Runs a previous agent left unfinished: finished when the GPU still needs them, rolled back
        (GPU restored and offered) when the reset never happened and the GPU no longer needs one."""
        out = []
        for run in list(self.record.runs.values()):
            p = run.plan
            before_reset = Step.RESET in p.steps and Step.RESET not in run.done
            if before_reset and await self._needs_nothing(p.target):
                out.append(await self._rollback(run))
            else:
                if Step.WITHDRAW in run.done:
                    # the planes held it out from their start (the record, ``record.held_out``); withdrawn
                    # again here so that the DRA devices get the remediation taint as well
                    await self._withdraw(p)
                out.append(await self.run(p, done=run.done, persistence=run.persistence))
        return out

    async def clear_reboot_required(self, uuids: Sequence[str]) -> bool:
        """At an agent's start: the reboot-required condition an earlier run left (the node was rebooted, or
        an operator brought the GPU back) is set False when nothing needs it any more: no GPU quarantined,
        no run to finish, and every one of ``uuids`` (the GPUs found now) answers with recovery action none.
        True when it was cleared."""
        if self.record.quarantined or self.record.runs or not uuids:
            return False
        for u in uuids:
            if not await self._needs_nothing(u):
                return False
        await self.node.condition(CONDITION_REBOOT, False, "NotRequired",
                                  f"all {len(uuids)} GPUs answer and need no recovery")
        return True

    # ---- running ----
    async def run(self, p: Plan, *, done: Sequence[Step] = (),
                  persistence: Mapping[str, bool] | None = None) -> Outcome:
        start = self.clock()
        self._busy.update(p.gpus)
        try:
            result, detail = await self._run(p, done, dict(persistence or {}))
        finally:
            self._busy.difference_update(p.gpus)
        seconds = self.clock() - start
        self.metrics.run(p.action.value, result, seconds)
        return Outcome(p, result, detail, seconds)

    async def _run(self, p: Plan, done: Sequence[Step], persistence: dict[str, bool]) -> tuple[Any, str]:
        if not p.steps:
            return "nothing", p.why
        if p.steps == (Step.NOTIFY,):
            await self._step(p, Step.NOTIFY, self._notify(p))
            return "notified", p.why
        if p.steps == (Step.IMEX_RECOVERY,):
            await self.node.condition(CONDITION_REBOOT, False, "IMEXDomainRecoveryRequired",
                                      f"GPU {p.target}: the IMEX domain needs recovery ({p.why})")
            await self.node.event("IMEXDomainRecoveryRequired", f"GPU {p.target}: {p.why}", warning=True)
            return "imex-recovery", p.why
        gpus = ", ".join(p.gpus)
        reason = f"{p.action.value} of GPU {gpus}: {p.why}"
        async with self.gate.slot(reason):
            self._begin(p, done, persistence)
            await self.node.condition(CONDITION_RUNNING, True, "InProgress", reason)
            await self.node.event("GPURemediationStarted", reason, warning=True)
            try:
                for step in resume_from(p.steps, done):
                    if step is Step.QUARANTINE:
                        await self._quarantine(p)
                        return "quarantined", p.why
                    if step is Step.REBOOT_REQUIRED:
                        await self._reboot_required(p, p.why)
                        return "reboot-required", p.why
                    await self._step(p, step, self._action(p, step))
            except StepFailed as e:
                await self._reboot_required(p, str(e))
                return "failed", str(e)
            finally:
                await self.node.condition(CONDITION_RUNNING, False, "Idle", f"last: {reason}")
            self._finish(p)
            await self.node.event("GPURemediated", f"GPU {gpus} is back in service after {p.action.value}")
            return "done", p.why

    async def _step(self, p: Plan, step: Step, work: Awaitable[None]) -> None:
        start = self.clock()
        timeout = self.settings.eviction_timeout_s if step is Step.EVICT else self.settings.step_timeout_s
        try:
            await within(work, timeout)
        except TimeoutError:
            self.metrics.step(step.value, "timeout", self.clock() - start)
            await self.node.event("GPURemediationStepFailed", f"GPU {p.target}: step {step.value} did not "
                                  f"finish within {timeout:g}s", warning=True)
            raise StepFailed(f"step {step.value} did not finish within {timeout:g}s", subject=p.target) from None
        except NodeAgentError as e:
            self.metrics.step(step.value, "error", self.clock() - start)
            await self.node.event("GPURemediationStepFailed", f"GPU {p.target}: step {step.value}: {e}",
                                  warning=True)
            raise StepFailed(f"step {step.value}: {e}", subject=p.target) from e
        seconds = self.clock() - start
        self.metrics.step(step.value, "ok", seconds)
        if p.target in self.record.runs:
            step_done(self.record, p.target, step)
            self._save()
        if step is not Step.NOTIFY:  # the notice is its own event
            await self.node.event("GPURemediationStep",
                                  f"GPU {', '.join(p.gpus)}: {step.value} done in {seconds:.1f}s")

    def _action(self, p: Plan, step: Step) -> Awaitable[None]:
        return {
            Step.WITHDRAW: self._withdraw,
            Step.EVICT: self._evict,
            Step.STOP_USERS: self._stop_users,
            Step.PERSISTENCE_OFF: self._persistence_off,
            Step.DRAIN: self._drain,
            Step.RESET: self._reset,
            Step.VERIFY: self._verify,
            Step.RESTORE: self._restore,
            Step.OFFER: self._offer,
        }[step](p)

    # ---- the steps ----
    async def _notify(self, p: Plan) -> None:
        pods = ", ".join(p.pods) or "none"
        await self.node.event("GPUApplicationRestartAdvised",
                              f"GPU {p.target}: {p.why}; the GPU stays in service, its pods should restart "
                              f"their work: {pods}", warning=True)

    async def _withdraw(self, p: Plan) -> None:
        for u in p.gpus:
            await self.hooks.withdraw(u, p.why)

    async def _evict(self, p: Plan) -> None:
        pending = list(p.pods)
        while pending:
            still = []
            for pod in pending:
                r = await self.pods.evict(pod, self.settings.eviction_grace_s)
                if r == "blocked":
                    still.append(pod)
            pending = still
            if pending:
                await asyncio.sleep(self.settings.poll_s)  # a PodDisruptionBudget: ask again until the deadline
        waiting = list(p.pods)
        while waiting:  # the eviction deletes with a grace period: wait until the pods are gone
            waiting = [pod for pod in waiting if not await self.pods.gone(pod)]
            if waiting:
                await asyncio.sleep(self.settings.poll_s)

    async def _stop_users(self, p: Plan) -> None:
        for u in p.gpus:
            await self.hooks.stop_users(u)
        while True:  # containers stop asynchronously after their pods are deleted
            busy = [u for u in p.gpus if await asyncio.to_thread(self.gpu.process_count, u) > 0]
            if not busy:
                return
            await asyncio.sleep(self.settings.poll_s)

    async def _persistence_off(self, p: Plan) -> None:
        run = self.record.runs.get(p.target)
        for u in p.gpus:
            mode = await asyncio.to_thread(self.gpu.persistence_mode_of, u)
            if run is not None and u not in run.persistence and mode is not None:
                self.record.runs[p.target] = run = RunRecord(run.plan, run.done, {**run.persistence, u: mode},
                                                             run.started)
                self._save()
            if mode:
                await asyncio.to_thread(self.gpu.set_persistence_mode_of, u, False)

    async def _drain(self, p: Plan) -> None:
        for u in p.gpus:
            await asyncio.to_thread(self.gpu.set_drain, u, True)

    async def _reset(self, p: Plan) -> None:
        self._reset_at = self.clock()
        await asyncio.to_thread(self.resetter.reset, p.gpus)
        now = self.wall_clock()
        for u in p.gpus:
            self.ledger.record(u, now)
        self.record.resets = self.ledger.history()
        self._save()

    async def _verify(self, p: Plan) -> None:
        reset_at = self._reset_at
        for u in p.gpus:
            if not await asyncio.to_thread(self.gpu.healthy, u):
                raise StepFailed(f"GPU {u} is not healthy after the reset", subject=u)
            action = await asyncio.to_thread(self.gpu.recovery_action_of, u)
            if action != RECOVERY_NONE:
                raise StepFailed(f"GPU {u} still reports recovery action {action} after the reset", subject=u)
            if self._xids.get(u, -1.0) > reset_at:
                raise StepFailed(f"GPU {u} raised an XID again after the reset", subject=u)

    async def _restore(self, p: Plan) -> None:
        run = self.record.runs.get(p.target)
        before = run.persistence if run is not None else {}
        for u in p.gpus:
            if Step.DRAIN in p.steps:
                await asyncio.to_thread(self.gpu.set_drain, u, False)
            if before.get(u):
                await asyncio.to_thread(self.gpu.set_persistence_mode_of, u, True)
            await self.hooks.restore(u)

    async def _offer(self, p: Plan) -> None:
        for u in p.gpus:
            await self.hooks.offer(u)

    # ---- endings ----
    async def _quarantine(self, p: Plan) -> None:
        why = (f"reset {self.ledger.count(p.target, self.wall_clock())} times within "
               f"{self.settings.reset_window_s:g}s")
        self.record.quarantined[p.target] = why
        self._finish(p)
        await self._stays_out(p, f"quarantined: {why}")
        await self.node.condition(CONDITION_REBOOT, True, "GPUQuarantined", f"GPU {p.target} is quarantined: {why}")
        await self.node.event("GPUQuarantined", f"GPU {p.target} stays out of service: {why} ({p.why})",
                              warning=True)

    async def _stays_out(self, p: Plan, why: str) -> None:
        """Hooks that know of GPUs kept out for good (``MonitorHooks.stays_out``) are told."""
        mark = getattr(self.hooks, "stays_out", None)
        if mark is None:
            return
        for u in p.gpus:
            try:
                await mark(u, why)
            except NodeAgentError as e:  # the condition and event below still tell the operator
                log.warning("GPU %s: not marked as staying out: %s", u, e)

    async def _reboot_required(self, p: Plan, why: str) -> None:
        self._finish(p)
        await self._stays_out(p, why)
        await self.node.condition(CONDITION_REBOOT, True, "GPURecoveryFailed" if p.action.resets
                                  else "NodeRebootRequired", f"GPU {', '.join(p.gpus)} stays out: {why}")
        await self.node.event("NodeRebootRequired", f"GPU {', '.join(p.gpus)} stays out of service until the "
                              f"node is rebooted: {why}", warning=True)
        if self.settings.cordon_on_failure:
            await self.node.cordon(f"GPU {p.target}: {why}")
        if self.reboot is not None:
            await self.node.event("NodeRebooting", f"rebooting the node for GPU {p.target}: {why}", warning=True)
            await self.reboot(f"GPU {p.target}: {why}")

    async def _needs_nothing(self, uuid: str) -> bool:
        try:
            healthy = await asyncio.to_thread(self.gpu.healthy, uuid)
            action = await asyncio.to_thread(self.gpu.recovery_action_of, uuid)
        except NodeAgentError:
            return False
        return healthy and action == RECOVERY_NONE

    async def _rollback(self, run: RunRecord) -> Outcome:
        p = run.plan
        start = self.clock()
        try:
            for u in p.gpus:
                if Step.DRAIN in run.done:
                    await asyncio.to_thread(self.gpu.set_drain, u, False)
                if run.persistence.get(u) and Step.PERSISTENCE_OFF in run.done:
                    await asyncio.to_thread(self.gpu.set_persistence_mode_of, u, True)
                if Step.STOP_USERS in run.done:
                    await self.hooks.restore(u)
                await self.hooks.offer(u)
        except NodeAgentError as e:
            return Outcome(p, "failed", f"rollback failed: {e}", self.clock() - start)
        self._finish(p)
        await self.node.condition(CONDITION_RUNNING, False, "RolledBack", f"GPU {p.target}: no reset needed any more")
        await self.node.event("GPURemediationRolledBack", f"GPU {p.target}: the previous agent stopped before the "
                              "reset and the GPU needs none any more; it is back in service")
        return Outcome(p, "rolled-back", "", self.clock() - start)

    # ---- the record ----
    def _begin(self, p: Plan, done: Sequence[Step], persistence: Mapping[str, bool]) -> None:
        self.record.runs[p.target] = RunRecord(p, tuple(done), dict(persistence), self.wall_clock())
        self._save()

    def _finish(self, p: Plan) -> None:
        self.record.runs.pop(p.target, None)
        self._save()

    def _save(self) -> None:
        if self.store is not None:
            self.store.save(self.record)
