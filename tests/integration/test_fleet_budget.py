"""The fleet's disruption budget on a real kube-apiserver with simulated agents (tests/integration/_fleet.py):
100 nodes relabelled at once never have more changing than the budget (the in-process count and a watch
on the slot Leases), the brake trips past maxFailures and no slot is taken after it, a killed holder's slot
comes back once its Lease expired, a closed window starts nothing, and two real MIG reconcilers on a
budget of 1 change one after the other."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from nodeagent.cli import cli
from nodeagent.deadline import within
from nodeagent.fleet.budget import SlotView, parse_budget
from nodeagent.fleet.gate import FleetGate, GateOptions
from nodeagent.fleet.leases import FleetApi
from nodeagent.fleet.report import NodeReporter
from nodeagent.fleet.status import clear_brake, render, tally
from nodeagent.kube.client import KubeClient
from nodeagent.kube.node import NodeClient
from nodeagent.mig.reconciler import CONFIG_LABEL, STATE_LABEL, MigReconciler
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator.open import open_sim
from tests.integration._fleet import (
    Fleet,
    LeaseWatch,
    agent,
    budget_configmap,
    delete_nodes,
    make_namespace,
    make_nodes,
    pooled_client,
)
from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers
NS = "nodeagent-fleet-it"


@pytest.fixture(scope="module")
def fleet_kube(kube_apiserver: KubeApiServer) -> Iterator[KubeClient]:
    kube = pooled_client(kube_apiserver.kubeconfig)
    make_namespace(kube, NS)
    yield kube
    kube.close()


@pytest.fixture
def pool(fleet_kube: KubeClient) -> Iterator[tuple[str, list[str]]]:
    """A fresh pool name and its nodes (made by the test through ``make``), deleted after."""
    name = f"p{uuid.uuid4().hex[:6]}"
    made: list[str] = []
    yield name, made
    delete_nodes(fleet_kube, made)


def nodes_of(kube: KubeClient, pool: str, made: list[str], n: int) -> list[str]:
    names = [f"{pool}-n{i:03d}" for i in range(n)]
    make_nodes(kube, names, {"fleet-pool": pool})
    made += names
    return names


async def run_agents(coros: list, executor_threads: int = 48) -> list[str]:  # type: ignore[type-arg]
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(executor_threads))
    return list(await asyncio.gather(*coros))


async def test_hundred_nodes_never_more_than_the_budget(kube_apiserver: KubeApiServer, fleet_kube: KubeClient,
                                                        pool: tuple[str, list[str]]) -> None:
    name, made = pool
    names = nodes_of(fleet_kube, name, made, 100)
    # the budget as the operator writes it, read by every agent from the ConfigMap
    budget_configmap(fleet_kube, NS, f"pools: [{{name: {name}, nodeSelector: 'fleet-pool={name}', "
                                     "maxUnavailable: 10%, maxFailures: 3}]")
    busy = set(names[::5])  # every fifth node runs GPU pods: those go after the others
    watch = LeaseWatch(kube_apiserver.kubeconfig, NS, name)
    fleet = Fleet()
    started = time.monotonic()
    try:
        results = await asyncio.wait_for(run_agents([
            agent(fleet_kube, NS, n, {"fleet-pool": name}, fleet, gpu_pods=2 if n in busy else 0, change_s=0.2,
                  poll_s=0.3) for n in names]), 60)
    finally:
        watch.stop()
    wall = time.monotonic() - started
    assert results == ["done"] * 100
    assert fleet.most_inside <= 10, fleet.most_inside
    assert watch.most <= 10 and watch.samples >= 200, (watch.most, watch.samples)
    assert fleet.most_inside >= 5  # the budget was used, not one at a time
    order = [n for _, n in sorted(fleet.starts)]
    # nodes running GPU pods go last: of the 20, at least 15 among the last 30 to start
    assert sum(1 for n in order[-30:] if n in busy) >= 15, order
    writes = sorted(fleet.writes.values())
    # request, take, release, leave the line; a few nodes more: a lost race, a renewal of a long wait's request
    assert writes[0] == 4 and writes[-1] <= 8, writes
    state = tally(FleetApi(fleet_kube, NS), parse_budget(
        f"pools: [{{name: {name}, nodeSelector: 'fleet-pool={name}', maxUnavailable: 10%}}]"))[0]
    assert (state.nodes, state.slots, state.done, state.changing, state.waiting, state.failed) == (
        100, 10, 100, [], [], {})
    # the operator's command, as typed
    out = CliRunner().invoke(cli, ["fleet", "status", "--kubeconfig", str(kube_apiserver.kubeconfig), "-n", NS])
    assert out.exit_code == 0, out.output
    header, row = out.output.splitlines()[:2]
    assert header.split() == ["POOL", "NODES", "SLOTS", "DONE", "CHANGING", "WAITING", "FAILED", "BRAKE", "WINDOW"]
    assert row.split()[:8] == [name, "100", "10", "100", "0", "0", "0", "off"], row
    print(f"\n100 nodes, budget 10: {wall:.1f}s, lease writes per node median {writes[50]} max {writes[-1]}, "
          f"most changing {watch.most} (watch samples {watch.samples})")


async def test_brake_trips_past_max_failures_and_nothing_starts_after(
        kube_apiserver: KubeApiServer, fleet_kube: KubeClient, pool: tuple[str, list[str]]) -> None:
    name, made = pool
    names = nodes_of(fleet_kube, name, made, 30)
    budget = parse_budget(f"pools: [{{name: {name}, nodeSelector: 'fleet-pool={name}', maxUnavailable: 3, "
                          "maxFailures: 2}]")
    watch = LeaseWatch(kube_apiserver.kubeconfig, NS, name)
    fleet = Fleet()
    api = FleetApi(fleet_kube, NS)

    async def rollout() -> None:
        tasks = [asyncio.create_task(agent(fleet_kube, NS, n, {"fleet-pool": name}, fleet, budget=budget,
                                           fail=True, change_s=0.3, poll_s=0.2)) for n in names]
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(32))
        deadline = time.monotonic() + 20
        while watch.brake_rv is None:
            assert time.monotonic() < deadline, "the brake never went on"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # time for any agent to (wrongly) take a slot after the brake
        brake_takes = len(watch.takes)
        # a node that took a slot after the brake went on (it looked at the pool just before) gave it back
        # unused: every node that started took its slot before the brake
        started = {n for _, n in fleet.starts}
        before = {h for rv, h in watch.takes if rv < watch.brake_rv}
        assert started <= before, (watch.takes, watch.brake_rv, started)
        failed = [n for n, r in fleet.results.items() if r == "failed"]
        assert 3 <= len(failed) <= 5  # K+1 failed, and those in flight when the brake went on
        status = render(tally(api, budget))
        assert "brake on" in status and "more than maxFailures 2" in status
        assert all(f"{n} failed: failed: MIG config all-1g.10gb: simulated failure" in status for n in failed), status
        # a waiting node says why
        waiting = next(n for n in names if n not in fleet.results)
        cond = next(c for c in NodeClient(fleet_kube, waiting).get().conditions if c["type"] == "GpuChangeSlot")
        assert cond["reason"] == "BrakeOn" and "clear-brake" in cond["message"], cond
        # the operator clears the brake: the others go on (and fail again: the brake trips again)
        clear_brake(api, name)
        deadline = time.monotonic() + 20
        while len(watch.takes) == brake_takes:
            assert time.monotonic() < deadline, "nobody went on after the brake was cleared"
            await asyncio.sleep(0.1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        await asyncio.wait_for(rollout(), 60)
    finally:
        watch.stop()


async def test_a_killed_holders_slot_comes_back_after_its_lease(fleet_kube: KubeClient,
                                                                 pool: tuple[str, list[str]]) -> None:
    name, made = pool
    a, b = nodes_of(fleet_kube, name, made, 2)
    budget = parse_budget(f"leaseDurationSeconds: 5\npools: [{{name: {name}, nodeSelector: '', "
                          "maxUnavailable: 1}]")

    class Dying(FleetApi):
        """An agent killed while holding: it neither renews nor releases any more."""

        def renew(self, slot: SlotView, pool: str, node: str, now: datetime) -> SlotView | None:
            raise asyncio.CancelledError

        def release(self, slot: SlotView, pool: str, node: str) -> None:
            return None

    async def labels() -> dict[str, str]:
        return {}

    dead = FleetGate(Dying(fleet_kube, NS), a, labels, budget=budget)
    async with dead.slot("change") as slot_a:
        taken_at = time.monotonic()
    assert slot_a is not None
    said: list[str] = []

    class Said(NodeReporter):
        async def waiting(self, reason: str, first: bool) -> None:
            said.append(reason)
            await super().waiting(reason, first)

    live = FleetGate(FleetApi(fleet_kube, NS), b, labels, budget=budget,
                     reporter=Said(NodeClient(fleet_kube, b)), options=GateOptions(poll_s=0.3))
    async def take() -> tuple[Any, float]:
        async with live.slot("change") as slot:
            return slot, time.monotonic() - taken_at

    slot_b, waited = await within(take(), 15)
    assert slot_b == slot_a and 4.0 <= waited <= 9.0, waited
    assert said and "all 1 slot(s)" in said[0]
    events = [e for e in NodeClient(fleet_kube, b).list_events() if e["reason"] == "GpuChangeWaiting"]
    assert len(events) == 1


async def test_a_closed_window_starts_nothing(fleet_kube: KubeClient, pool: tuple[str, list[str]]) -> None:
    name, made = pool
    names = nodes_of(fleet_kube, name, made, 5)
    tomorrow = (datetime.now(timezone.utc) + timedelta(days=1)).strftime("%a").lower()
    budget = parse_budget(f"pools: [{{name: {name}, nodeSelector: '', maxUnavailable: 5, windows: "
                          f"[{{days: [{tomorrow}], start: '02:00', end: '03:00', timeZone: UTC}}]}}]")
    fleet = Fleet()
    tasks = [asyncio.create_task(agent(fleet_kube, NS, n, {}, fleet, budget=budget, poll_s=0.2)) for n in names]
    try:
        await asyncio.sleep(1.5)
        assert fleet.starts == []
        _, slots = FleetApi(fleet_kube, NS).pool(name)
        assert not [s for s in slots if s.holder]
        view = NodeClient(fleet_kube, names[0]).get()
        cond = next(c for c in view.conditions if c["type"] == "GpuChangeSlot")
        assert cond["status"] == "False" and "maintenance windows" in cond["message"], cond
        assert view.labels[STATE_LABEL] == "pending"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_two_mig_reconcilers_on_a_budget_of_one_change_one_after_the_other(
        kube_apiserver: KubeApiServer, fleet_kube: KubeClient, pool: tuple[str, list[str]], tmp_path: Path) -> None:
    name, made = pool
    nodes = nodes_of(fleet_kube, name, made, 2)
    budget = parse_budget(f"pools: [{{name: {name}, nodeSelector: 'fleet-pool={name}', maxUnavailable: 1}}]")
    watch = LeaseWatch(kube_apiserver.kubeconfig, NS, name)
    recs = []
    for n in nodes:
        client = NodeClient(fleet_kube, n)
        gate = FleetGate(FleetApi(fleet_kube, NS), n, functools.partial(_labels, client), budget=budget,
                         reporter=NodeReporter(client), options=GateOptions(poll_s=0.2))
        recs.append(MigReconciler(client, adapter_for_sim(open_sim("dgx-a100-40gb")), tmp_path / n, gate=gate))
    for n in nodes:  # both relabelled at once
        NodeClient(fleet_kube, n).patch_labels({CONFIG_LABEL: "all-1g.5gb"})
    try:
        results = await asyncio.wait_for(asyncio.gather(
            *(r.reconcile(NodeClient(fleet_kube, n).get()) for r, n in zip(recs, nodes, strict=True))), 30)
    finally:
        watch.stop()
    assert results == ["success", "success"]
    assert watch.most == 1 and sorted(h for _, h in watch.takes) == sorted(nodes), (watch.most, watch.takes)


async def _labels(node: NodeClient) -> dict[str, str]:
    return dict((await node.aget()).labels)
