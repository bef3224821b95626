"""The fleet's disruption budget without an API server: parsing and its errors, slot math, windows, the fair
order of requests, and the gate's brake and waiting against an in-memory stand-in of ``FleetApi``."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from nodeagent.deadline import within
from nodeagent.errors import ConfigError, NodeAgentError, OperationError
from nodeagent.fleet.budget import (
    MaxUnavailable,
    PoolState,
    SlotView,
    parse_budget,
    parse_selector,
    queue_name,
)
from nodeagent.fleet.gate import FleetGate, GateOptions

GOOD = """
leaseDurationSeconds: 30
pools:
  - name: a100
    nodeSelector: "pool=a100,gpu"
    maxUnavailable: 5%
    maxFailures: 1
    windows:
      - {days: [sat, sun], start: "22:00", end: "04:00", timeZone: Europe/Berlin}
    blockingPods: "app=train"
  - name: rest
    nodeSelector: ""
    maxUnavailable: 2
"""


def test_parse_good_budget() -> None:
    b = parse_budget(GOOD)
    assert b.lease_duration_s == 30
    assert [p.name for p in b.pools] == ["a100", "rest"]
    a100 = b.pools[0]
    assert a100.max_unavailable == MaxUnavailable(5, True) and a100.max_failures == 1
    assert a100.blocking_pods is not None and a100.blocking_pods.text == "app=train"
    assert b.pool_for({"pool": "a100", "gpu": ""}) is a100
    assert b.pool_for({"pool": "a100"}) is b.pools[1]  # no "gpu" label: the catch-all pool
    assert b.pools[1].max_failures == 2  # the default


@pytest.mark.parametrize("text, field", [
    ("pools: [{name: a, nodeSelector: '', maxUnavailable: 5.5%}]", "pools[0].maxUnavailable"),
    ("pools: [{name: a, nodeSelector: '', maxUnavailable: '101%'}]", "pools[0].maxUnavailable"),
    ("pools: [{name: a, nodeSelector: '', maxUnavailable: -1}]", "pools[0].maxUnavailable"),
    ("pools: [{name: a, nodeSelector: ''}]", "pools[0].maxUnavailable"),
    ("pools: [{name: A_B, nodeSelector: '', maxUnavailable: 1}]", "pools[0].name"),
    ("pools: [{name: a, maxUnavailable: 1}]", "pools[0].nodeSelector"),
    ("pools: [{name: a, nodeSelector: 'a in (', maxUnavailable: 1}]", "pools[0].nodeSelector"),
    ("pools: [{name: a, nodeSelector: '', maxUnavailable: 1, maxFailures: x}]", "pools[0].maxFailures"),
    ("pools: [{name: a, nodeSelector: '', maxUnavailable: 1, blockingPods: ''}]", "pools[0].blockingPods"),
    ("pools: [{name: a, nodeSelector: '', maxUnavailable: 1, windows: [{days: [funday], start: '01:00', "
     "end: '02:00'}]}]", "pools[0].windows[0].days"),
    ("pools: [{name: a, nodeSelector: '', maxUnavailable: 1, windows: [{start: '25:00', end: '02:00'}]}]",
     "pools[0].windows[0].start"),
    ("pools: [{name: a, nodeSelector: '', maxUnavailable: 1, windows: [{start: '01:00', end: '02:00', "
     "timeZone: Mars/Base}]}]", "pools[0].windows[0].timeZone"),
    ("pools: [{name: a, nodeSelector: '', maxUnavailable: 1, colour: red}]", "pools[0].colour"),
    ("pools: [{name: a, nodeSelector: '', maxUnavailable: 1}, {name: a, nodeSelector: '', maxUnavailable: 1}]",
     "pools[1].name"),
    ("leaseDurationSeconds: 1", "leaseDurationSeconds"),
])
def test_bad_budget_is_one_error_naming_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_budget(text)
    assert e.value.subject == field
    assert field in str(e.value) and "budget.yaml" in str(e.value)


def test_slots_of_a_pool() -> None:
    assert MaxUnavailable(5, True).slots(1000) == 50
    assert MaxUnavailable(5, True).slots(999) == 49  # rounded down
    assert MaxUnavailable(5, True).slots(3) == 1  # but at least one
    assert MaxUnavailable(0, True).slots(1000) == 0  # 0% freezes the pool
    assert MaxUnavailable(3, False).slots(2) == 3


def test_selectors() -> None:
    s = parse_selector("a=1,b!=2,c in (x, y),d notin (z),e,!f", "sel")
    assert s.matches({"a": "1", "c": "x", "e": ""})
    assert not s.matches({"a": "1", "c": "x", "e": "", "f": "1"})
    assert not s.matches({"a": "1", "b": "2", "c": "x", "e": ""})
    assert not s.matches({"a": "1", "c": "q", "e": ""})
    assert not s.matches({"a": "1", "c": "x", "d": "z", "e": ""})
    assert parse_selector("", "sel").matches({"any": "thing"})


def test_windows_across_midnight_and_time_zones() -> None:
    w = parse_budget(GOOD).pools[0].windows[0]  # sat/sun 22:00-04:00 Berlin (UTC+1 in winter)
    sat_2230_berlin = datetime(2026, 11, 28, 21, 30, tzinfo=timezone.utc)
    assert w.is_open(sat_2230_berlin)
    assert w.is_open(sat_2230_berlin + timedelta(hours=5))  # Sunday 03:30 Berlin: Saturday's window
    assert not w.is_open(sat_2230_berlin + timedelta(hours=7))  # Sunday 05:30
    assert w.is_open(sat_2230_berlin + timedelta(days=1))  # Sunday 22:30
    assert not w.is_open(sat_2230_berlin + timedelta(days=1, hours=6))  # Monday 04:30: Sunday's ended
    assert not w.is_open(sat_2230_berlin - timedelta(days=1))  # Friday 22:30
    nxt = w.next_open(sat_2230_berlin - timedelta(days=1))
    assert nxt is not None and nxt.astimezone(timezone.utc) == datetime(2026, 11, 28, 21, 0, tzinfo=timezone.utc)


def test_fair_order_is_the_name_order() -> None:
    t = 1_764_000_000_000
    names = [queue_name("p", "n3", t + 5, 2), queue_name("p", "n2", t + 9, 0), queue_name("p", "n1", t, 1),
             queue_name("p", "n4", t + 1, 0), queue_name("p", "n0", t, 0)]
    # no GPU pods first (oldest first among them), then the others oldest first; ties by node name
    assert [n.rsplit("-", 1)[1] for n in sorted(names)] == ["n0", "n4", "n2", "n1", "n3"]


# -- the gate against an in-memory API -----------------------------------------------------------------------

class FakeApi:
    """The ``FleetApi`` calls the gate makes, on dicts, with the API server's compare-and-swap."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: dict[str, SlotView] = {}
        self.queue_names: set[str] = set()
        self.state = PoolState()
        self.rv = 0
        self.blocking: list[str] = []
        self.events: list[str] = []
        # the order in which slots were taken and the brake went on ("take n5", "brake")
        self.order: list[str] = []

    def _rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def read_budget(self) -> str | None:
        return None

    def pool(self, pool: str) -> tuple[PoolState, list[SlotView]]:
        return self.state, sorted(self.slots.values(), key=lambda s: s.name)

    def queue(self, pool: str, limit: int = 0) -> list[str]:
        names = sorted(self.queue_names)
        return names[:limit] if limit else names

    def request_slot(self, name: str, pool: str, node: str, reason: str, gpu_pods: int, duration_s: int,
                     now: datetime) -> None:
        self.queue_names.add(name)

    def renew_request(self, name: str, now: datetime) -> None:
        return None

    def leave_queue(self, name: str) -> None:
        self.queue_names.discard(name)

    def take(self, name: str, pool: str, node: str, duration_s: int, reason: str, now: datetime,
             seen: SlotView | None) -> SlotView | None:
        cur = self.slots.get(name)
        if (seen is None) != (cur is None) or (cur and seen and cur.resource_version != seen.resource_version):
            return None
        transitions = cur.transitions + 1 if cur else 0
        self.order.append(f"take {node}")
        self.slots[name] = SlotView(name, node, now, duration_s, self._rv(), transitions, reason)
        return self.slots[name]

    def renew(self, slot: SlotView, pool: str, node: str, now: datetime) -> SlotView | None:
        return slot

    def release(self, slot: SlotView, pool: str, node: str) -> None:
        if self.slots[slot.name].holder == node:
            self.slots[slot.name] = replace(slot, holder="", resource_version=self._rv())

    def get_pool(self, pool: str) -> PoolState:
        return self.state

    def put_pool(self, pool: str, state: PoolState, now: datetime, *, sized: bool) -> bool:
        if self.state.exists and state.resource_version != self.state.resource_version:
            return False
        if state.brake and not self.state.brake:
            self.events.append("brake")
            self.order.append("brake")
        self.state = replace(state, exists=True, resource_version=self._rv(),
                             sized_at=now if sized else state.sized_at)
        return True

    def count_nodes(self, selector: str) -> int:
        return self.size

    def blocking_pods(self, node: str, selector: str) -> list[str]:
        return self.blocking


class Said:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    async def waiting(self, reason: str, first: bool) -> None:
        self.reasons.append(reason)

    async def holding(self, slot: str) -> None:
        return None

    async def released(self, failed: str | None) -> None:
        return None


BUDGET = parse_budget("pools: [{name: p, nodeSelector: '', maxUnavailable: 2, maxFailures: 1}]")


def gate(api: FakeApi, node: str, said: Said | None = None, budget_text: str | None = None) -> FleetGate:
    async def labels() -> Mapping[str, str]:
        return {}

    budget = parse_budget(budget_text) if budget_text else BUDGET
    return FleetGate(api, node, labels, budget=budget, reporter=said, options=GateOptions(poll_s=0.01))  # type: ignore[arg-type]


def test_never_more_than_the_budget_and_the_brake() -> None:
    api = FakeApi(size=10)
    inside: list[int] = [0]
    most: list[int] = [0]
    failures = {"n3", "n4", "n5"}  # maxFailures 1: the second failure puts the brake on

    async def agent(node: str, delay: float) -> str:
        await asyncio.sleep(delay)
        try:
            async with gate(api, node).slot("change", rollout="r1"):
                inside[0] += 1
                api.events.append(node)
                most[0] = max(most[0], inside[0])
                await asyncio.sleep(0.02)
                inside[0] -= 1
                if node in failures:
                    raise OperationError(f"{node} broke")
        except OperationError:
            return "failed"
        return "done"

    async def main() -> dict[str, str]:
        tasks = {f"n{i}": asyncio.create_task(agent(f"n{i}", i * 0.001)) for i in range(10)}
        await asyncio.sleep(1.0)
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        return {n: t.result() for n, t in tasks.items() if not t.cancelled()}

    results = asyncio.run(main())
    assert most[0] <= 2
    # the second failure put the brake on; changes already running may still fail after it, none starts
    assert api.state.brake and api.state.failures >= 2, api.state
    # no change started on a slot taken after the brake went on (one admitted before it, its slot taken and the
    # brake read again as off, may still start its body a moment after the brake's write: the threads interleave)
    after_brake = api.events[api.events.index("brake") + 1:]
    taken_after = api.order[api.order.index("brake") + 1:]
    assert not [n for n in after_brake if f"take {n}" in taken_after], (api.events, api.order)
    assert "more than maxFailures 1" in api.state.brake_reason
    # the first in line went first; once the brake was on nobody started: some never finished
    assert results.get("n0") == "done" and results.get("n1") == "done"
    assert len(results) < 10
    assert list(results.values()).count("failed") >= 2


def test_fair_order_a_later_request_waits_behind_an_older_one() -> None:
    api = FakeApi(size=10)
    api.slots["nf-slot-p-0000"] = SlotView("nf-slot-p-0000", "x", datetime.now(timezone.utc), 60, "1")
    api.slots["nf-slot-p-0001"] = SlotView("nf-slot-p-0001", "y", datetime.now(timezone.utc), 60, "2")
    order: list[str] = []
    said = {n: Said() for n in ("busy", "old", "new")}

    async def agent(node: str, gpu_pods: int) -> None:
        async with gate(api, node, said[node]).slot("c", gpu_pods=gpu_pods):
            order.append(node)

    async def main() -> None:
        busy = asyncio.create_task(agent("busy", 3))  # requested first, but runs GPU pods
        await asyncio.sleep(0.01)
        old = asyncio.create_task(agent("old", 0))
        await asyncio.sleep(0.01)
        new = asyncio.create_task(agent("new", 0))
        await asyncio.sleep(0.05)
        assert order == []  # every slot taken: nobody starts
        api.slots["nf-slot-p-0000"] = replace(api.slots["nf-slot-p-0000"], holder="", resource_version="9")
        await asyncio.wait_for(asyncio.gather(busy, old, new), 5)

    asyncio.run(main())
    assert order[0] == "old"  # one slot free: the oldest request among the nodes without GPU pods
    assert order.index("busy") == 2  # the node running GPU pods after them
    # each said once that it waits in line, however the numbers in the reason changed meanwhile
    assert [len(said[n].reasons) for n in ("busy", "old", "new")] == [1, 1, 1], {n: s.reasons for n, s in said.items()}


def test_a_dead_holders_slot_is_free_after_its_lease() -> None:
    api = FakeApi(size=1)  # one slot
    stale = datetime.now(timezone.utc) - timedelta(seconds=61)
    api.slots["nf-slot-p-0000"] = SlotView("nf-slot-p-0000", "dead", stale, 60, "1")

    async def main() -> str | None:
        async with gate(api, "n1").slot("c") as name:
            return name

    assert asyncio.run(asyncio.wait_for(main(), 5)) == "nf-slot-p-0000"


def test_closed_window_and_blocking_pods_say_why() -> None:
    api = FakeApi(size=4)
    said = Said()
    now = datetime.now(timezone.utc)
    closed = (f"pools: [{{name: p, nodeSelector: '', maxUnavailable: 1, windows: [{{days: [{now.strftime('%a').lower()}], "
              f"start: '{(now + timedelta(hours=2)):%H}:00', end: '{(now + timedelta(hours=3)):%H}:00', "
              "timeZone: UTC}]}]")

    async def wait_a_bit(g: FleetGate) -> None:
        async def take() -> None:
            async with g.slot("c"):
                raise AssertionError("started while it must wait")

        with pytest.raises(TimeoutError):
            await within(take(), 0.2)

    asyncio.run(wait_a_bit(gate(api, "n1", said, closed)))
    assert said.reasons and "maintenance windows of pool p are closed" in said.reasons[0]
    assert not any(s.holder for s in api.slots.values())
    api.blocking = ["ml/trainer"]
    said2 = Said()
    blocking = "pools: [{name: p, nodeSelector: '', maxUnavailable: 1, blockingPods: 'app=train'}]"
    asyncio.run(wait_a_bit(gate(api, "n2", said2, blocking)))
    assert said2.reasons == ["pods blocking changes run on this node (ml/trainer)"]


def test_blocking_pods_from_the_nodes_runtime() -> None:
    """With the node's own pod list (the daemon's: the container runtime) the API is not asked for pods; the
    selector picks by the pods' labels; a pod list that fails holds the change back, saying why."""
    api = FakeApi(size=4)
    api.blocking = ["never/asked"]
    listed: list[list[tuple[str, Mapping[str, str]]]] = [
        [("ml/trainer", {"app": "train"}), ("default/web", {"app": "web"})], [("default/web", {"app": "web"})]]

    async def node_pods() -> list[tuple[str, Mapping[str, str]]]:
        if not listed:
            raise NodeAgentError("the container runtime on /run/containerd/containerd.sock did not answer")
        return listed.pop(0)

    said = Said()
    g = gate(api, "n1", said, "pools: [{name: p, nodeSelector: '', maxUnavailable: 1, blockingPods: 'app=train'}]")
    g.node_pods = node_pods

    async def main() -> str | None:
        async with g.slot("c") as slot:
            return slot

    assert asyncio.run(asyncio.wait_for(main(), 5)) == "nf-slot-p-0000"
    assert said.reasons == ["pods blocking changes run on this node (ml/trainer)"], said.reasons
    said2 = Said()
    g2 = gate(api, "n2", said2, "pools: [{name: p, nodeSelector: '', maxUnavailable: 1, blockingPods: 'app=train'}]")
    g2.node_pods = node_pods

    async def stuck() -> None:
        async def take() -> None:
            async with g2.slot("c"):
                raise AssertionError("started while its pods could not be listed")

        with pytest.raises(TimeoutError):
            await within(take(), 0.2)

    asyncio.run(stuck())
    assert said2.reasons and said2.reasons[0].startswith("the pods on this node could not be listed for blockingPods: ")


def test_a_node_held_back_by_its_pods_steps_out_of_line_and_back_in_at_its_place() -> None:
    """The step-out rule, driven one look at a time (no racing tasks, no sleeps, a fixed clock): n1 asked first
    but runs a blocking pod, so it leaves the line at its look and n2, behind it, takes the one slot; n3 asks
    later. Once n1's pod is gone n1 is back in line under its FIRST request's name, ahead of n3: when n2's slot
    comes free, n3 looks first and still waits, and n1 takes the slot."""
    api = FakeApi(size=3)
    budget = parse_budget("pools: [{name: p, nodeSelector: '', maxUnavailable: 1, blockingPods: 'app=train'}]")
    pool = budget.pools[0]
    now = datetime(2026, 11, 29, 3, 0, tzinfo=timezone.utc)
    pods: dict[str, list[tuple[str, Mapping[str, str]]]] = {"n1": [("ml/trainer", {"app": "train"})], "n2": [],
                                                           "n3": []}
    t = int(now.timestamp() * 1000)
    entries = {"n1": queue_name("p", "n1", t, 0), "n2": queue_name("p", "n2", t + 1, 0),
               "n3": queue_name("p", "n3", t + 2, 0)}

    def node_gate(node: str) -> FleetGate:
        async def labels() -> Mapping[str, str]:
            return {}

        async def node_pods() -> list[tuple[str, Mapping[str, str]]]:
            return pods[node]

        return FleetGate(api, node, labels, budget=budget, node_pods=node_pods, clock=lambda: now)  # type: ignore[arg-type]

    gates = {n: node_gate(n) for n in ("n1", "n2", "n3")}

    async def enter(node: str) -> None:
        await gates[node]._enter_line(budget, pool, entries[node], "c", 0)

    async def look(node: str) -> tuple[str, SlotView | None]:
        return await gates[node]._try(budget, pool, entries[node], "c")

    async def main() -> None:
        await enter("n1")
        await enter("n2")
        # while n1 is first in line (it has not looked yet) n2 does not go
        why, taken = await look("n2")
        assert taken is None and "counted by the first node in line" in why, why
        # n1 looks: its own pod holds it back, it steps out of the line
        why, taken = await look("n1")
        assert taken is None and why == "pods blocking changes run on this node (ml/trainer)"
        assert api.queue_names == {entries["n2"]}
        # n2 is first now: it counts the pool and takes the one slot
        why, n2_slot = await look("n2")
        assert n2_slot is not None and n2_slot.holder == "n2", why
        api.leave_queue(entries["n2"])  # what slot() does once the slot is taken
        await enter("n3")  # a later request
        # n1's pod ends; at its next look it is back in line under its first name, ahead of n3, and waits
        pods["n1"] = []
        why, taken = await look("n1")
        assert taken is None and "are taken" in why, why
        assert sorted(api.queue_names) == [entries["n1"], entries["n3"]]
        # n2 is done; n3 happens to look first: the older request goes first, n3 waits
        api.release(n2_slot, "p", "n2")
        why, taken = await look("n3")
        assert taken is None and "1 older request(s)" in why, why
        why, taken = await look("n1")
        assert taken is not None and taken.holder == "n1", why
        why, taken = await look("n3")
        assert taken is None and "are taken" in why, why

    asyncio.run(asyncio.wait_for(main(), 10))
