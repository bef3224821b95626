"""The flow every label-driven node switch shares: MIG (``mig/reconciler.py``), the workload config
(``vfio/``) and the confidential-computing mode (``ccmode/``).

A switch watches one label of the own Node; on every new value it

    checks the value (a bad one: state ``failed``, one Warning Event naming it, nothing touched)
    → reads what the node is now (already there: only the state labels are written)
    → waits for the pods and claims holding the GPUs to let them go (bounded; nothing changes meanwhile)
    → asks the disruption budget for leave
    → applies the change (a failed apply leaves the node as it was and says why)
    → writes the state labels and one Event.

The pieces here are used by the MIG reconciler too (the Node port, what holds a GPU, the retried label
and Event writes); ``SwitchReconciler`` is the whole loop for switches that act on all GPUs at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from nodeagent.backoff import Backoff
from nodeagent.deadline import within
from nodeagent.errors import NodeAgentError, OperationError

log = logging.getLogger(__name__)

# a label write or event the API refused is tried again after 0.2 s, 0.4 s, ... at most 5 s apart
KUBE_RETRY_START_S = 0.2
KUBE_RETRY_MAX_S = 5.0
FAILED = "failed"


class NodeViewLike(Protocol):
    @property
    def labels(self) -> Mapping[str, str]: ...

    @property
    def annotations(self) -> Mapping[str, str]: ...


class NodeApi(Protocol):
    """What a switch needs of ``nodeagent.kube.node.NodeClient``."""

    async def aget(self) -> Any: ...

    async def apatch_labels(self, changes: Mapping[str, str | None]) -> Any: ...

    async def acreate_event(
        self, reason: str, message: str, type: str = "Normal", action: str | None = None
    ) -> str: ...

    def updates(self, **kwargs: Any) -> AsyncIterator[Any]: ...


@dataclass(frozen=True, order=True)
class ClaimHolder:
    """A ResourceClaim (DRA) prepared on a GPU: ``namespace/name``, and the pods using it where known."""

    claim: str
    pods: tuple[str, ...] = ()

    def __str__(self) -> str:
        if not self.pods:
            return f"claim {self.claim}"
        return f"claim {self.claim} (pod{'s' if len(self.pods) > 1 else ''} {', '.join(self.pods)})"


# What holds a GPU: a pod (``namespace/name``) given one of its device-plugin devices, or a claim.
Holder = str | ClaimHolder


class GpuHolders(Protocol):
    """What holds devices of some GPUs: pods (the kubelet's PodResources API) and ResourceClaims prepared
    on them (the DRA plane's record)."""

    async def __call__(self, gpu_indices: frozenset[int]) -> Mapping[int, tuple[Holder, ...]]:
        """GPU index → every pod (``namespace/name``) holding one of its devices and every claim prepared
        on it (GPUs nothing holds are absent). Raises ``NodeAgentError`` when that cannot be known (the
        kubelet does not answer)."""
        ...


def describe_holders(held: Mapping[int, tuple[Holder, ...]]) -> str:
    """``GPU 0 is held by pods ml/a, ml/b; GPU 3 is held by pod x/y and claim ml/c (pod ml/p)`` (one line)."""
    parts = []
    for gpu in sorted(held):
        pods = [h for h in held[gpu] if isinstance(h, str)]
        what = [f"pod{'s' if len(pods) > 1 else ''} {', '.join(pods)}"] if pods else []
        what += [str(h) for h in sorted(h for h in held[gpu] if isinstance(h, ClaimHolder))]
        parts.append(f"GPU {gpu} is held by {' and '.join(what)}")
    return "; ".join(parts)


class DisruptionBudget(Protocol):
    """Leave to disrupt this node's GPUs (the fleet's budget decides; a node alone always gets it)."""

    async def acquire(self, action: str) -> None:
        """Return once the disruption ``action`` may start; raise ``OperationError`` (saying why) when it
        may not."""
        ...

    async def release(self, action: str) -> None:
        """The disruption ``action`` is over (called after ``acquire`` returned, whatever the outcome)."""
        ...


class AlwaysGrant:
    """The budget of a node on its own: every disruption is allowed at once."""

    async def acquire(self, action: str) -> None:
        return None

    async def release(self, action: str) -> None:
        return None


class NodeReporter:
    """Writes state labels and Events of the own Node, bounded and retried a few times; a write that keeps
    failing is logged, never raised (a switch always finishes)."""

    def __init__(self, node: NodeApi, prefix: str, kube_timeout_s: float = 30.0) -> None:
        self.node = node
        self.prefix = prefix  # "mig", "vfio", "cc": names the switch in the log
        self.kube_timeout_s = kube_timeout_s

    async def labels(self, changes: Mapping[str, str | None]) -> None:
        what = ", ".join(f"{k}={v}" for k, v in changes.items())
        await self._kube(lambda: self.node.apatch_labels(changes), f"set {what}")

    async def event(self, reason: str, message: str, type_: str) -> None:
        (log.info if type_ == "Normal" else log.warning)("%s: %s: %s", self.prefix, reason, message)
        await self._kube(lambda: self.node.acreate_event(reason, message, type_), f"record event {reason}",
                         attempts=2)

    async def _kube(self, call: Callable[[], Awaitable[Any]], what: str, attempts: int = 5) -> None:
        backoff = Backoff(KUBE_RETRY_START_S, KUBE_RETRY_MAX_S, jitter=False)
        for attempt in range(attempts):
            try:
                await within(call(), self.kube_timeout_s)
                return
            except (NodeAgentError, TimeoutError) as e:
                if attempt == attempts - 1:
                    log.error("%s: could not %s: %s", self.prefix, what, e)
                    return
                await asyncio.sleep(backoff.next())


async def wait_released(holders: GpuHolders | None, gpus: frozenset[int], *, timeout_s: float, poll_s: float,
                        what_waits: str, announce: Callable[[str], Awaitable[None]], subject: str,
                        running: Callable[[list[int]], str] | None = None) -> None:
    """Wait until nothing holds any of ``gpus`` (all at once), at most ``timeout_s``; ``announce`` gets one
    line naming the holders the first time some are seen. Raises ``OperationError`` naming them (and
    saying nothing was changed) when they keep the GPUs (with ``running``'s blocking description of the
    processes on the held GPUs); while pod use is unknown no GPU counts as free."""
    if holders is None or not gpus:
        return
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        try:
            held = {g: h for g, h in (await holders(gpus)).items() if h and g in gpus}
            unknown = ""
        except NodeAgentError as e:
            held, unknown = {}, str(e)
        if not held and not unknown:
            return
        what = describe_holders(held) if held else f"pod use unknown ({unknown})"
        if time.monotonic() >= deadline:
            procs = "" if running is None else await asyncio.to_thread(running, sorted(held) or sorted(gpus))
            raise OperationError(f"{what} after waiting {timeout_s:g}s for the GPU(s) to be released"
                                 + (f" (processes: {procs})" if procs else "") + "; nothing was changed",
                                 subject=subject)
        if not announced:
            announced = True
            await announce(f"{what_waits} waits up to {timeout_s:g}s: {what}"[:1000])
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


T = TypeVar("T")


class Switch(Protocol, Generic[T]):
    """One node-wide switch driven by a label (the blocking calls run in a worker thread)."""

    name: str  # short name for logs and Event reasons ("WorkloadConfig", "CcMode")
    desired_label: str
    state_label: str

    def parse(self, value: str) -> T:
        """The wanted setting; ``ConfigError`` naming the label and the allowed values otherwise."""
        ...

    def current(self) -> T | None:
        """What the node is now (None: mixed or unknown, so the switch applies)."""
        ...

    def gpus(self) -> frozenset[int]:
        """The GPUs the switch changes (what must be released first)."""
        ...

    def apply(self, wanted: T) -> str:
        """Bring the node to ``wanted``; returns one line saying what changed. On failure raise
        ``NodeAgentError`` saying why after putting the node back as it was."""
        ...

    def state_labels(self, applied: T | None) -> Mapping[str, str | None]:
        """The labels that report ``applied`` (None: the switch failed)."""
        ...


@dataclass(frozen=True)
class SwitchOptions:
    kube_timeout_s: float = 30.0
    apply_timeout_s: float = 600.0
    release_timeout_s: float = 300.0
    release_poll_s: float = 1.0


class SwitchReconciler(Generic[T]):
    """Follows ``switch.desired_label`` on the own Node; one reconcile at a time. A label that is absent is
    no request at all; an empty or unknown value is refused."""

    def __init__(self, node: NodeApi, switch: Switch[T], *, holders: GpuHolders | None = None,
                 budget: DisruptionBudget | None = None, options: SwitchOptions | None = None,
                 on_state: Callable[[str, str], None] | None = None,
                 after: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.node = node
        self.switch = switch
        self.holders = holders
        self.budget: DisruptionBudget = budget or AlwaysGrant()
        self.options = options or SwitchOptions()
        self.report = NodeReporter(node, switch.name, self.options.kube_timeout_s)
        self.on_state = on_state  # (label, value) of every state written, e.g. for doctor's record
        self.after = after  # awaited with the state after it is written (e.g. serve the node's new devices)
        self.last_value: str | None = None
        self.last_state: str | None = None
        self.last_error: str | None = None

    async def run(self) -> None:
        """Reconcile the current value, then every change, until cancelled."""
        updates = self.node.updates()
        try:
            async for view in updates:
                value = view.labels.get(self.switch.desired_label)
                if value is None or value == self.last_value:
                    continue
                await self.reconcile(value)
        finally:
            with contextlib.suppress(Exception):
                await updates.aclose()  # type: ignore[attr-defined]

    async def reconcile(self, value: str) -> str:
        """Bring the node to ``value``; returns the state written (the applied value, or ``failed``)."""
        self.last_value = value
        label = self.switch.desired_label
        try:
            wanted = self.switch.parse(value)
            now = await asyncio.to_thread(self.switch.current)
            if now == wanted:
                return await self._done(wanted, None)
            gpus = await asyncio.to_thread(self.switch.gpus)
            await wait_released(
                self.holders, gpus, timeout_s=self.options.release_timeout_s,
                poll_s=self.options.release_poll_s, what_waits=f"{label}={value}",
                announce=lambda line: self.report.event(f"{self.switch.name}WaitingForPods", line, "Normal"),
                subject=label)
            action = f"{label}={value}"
            await self.budget.acquire(action)
            try:
                message = await within(asyncio.to_thread(self.switch.apply, wanted), self.options.apply_timeout_s)
            finally:
                await self.budget.release(action)
        except TimeoutError:
            return await self._failed(value, f"took longer than {self.options.apply_timeout_s:g}s")
        except NodeAgentError as e:
            return await self._failed(value, str(e))
        except Exception as e:  # never leave the state behind, whatever broke
            log.exception("%s: unexpected error applying %s", self.switch.name, value)
            return await self._failed(value, f"internal error {e!r}")
        return await self._done(wanted, message)

    async def _done(self, applied: T, message: str | None) -> str:
        self.last_error = None
        state = str(self.switch.state_labels(applied).get(self.switch.state_label, ""))
        if message is not None:
            await self.report.event(f"{self.switch.name}Applied", message[:1000], "Normal")
        await self._labels(self.switch.state_labels(applied))
        return state

    async def _failed(self, value: str, why: str) -> str:
        self.last_error = why
        await self.report.event(f"{self.switch.name}Failed",
                                f"{self.switch.desired_label}={value!r} failed: {why}"[:1000], "Warning")
        await self._labels(self.switch.state_labels(None))
        return FAILED

    async def _labels(self, labels: Mapping[str, str | None]) -> None:
        state = labels.get(self.switch.state_label)
        self.last_state = state
        if self.on_state is not None and state is not None:
            try:
                self.on_state(self.switch.state_label, state)
            except Exception:
                log.exception("%s: state callback failed", self.switch.name)
        await self.report.labels(labels)
        if self.after is not None and state is not None:
            try:
                await self.after(state)
            except Exception:
                log.exception("%s: after %s", self.switch.name, state)
