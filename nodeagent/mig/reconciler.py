"""Label-driven MIG reconfiguration for the daemon.

The own Node's ``nvidia.com/mig.config`` names the wanted config. On start and on every change of that
value (or of the annotation ``nodeagent.io/mig.config.generation``, which re-applies the same value):

    nvidia.com/mig.config.state=pending
    → the device-plugin resources of the GPUs that change are withdrawn (the plugin process stays; the
      other GPUs' devices stay listed and keep serving their pods)
    → the withdrawn GPUs that the kubelet's PodResources shows no pod holding and no ResourceClaim (DRA)
      is prepared on are applied (apply.py) at once and re-advertised in their new layout; each of the
      others is applied as soon as it is let go, waiting at most ``release_timeout_s`` in all (no drain
      of the node; the held ones stay withdrawn meanwhile)
    → state=success once every GPU is done, or state=failed with the reason in a Warning Event.

Restoring the GPUs of an interrupted apply (below) waits for their pods the same way, for all of its
GPUs at once. A GPU still held by a pod or a claim when the wait ends is never touched (GPU instances
that dynamic-MIG claims created included): the state is ``failed``, the Warning Event names the pods and
claims holding it and the GPUs changed meanwhile, and its devices are advertised again as they were.

Every path ends in ``success`` or ``failed`` within bounded waits — except a mode change that needs a
host reboot, which ends in ``rebooting``. With ``with_reboot`` the agent then reboots the host; after the
boot the persisted selection is applied again and ends ``success``/``failed``. An unknown config name or
an empty label value ends ``failed`` with a Warning Event naming the value, and nothing touched (a label
that is absent is no request at all: nothing happens).

An agent killed mid-apply leaves an in-flight record in ``<state_dir>/mig-state.json``. Before anything
else (at start, and again before every reconcile while the record exists) the GPUs it names are brought
back to their checkpoint exactly — or left alone when they already are exactly in the new layout — so
every GPU holds its old or its new layout; then the selected config is applied as usual (normally
ending ``success`` with the new layout). When that restore fails the state ends ``failed`` and the
record stays for the next attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nodeagent.deadline import within
from nodeagent.errors import ConfigError, NodeAgentError, OperationError, RebootRequired
from nodeagent.fileio import Root, read_text
from nodeagent.gpu.inventory import Inventory
from nodeagent.gpu.ports import MigAdministration
from nodeagent.labelswitch import (
    ClaimHolder as ClaimHolder,
)
from nodeagent.labelswitch import (
    GpuHolders,
    NodeApi,
    NodeReporter,
    NodeViewLike,
    describe_holders,
    wait_released,
)
from nodeagent.labelswitch import (
    Holder as Holder,
)
from nodeagent.mig.apply import MigStateFile, Recovery, describe_process
from nodeagent.mig.pipeline import MigPipeline, MigSources, load_sources
from nodeagent.mig.planner import GpuPlan, Plan
from nodeagent.mig.spec import name_list

log = logging.getLogger(__name__)

CONFIG_LABEL = "nvidia.com/mig.config"
STATE_LABEL = "nvidia.com/mig.config.state"
GENERATION_ANNOTATION = "nodeagent.io/mig.config.generation"
PENDING, REBOOTING, SUCCESS, FAILED = "pending", "rebooting", "success", "failed"


class ResourcePublisher(Protocol):
    """What the reconciler needs of the device-plugin service."""

    async def withdraw(self, gpu_indices: set[int]) -> None:
        """Stop advertising these GPUs' devices, whatever inventories ``update`` brings meanwhile."""
        ...

    async def readvertise(self, gpu_indices: set[int]) -> None:
        """Advertise these withdrawn GPUs' devices again, as the last inventory gives them."""
        ...

    async def update(self, inventory: Inventory) -> None: ...


class DisruptionGate(Protocol):
    """A disruption budget the change waits in (``nodeagent.fleet.gate.FleetGate``): the block runs while
    this node holds a slot; an exception leaving it counts as a failed change of ``rollout``."""

    def slot(self, reason: str, *, rollout: str = "",
             gpu_pods: int = 0) -> contextlib.AbstractAsyncContextManager[str | None]: ...


@dataclass(frozen=True)
class MigReconcilerOptions:
    # The MIG config and hooks files as loaded by ``mig.pipeline`` (the daemon loads them at start and on
    # SIGHUP, so an edit takes effect with a reload and a broken edit is rejected there). None = read
    # ``config_file`` (None: the generated standard configs) and ``hooks_file`` at each apply.
    sources: MigSources | None = None
    config_file: Path | None = None
    hooks_file: Path | None = None
    with_reboot: bool = False
    apply_timeout_s: float = 600.0  # upper bound for one apply (NVML + hooks)
    kube_timeout_s: float = 30.0  # upper bound for one Kubernetes call
    publish_timeout_s: float = 30.0  # upper bound for withdraw / re-advertise
    # upper bound for the pods holding a GPU that must change to let it go (``mig.release_timeout``)
    release_timeout_s: float = 300.0
    release_poll_s: float = 1.0  # how often PodResources is asked during that wait


def _key(view: NodeViewLike) -> tuple[str, str] | None:
    """(config name, generation) to act on; None when the label is absent. An EMPTY value is a key too:
    it is refused (state ``failed`` with an Event), not silently ignored."""
    value = view.labels.get(CONFIG_LABEL)
    if value is None:
        return None
    return value, view.annotations.get(GENERATION_ANNOTATION, "")


class MigReconciler:
    """Watches the own Node and applies the selected MIG config; one reconcile at a time."""

    def __init__(
        self,
        node: NodeApi,
        adapter: MigAdministration,
        state_dir: Path,
        *,
        publisher: ResourcePublisher | None = None,
        options: MigReconcilerOptions | None = None,
        reboot: Callable[[], None] | None = None,
        boot_id: Callable[[], str] | None = None,
        proc_root: Path = Path("/proc"),
        on_inventory: Callable[[Inventory], Awaitable[None]] | None = None,
        on_result: Callable[[str, float], None] | None = None,
        pod_name: Callable[[str], str | None] | None = None,
        holders: GpuHolders | None = None,
        on_state: Callable[[str], None] | None = None,
        root: Root | None = None,
        gate: DisruptionGate | None = None,
        changing: Callable[[], AbstractContextManager[None]] | None = None,
    ) -> None:
        self.node = node
        # held around each change of the GPUs and its publication (the daemon's Shared.gpu_changes): a
        # rediscovery that overlapped one is not published after it
        self.changing = changing or contextlib.nullcontext
        self.gate = gate  # a change that empties GPUs first takes a slot of the fleet's budget
        self.adapter = adapter
        self.root = root  # host paths (the state file, /proc) are resolved inside it at each use
        self.state = MigStateFile(state_dir, root)
        self.publisher = publisher
        self.options = options or MigReconcilerOptions()
        self.reboot = reboot
        self.boot_id = boot_id or (lambda: "")
        self.proc_root = proc_root
        self.on_inventory = on_inventory
        self.on_result = on_result  # (state written, seconds taken) after each reconcile, e.g. for metrics
        # pod UID → "namespace/name" for busy-GPU refusals (blocking; called in a worker thread)
        self.pod_name = pod_name
        # the pods and claims holding withdrawn GPUs (None: nothing known to wait for; the NVML busy check
        # remains)
        self.holders = holders
        self.on_state = on_state  # every state label value, before it is written (e.g. Node conditions)
        self.report = NodeReporter(node, "mig", self.options.kube_timeout_s)
        self.last_key: tuple[str, str] | None = None
        self.last_state: str | None = None
        self.last_plan: Plan | None = None

    # -- loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Reconcile the current value, then every change; runs until cancelled. While a reconcile runs,
        ``updates`` keeps only the newest version of the Node: that is the one acted on next."""
        if self.state.inflight():
            # Whatever the label says (it may even be gone), no GPU stays half-changed.
            try:
                await self._recover()
            except Exception as e:  # the first reconcile tries again and reports it on the Node
                log.error("mig: recovery of an interrupted apply failed: %s", e)
        updates = self.node.updates()
        try:
            async for view in updates:
                key = _key(view)
                if key is None or key == self.last_key:
                    continue
                await self.reconcile(view)
        finally:
            with contextlib.suppress(Exception):
                await updates.aclose()  # type: ignore[attr-defined]

    # -- one reconcile ------------------------------------------------------------------------

    async def reconcile(self, view: NodeViewLike) -> str | None:
        """Handle one version of the Node; returns the state label written (None: nothing to do)."""
        started = time.monotonic()
        result = await self._reconcile(view)
        if result is not None and self.on_result is not None:
            try:
                self.on_result(result, time.monotonic() - started)
            except Exception:
                log.exception("mig: result callback failed")
        return result

    async def _reconcile(self, view: NodeViewLike) -> str | None:
        key = _key(view)
        if key is None:
            return None
        self.last_key = key
        name, generation = key
        persisted = self.state.load() or {}
        resuming = persisted.get("config") == name and persisted.get("phase") == REBOOTING
        if resuming and persisted.get("boot_id") == self.boot_id() and self.boot_id():
            # Still the boot in which the reboot was asked for: wait for it, do not loop.
            log.info("mig: config %s waits for a host reboot", name)
            await self._set_state(REBOOTING)
            if self.options.with_reboot and self.reboot is not None:
                await asyncio.to_thread(self.reboot)
            return REBOOTING
        await self._set_state(PENDING)
        self.state.update(config=name, generation=generation, phase="applying", boot_id=self.boot_id())
        try:
            recovery = await self._recover()
            result, message = await self._apply(name, after_reboot=resuming)
            if recovery is not None:
                message = f"{message} (after an interrupted apply: {recovery.describe()})"[:1000]
        except RebootRequired as e:
            self.state.update(phase=REBOOTING, boot_id=self.boot_id(), error=str(e))
            if resuming:
                msg = f"MIG config {name} still needs a reboot after the host rebooted: {e}"
                self.state.update(phase=FAILED)
                await self._event("MigConfigFailed", msg, "Warning")
                await self._set_state(FAILED)
                return FAILED
            await self._event("MigConfigRebootRequired", f"MIG config {name}: {e}", "Warning")
            await self._set_state(REBOOTING)
            if self.options.with_reboot and self.reboot is not None:
                log.warning("mig: rebooting the host to finish MIG config %s", name)
                await asyncio.to_thread(self.reboot)
            return REBOOTING
        except NodeAgentError as e:
            self.state.update(phase=FAILED, error=str(e))
            await self._event("MigConfigFailed", f"MIG config {name!r} failed: {e}", "Warning")
            await self._set_state(FAILED)
            return FAILED
        except Exception as e:  # never leave the node in pending, whatever broke
            log.exception("mig: unexpected error applying %s", name)
            self.state.update(phase=FAILED, error=repr(e))
            await self._event("MigConfigFailed", f"MIG config {name!r} failed: internal error {e!r}",
                              "Warning")
            await self._set_state(FAILED)
            return FAILED
        self.state.update(phase=SUCCESS, error=None)
        await self._event("MigConfigApplied", message, "Normal")
        await self._set_state(SUCCESS)
        return result

    async def _recover(self) -> Recovery | None:
        """Bring GPUs an interrupted apply left half-changed back to a whole layout (None: nothing to do)."""
        records = self.state.inflight()
        if not records:
            return None
        gpus = {r.checkpoint.index for r in records}
        if self.publisher is not None:
            await within(self.publisher.withdraw(gpus), self.options.publish_timeout_s)
        try:
            # a pod given one of these GPUs' devices since (e.g. after a restart) keeps it untouched
            await self._wait_released("restoring the GPUs of an interrupted MIG apply", frozenset(gpus))
            with self.changing():
                recovery = await within(
                    asyncio.to_thread(self._pipeline(MigSources()).recover), self.options.apply_timeout_s)
        except TimeoutError as e:  # deadline.within raises the builtin one on every version
            raise OperationError("restoring the GPUs of an interrupted MIG apply took longer than "
                                 f"{self.options.apply_timeout_s:.0f}s") from e
        finally:
            with contextlib.suppress(Exception), self.changing():
                await self._publish(await asyncio.to_thread(self.adapter.discover), gpus)
        if recovery is not None:
            await self._event("MigApplyRecovered", recovery.describe()[:1000], "Warning")
        return recovery

    def _sources(self) -> MigSources:
        if self.options.sources is not None:
            return self.options.sources
        return load_sources(self.options.config_file, self.options.hooks_file,
                            config_key="mig.config_file", hooks_key="mig.hooks_file")

    def _pipeline(self, sources: MigSources) -> MigPipeline:
        return MigPipeline(self.adapter, sources, state=self.state, proc_root=self.proc_root,
                           pod_name=self.pod_name)

    async def _apply(self, name: str, *, after_reboot: bool) -> tuple[str, str]:
        sources = self._sources()
        pipeline = self._pipeline(sources)
        inventory = await asyncio.to_thread(self.adapter.discover)
        if not name:
            known = name_list(sources.configs_for(inventory).names)
            raise ConfigError(f"label {CONFIG_LABEL} has the empty value '': set it to the name of a MIG "
                              f"config (known: {known})", subject=CONFIG_LABEL)
        _, the_plan = pipeline.plan(name, inventory)  # unknown name, bad layout: ConfigError, nothing touched
        self.last_plan = the_plan
        if the_plan.applied:
            return SUCCESS, f"MIG config {name} is applied (no GPU needed a change)"
        touched = {g.index for g in the_plan.touched}
        if self.gate is None:
            return await self._change(name, pipeline, inventory, the_plan, touched)
        held, _ = await self._holders_now(frozenset(touched))
        pods = {h for hs in held.values() for h in hs}
        async with self.gate.slot(f"MIG config {name} changes GPU(s) {', '.join(map(str, sorted(touched)))}",
                                  rollout=f"{CONFIG_LABEL}={name}", gpu_pods=len(pods)):
            return await self._change(name, pipeline, inventory, the_plan, touched)

    async def _change(self, name: str, pipeline: MigPipeline, inventory: Inventory, the_plan: Plan,
                      touched: set[int]) -> tuple[str, str]:
        if self.publisher is not None:
            await within(self.publisher.withdraw(touched), self.options.publish_timeout_s)
        current: Inventory | None = None  # the GPUs as the last stage's apply re-read them
        changed: list[GpuPlan] = []
        try:
            outcome = functools.partial(_outcome, changed, touched)
            async with contextlib.aclosing(self._released(f"MIG config {name}", frozenset(touched),
                                                          outcome)) as stages:
                async for free in stages:
                    stage = Plan(the_plan.config, tuple(g for g in the_plan.gpus if g.index in free),
                                 the_plan.skipped)
                    with self.changing():
                        result = await within(asyncio.to_thread(
                            pipeline.apply, stage, inventory if current is None else current),
                                              self.options.apply_timeout_s)
                        current = result.inventory  # discovered and verified by the apply itself
                        changed += stage.touched
                        if len(changed) < len(touched):
                            # the GPUs done serve in their new layout while the held ones wait (still withdrawn)
                            self.state.update(phase="applying")
                            await self._publish(current, free)
        except TimeoutError as e:
            raise OperationError(f"applying MIG config {name} took longer than "
                                 f"{self.options.apply_timeout_s:.0f}s") from e
        finally:
            # Re-advertise whatever the GPUs are now: the new layout as the apply saw it (no second
            # discovery on the way to the first Allocate), or after a failure the restored old one.
            with contextlib.suppress(Exception), self.changing():
                if current is None or len(changed) < len(touched):
                    current = await asyncio.to_thread(self.adapter.discover)
                await self._publish(current, touched)
        done = ", ".join(g.describe() for g in changed)
        return SUCCESS, f"MIG config {name} applied: {done}"[:1000]

    async def _holders_now(self, gpus: frozenset[int]) -> tuple[dict[int, tuple[Holder, ...]], str]:
        """(GPU → what holds it, for the held ones among ``gpus``; why pod use is unknown, or "")."""
        if self.holders is None:
            return {}, ""
        try:
            return {g: pods for g, pods in (await self.holders(gpus)).items() if pods and g in gpus}, ""
        except NodeAgentError as e:
            return {}, str(e)

    async def _released(self, what_waits: str, gpus: frozenset[int],
                        outcome: Callable[[], str]) -> AsyncGenerator[frozenset[int], None]:
        """The GPUs of ``gpus`` (already withdrawn) as nothing holds them any more: those free at once
        first, then each as its holders let it go, after at most ``release_timeout_s`` of waiting (the time
        the caller spends changing the GPUs yielded is not counted); then raise ``OperationError`` naming
        the holders and ``outcome()`` (what was changed meanwhile). The holders are named in one
        ``MigWaitingForPods`` Event before anything is yielded. While pod use is unknown (the kubelet does
        not answer) no GPU counts as free."""
        deadline = time.monotonic() + self.options.release_timeout_s
        announced = False
        waiting = gpus
        while waiting:
            held, unknown = await self._holders_now(waiting)
            free = frozenset() if unknown else waiting - frozenset(held)
            what = _describe_holders(held) if held else f"pod use unknown ({unknown})"
            if (held or unknown) and not announced:  # named before the free GPUs are changed
                announced = True
                await self._event("MigWaitingForPods",
                                  f"{what_waits} waits up to {self.options.release_timeout_s:g}s: {what}"[:1000],
                                  "Normal")
            if free:
                waiting = waiting - free
                changing = time.monotonic()
                yield free
                deadline += time.monotonic() - changing  # changing the free GPUs is no time spent waiting
                continue
            if time.monotonic() >= deadline:
                running = await asyncio.to_thread(self._running, sorted(held) or sorted(waiting))
                raise OperationError(
                    f"{what} after waiting {self.options.release_timeout_s:g}s for the GPU(s) to be released"
                    + (f" (processes: {running})" if running else "") + f"; {outcome()}",
                    subject=CONFIG_LABEL)
            await asyncio.sleep(min(self.options.release_poll_s, max(0.0, deadline - time.monotonic())))

    async def _wait_released(self, what_waits: str, gpus: frozenset[int]) -> None:
        """Wait until nothing holds a device of any of ``gpus`` (all of them at once: restoring an
        interrupted apply puts its GPUs back together), at most ``release_timeout_s``."""
        await wait_released(self.holders, gpus, timeout_s=self.options.release_timeout_s,
                            poll_s=self.options.release_poll_s, what_waits=what_waits,
                            announce=lambda line: self._event("MigWaitingForPods", line, "Normal"),
                            subject=CONFIG_LABEL, running=self._running)

    def _running(self, gpus: list[int]) -> str:
        """``GPU 1: pid 42 (python train.py) in pod ml/a (uid …) | GPU 3: …``: the processes NVML shows on
        these GPUs ("" for none). Blocking (/proc and the pod-name lookup)."""
        out = []
        for index in gpus:
            try:
                procs = self.adapter.processes(index)
            except NodeAgentError:
                continue
            if procs:
                out.append(f"GPU {index}: "
                           + "; ".join(describe_process(p, self.proc_root, self.pod_name, self.root) for p in procs))
        return " | ".join(out)

    async def _publish(self, inventory: Inventory, withdrawn: set[int] | frozenset[int]) -> None:
        """Advertise ``inventory`` and list the ``withdrawn`` GPUs (changed, or given up on) again."""
        if self.publisher is not None:
            await within(self.publisher.update(inventory), self.options.publish_timeout_s)
            await within(self.publisher.readvertise(set(withdrawn)), self.options.publish_timeout_s)
        if self.on_inventory is not None:
            await within(self.on_inventory(inventory), self.options.publish_timeout_s)

    # -- kube helpers (bounded, retried a few times) -------------------------------------------

    async def _set_state(self, state: str) -> None:
        self.last_state = state
        if self.on_state is not None:
            try:
                self.on_state(state)
            except Exception:
                log.exception("mig: state callback failed")
        await self.report.labels({STATE_LABEL: state})

    async def _event(self, reason: str, message: str, type_: str) -> None:
        await self.report.event(reason, message, type_)


_describe_holders = describe_holders  # the name the MIG code and its tests know


def _outcome(changed: list[GpuPlan], touched: set[int]) -> str:
    """What a label-driven apply that gave up waiting had changed: ``nothing was changed``, or for the GPUs
    that were free and changed meanwhile ``GPU(s) 1, 2 were changed, GPU(s) 0 were not``."""
    if not changed:
        return "nothing was changed"
    done = sorted(g.index for g in changed)
    left = sorted(touched - set(done))
    return f"GPU(s) {', '.join(map(str, done))} were changed, GPU(s) {', '.join(map(str, left))} were not"


def read_boot_id(proc_root: Path, root: Root | None = None) -> str:
    """The kernel's boot id (changes at every boot), or "" when unreadable."""
    text = read_text(proc_root / "sys/kernel/random/boot_id", root=root)
    return text.strip() if text else ""

