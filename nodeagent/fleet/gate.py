"""``FleetGate``: a disruptive action on this node waits for a slot of its pool's disruption budget.

    async with gate.slot("MIG config all-1g.10gb", rollout="mig.config=all-1g.10gb", gpu_pods=2):
        ...  # the GPU is emptied and changed here

No controller: every agent runs the same loop against the API server (``leases.FleetApi``):

1. its request enters the line (a queue Lease whose name orders it: nodes without GPU pods first, then the
   oldest request);
2. every ``poll_s`` (jittered) it reads its pool's Leases (one list from the server's cache): brake on,
   window closed, a blocking pod on the node, or every slot live → it waits and says why (a node held back
   by its own pods steps out of the line meanwhile, and comes back under its first request's name);
3. with n slots free, the first n requests in line (one list with ``limit=n``) each try to take a free slot
   (a create, or a replace carrying the resourceVersion read: the API server arbitrates, a loser retries);
4. while the action runs the holder renews its slot every third of ``leaseDurationSeconds``; a slot whose
   holder died is free once that time has passed since its last renewal;
5. leaving the block releases the slot. Leaving it with an exception counts a failure of the rollout on the
   pool Lease; more than ``maxFailures`` failures turn the brake on: no node takes a slot of the pool until
   an operator clears it (``nodeagent fleet clear-brake POOL``).

A node waiting says so through ``Reporter`` (the MIG flow: the state label stays ``pending``; a Node
condition ``GpuChangeSlot`` with the reason; one Event when it starts waiting). A node in no pool, or with
no budget configured, is never held back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Protocol

from nodeagent.errors import NodeAgentError, RebootRequired
from nodeagent.fleet.budget import (
    FleetBudget,
    Pool,
    PoolState,
    Selector,
    SlotView,
    next_opening,
    parse_budget,
    queue_name,
    slot_name,
    windows_open,
)
from nodeagent.fleet.leases import FleetApi

log = logging.getLogger(__name__)

# The pods running on this node, each as ("namespace/name", its labels): for a pool's ``blockingPods``.
NodePods = Callable[[], Awaitable[Sequence[tuple[str, Mapping[str, str]]]]]

SIZE_TTL_S = 300.0  # the pool's node count is counted again when older than this


class Reporter(Protocol):
    """How a waiting node says so (the daemon: a Node condition and Events)."""

    async def waiting(self, reason: str, first: bool) -> None:
        """The node waits for a slot because of ``reason`` (``first``: the first time for this request)."""
        ...

    async def holding(self, slot: str) -> None: ...

    async def released(self, failed: str | None) -> None:
        """The slot was given back (``failed``: why the change failed, None when it worked)."""
        ...


@dataclass(frozen=True)
class GateOptions:
    poll_s: float = 2.0  # how often a waiting node looks at its pool (jittered by +-50%)
    head_extra: int = 0  # read this many more requests than free slots (the place in line shown)


class _Quiet:
    async def waiting(self, reason: str, first: bool) -> None:
        log.info("fleet: waiting for a slot: %s", reason)

    async def holding(self, slot: str) -> None:
        log.info("fleet: holding slot %s", slot)

    async def released(self, failed: str | None) -> None:
        return None


class FleetGate:
    """The disruption budget of one node. ``budget`` None: read from the ConfigMap at each request.
    ``node_pods``: the node's running pods as its container runtime lists them (the daemon's way: no API
    privilege); None asks the API server for the node's pods (a token that may list pods)."""

    def __init__(self, api: FleetApi, node: str, labels: Callable[[], Awaitable[Mapping[str, str]]], *,
                 budget: FleetBudget | None = None, reporter: Reporter | None = None,
                 options: GateOptions | None = None, node_pods: NodePods | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.api = api
        self.node_pods = node_pods
        self.node = node
        self.labels = labels
        self.budget = budget
        self.reporter = reporter or _Quiet()
        self.options = options or GateOptions()
        self.clock = clock
        self.waiting_reason = ""
        self._held: SlotView | None = None  # the slot held now, as last written
        self._ahead: tuple[int, int] | None = None  # (requests ahead of this one, takes then)
        self._slower = 1.0  # the poll interval's factor for a request far back in line
        self._in_line = False  # this node's request is in the line (not while its own pods hold it back)
        self._rejoin: Callable[[], None] | None = None  # puts the request back in line

    async def _budget(self) -> FleetBudget:
        if self.budget is not None:
            return self.budget
        text = await asyncio.to_thread(self.api.read_budget)
        return parse_budget(text) if text is not None else FleetBudget()

    @contextlib.asynccontextmanager
    async def slot(self, reason: str, *, rollout: str = "", gpu_pods: int = 0) -> AsyncIterator[str | None]:
        """Wait for a slot of this node's pool, hold it for the block; the slot's name (None: no budget
        applies to this node). An exception leaving the block counts as a failed change of ``rollout``."""
        budget = await self._budget()
        pool = budget.pool_for(await self.labels())
        if pool is None:
            yield None
            return
        entry = queue_name(pool.name, self.node, int(time.time() * 1000), gpu_pods)
        try:
            held = await self._acquire(budget, pool, entry, reason, gpu_pods)
        finally:  # taken, or given up waiting (cancelled, stopped): out of the line either way
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.to_thread(self.api.leave_queue, entry))
        renewer = asyncio.create_task(self._renew(budget, pool, held))
        failed: str | None = None
        try:
            await self.reporter.holding(held.name)
            yield held.name
        except BaseException as e:
            failed = str(e) if isinstance(e, NodeAgentError) else f"{type(e).__name__}: {e}"
            # a change that needs a reboot to finish did not fail; an agent stopped mid-change did not either
            if not isinstance(e, asyncio.CancelledError | GeneratorExit | RebootRequired):
                with contextlib.suppress(Exception):
                    await self.record_failure(pool, rollout or reason, failed)
            raise
        finally:
            renewer.cancel()
            with contextlib.suppress(BaseException):
                await renewer
            current = self._held or held
            self._held = None
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.api.release, current, pool.name, self.node)
            with contextlib.suppress(Exception):
                await self.reporter.released(failed)

    # -- waiting and taking ------------------------------------------------------------------------------
    async def _acquire(self, budget: FleetBudget, pool: Pool, entry: str, reason: str, gpu_pods: int) -> SlotView:
        request_s = await self._enter_line(budget, pool, entry, reason, gpu_pods)
        keeper = asyncio.create_task(self._keep_request(entry, request_s / 4))
        try:
            return await self._wait_for_slot(budget, pool, entry, reason)
        finally:
            keeper.cancel()

    async def _enter_line(self, budget: FleetBudget, pool: Pool, entry: str, reason: str, gpu_pods: int) -> float:
        """The request ``entry`` enters the line (and is remembered to re-enter it under that name after its own
        pods held it back); how long the request lives without renewal."""
        # A request lives three slot leases (at least 2 minutes) and is renewed by its own task at a quarter
        # of that, whatever the pace of the looks at the pool: a busy agent's request never lapses, a dead
        # agent's leaves the line within that time.
        request_s = max(3 * budget.lease_duration_s, 120)

        def join() -> None:
            self.api.request_slot(entry, pool.name, self.node, reason, gpu_pods, request_s, self.clock())

        await asyncio.to_thread(join)
        self._in_line, self._rejoin = True, join
        return request_s

    async def _keep_request(self, entry: str, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            with contextlib.suppress(NodeAgentError):
                await asyncio.to_thread(self.api.renew_request, entry, self.clock())

    async def _wait_for_slot(self, budget: FleetBudget, pool: Pool, entry: str, reason: str) -> SlotView:
        first = True
        self._ahead = None
        self._slower = 1.0
        self._pool_slots_of = pool
        while True:
            try:
                why, taken = await self._try(budget, pool, entry, reason)
            except NodeAgentError as e:  # the API did not answer, or refused a read: wait and look again
                why, taken = f"the fleet's Leases could not be read: {e}", None
            if taken is not None:
                self.waiting_reason = ""
                self._held = taken
                return taken
            if why and _kind(why) != _kind(self.waiting_reason):
                await self.reporter.waiting(why, first)  # said again only when the reason changes
                first = False
            self.waiting_reason = why or self.waiting_reason
            if why:
                await asyncio.sleep(self.options.poll_s * self._slower * random.uniform(0.5, 1.5))
            else:  # lost a race for a free slot: look again soon
                await asyncio.sleep(self.options.poll_s * random.uniform(0.05, 0.2))

    async def _try(self, budget: FleetBudget, pool: Pool, entry: str, reason: str) -> tuple[str, SlotView | None]:
        """("", slot) when taken; (why it waits, None); ("", None) after a lost race."""
        now = self.clock()
        state, slots = await asyncio.to_thread(self.api.pool, pool.name)
        mine = next((s for s in slots if s.holder == self.node and s.live(now)), None)
        if mine is not None:  # taken before a restart: still ours
            return "", mine
        if state.brake:
            return (f"the brake of pool {pool.name} is on ({state.brake_reason}); an operator clears it with "
                    f"'nodeagent fleet clear-brake {pool.name}'"), None
        if not windows_open(pool.windows, now):
            nxt = next_opening(pool.windows, now)
            when = f"; the next opens {nxt.isoformat(timespec='minutes')}" if nxt else ""
            return (f"the maintenance windows of pool {pool.name} are closed "
                    f"({'; '.join(w.describe() for w in pool.windows)}){when}"), None
        if pool.blocking_pods is not None:
            try:
                blocking = await self._blocking(pool.blocking_pods)
                held_back = f"pods blocking changes run on this node ({', '.join(blocking)})" if blocking else ""
            except NodeAgentError as e:
                held_back = f"the pods on this node could not be listed for blockingPods: {e}"
            if held_back:
                # held back by its own pods: out of the line, so the nodes behind it go meanwhile
                await self._step_aside(entry)
                return held_back, None
        if not self._in_line and self._rejoin is not None:
            # back in line under its first request's name: its place by the age of that request
            await asyncio.to_thread(self._rejoin)
            self._in_line, self._ahead = True, None
        if not self._fresh(state, now):
            if (await asyncio.to_thread(self.api.queue, pool.name, 1))[:1] != [entry]:
                return f"the nodes of pool {pool.name} are being counted by the first node in line", None
            state = await self._sized(pool, state, now)  # the first in line counts the pool's nodes
        # Every take adds one to a slot's leaseTransitions (its create counts one): the requests ahead of
        # this one, as last counted, less the takes since, is what is left ahead. Only a request that may be
        # among the first ``free`` reads the line again (a few names), not every waiter at every release.
        takes = sum(s.transitions + 1 for s in slots)
        ahead = None if self._ahead is None else self._ahead[0] - (takes - self._ahead[1])
        # far back in line: look less often (at most 4 polls apart), so a long line costs the server little
        self._slower = 1.0 if ahead is None else 1.0 + min(3.0, ahead / max(1, 2 * state.slots))
        live = [s for s in slots if s.live(now)]
        free = state.slots - len(live)
        if free <= 0:
            return (f"all {state.slots} slot(s) of pool {pool.name} ({pool.max_unavailable} of "
                    f"{state.size} nodes) are taken"), None
        if self._ahead is not None and self._ahead[0] - (takes - self._ahead[1]) >= free:
            return (f"{len(live)} of {state.slots} slot(s) of pool {pool.name} are taken; about "
                    f"{self._ahead[0] - (takes - self._ahead[1])} older request(s) (or nodes running no GPU "
                    "pods) go first"), None
        head = await asyncio.to_thread(self.api.queue, pool.name, free + 2 * state.slots)
        if entry not in head[:free]:
            self._ahead = (head.index(entry) if entry in head else len(head), takes)
            return (f"{len(live)} of {state.slots} slot(s) of pool {pool.name} are taken; "
                    f"{self._ahead[0]}{'' if entry in head else ' or more'} older request(s) (or nodes "
                    "running no GPU pods) go first"), None
        by_name = {s.name: s for s in slots}
        candidates = [slot_name(pool.name, i) for i in range(state.slots)
                      if slot_name(pool.name, i) not in by_name or not by_name[slot_name(pool.name, i)].live(now)]
        if not candidates:
            return "", None
        # the k-th in line tries the k-th free slot first: nodes let in together rarely collide
        pick = candidates[head.index(entry) % len(candidates)]
        taken = await asyncio.to_thread(self.api.take, pick, pool.name, self.node, budget.lease_duration_s,
                                        reason, now, by_name.get(pick))
        if taken is not None:
            # The brake may have gone on between the look at the pool and the take: read it again (not from
            # the cache) and give the slot back unused when it did, so nothing starts after the brake.
            after = await asyncio.to_thread(self.api.get_pool, pool.name)
            if after.brake:
                await asyncio.to_thread(self.api.release, taken, pool.name, self.node)
                return (f"the brake of pool {pool.name} is on ({after.brake_reason}); an operator clears it "
                        f"with 'nodeagent fleet clear-brake {pool.name}'"), None
        return "", taken

    async def _step_aside(self, entry: str) -> None:
        if self._in_line:
            await asyncio.to_thread(self.api.leave_queue, entry)
            self._in_line, self._ahead = False, None

    async def _blocking(self, selector: Selector) -> list[str]:
        """The node's running pods that ``selector`` picks (at most 5 named)."""
        if self.node_pods is None:
            return await asyncio.to_thread(self.api.blocking_pods, self.node, selector.text)
        return [name for name, labels in await self.node_pods() if selector.matches(labels)][:5]

    def _fresh(self, state: PoolState, now: datetime) -> bool:
        return (state.exists and state.sized_at is not None and now - state.sized_at < timedelta(seconds=SIZE_TTL_S)
                and state.slots == self._pool_slots(state))

    _pool_slots_of: Pool | None = None

    def _pool_slots(self, state: PoolState) -> int:
        return self._pool_slots_of.max_unavailable.slots(state.size) if self._pool_slots_of else state.slots

    async def _sized(self, pool: Pool, state: PoolState, now: datetime) -> PoolState:
        """The pool Lease with the pool's nodes counted now."""
        for _ in range(5):
            size = await asyncio.to_thread(self.api.count_nodes, pool.selector.text)
            new = replace(state, size=size, slots=pool.max_unavailable.slots(size), sized_at=now)
            if await asyncio.to_thread(self.api.put_pool, pool.name, new, now, sized=True):
                return new
            state = await asyncio.to_thread(self.api.get_pool, pool.name)
            if state.exists and state.sized_at is not None and now - state.sized_at < timedelta(seconds=SIZE_TTL_S):
                return state
        return state

    async def _renew(self, budget: FleetBudget, pool: Pool, held: SlotView) -> None:
        every = max(1.0, budget.lease_duration_s / 3)
        self._held = held
        while True:
            await asyncio.sleep(every)
            try:
                renewed = await asyncio.to_thread(self.api.renew, self._held, pool.name, self.node, self.clock())
            except NodeAgentError as e:
                log.warning("fleet: renewing slot %s failed: %s", held.name, e)
                continue
            if renewed is None:
                log.error("fleet: slot %s was taken over by another node (this node did not renew it in time)",
                          held.name)
                return
            self._held = renewed

    # -- the brake ----------------------------------------------------------------------------------------
    async def record_failure(self, pool: Pool, rollout: str, why: str) -> PoolState:
        """Count this node's failed change on the pool Lease; the brake goes on past ``maxFailures``."""
        for _ in range(10):
            state = await asyncio.to_thread(self.api.get_pool, pool.name)
            failures, failed = state.failures, state.failed
            if state.rollout != rollout and not state.brake:
                failures, failed = 0, ()  # a new rollout counts from zero (a brake that is on stays on)
            failures += 1
            failed = (*tuple(n for n in failed if n != self.node), self.node)
            brake = state.brake or failures > pool.max_failures
            brake_reason = state.brake_reason if state.brake else (
                f"{failures} changes of {rollout} failed, more than maxFailures {pool.max_failures}; "
                f"last: {self.node}: {why}"[:500] if brake else "")
            new = replace(state, failures=failures, failed=failed, brake=brake, brake_reason=brake_reason,
                          rollout=rollout if not state.brake else state.rollout)
            if await asyncio.to_thread(self.api.put_pool, pool.name, new, self.clock(), sized=False):
                if brake and not state.brake:
                    log.error("fleet: the brake of pool %s is on: %s", pool.name, brake_reason)
                return new
            await asyncio.sleep(random.uniform(0.01, 0.1))
        raise NodeAgentError(f"could not count the failure on pool {pool.name}: too many concurrent writers")


_KINDS = ("brake", "maintenance window", "blocking", "could not be read", "could not be listed")


def _kind(why: str) -> str:
    """The kind of a waiting reason: a node says it again (condition, Event) only when the kind changes,
    not when the numbers in it do (the slots taken, the requests ahead)."""
    return next((k for k in _KINDS if k in why), "in line" if why else "")
