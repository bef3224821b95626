"""The two label-driven switches against the real kube-apiserver: ``nvidia.com/gpu.workload.config`` and
``nvidia.com/cc.mode`` followed both ways on the simulator, their state labels, one Event per change,
the refusals (a bad value, CC on without a TEE), the wait for a GPU's pods and the disruption budget."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from nodeagent.ccmode.switch import CcSwitch
from nodeagent.errors import OperationError
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient
from nodeagent.kube.node import NodeClient
from nodeagent.labelswitch import Holder, SwitchOptions, SwitchReconciler
from nodeagent.nvmlsource import adapter_for_sim, cc_tool, pci_kernel
from nodeagent.simulator.open import open_sim
from nodeagent.vfio.switch import VfioSwitch
from nodeagent.vfio.sysfs import PciSysfs
from tests.peers import KubeApiServer

WORKLOAD = "nvidia.com/gpu.workload.config"
WORKLOAD_STATE = "nvidia.com/gpu.workload.config.state"
CC = "nvidia.com/cc.mode"


@pytest.fixture
def node(kube_apiserver: KubeApiServer, request: pytest.FixtureRequest) -> Iterator[NodeClient]:
    from kubernetes import client as k8s

    name = "sw-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:50]
    api = kube_apiserver.api_client()
    core = k8s.CoreV1Api(api)
    core.create_node(k8s.V1Node(metadata=k8s.V1ObjectMeta(name=name)))
    kube = KubeClient(kube_apiserver.api_client())
    try:
        yield NodeClient(kube, name)
    finally:
        core.delete_node(name)
        api.close()
        kube.close()


def events(node: NodeClient) -> list[tuple[str, str, str]]:
    """(reason, type, message) of the Node's Events, sorted (the API lists them by name, not by time)."""
    return sorted((e["reason"], e["type"], e["message"]) for e in node.list_events())


def message(evs: list[tuple[str, str, str]], reason: str, has: str) -> str:
    found = [m for r, _, m in evs if r == reason and has in m]
    assert len(found) == 1, (reason, has, evs)
    return found[0]


async def follow(rec: SwitchReconciler[str], node: NodeClient, label: str, value: str, state_label: str,
                 want: str, timeout: float = 20.0) -> None:
    """Set the label while the reconciler runs; wait until the apiserver shows ``want`` in the state."""
    node.patch_labels({label: value})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        view = await node.aget()
        if rec.last_value == value and view.labels.get(state_label) == want:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{state_label} is {view.labels.get(state_label)!r}, not {want!r} ({rec.last_error})")


def vfio_switch(tmp_path: Path) -> VfioSwitch:
    root = tmp_path / "root"
    root.mkdir()
    paths = HostPaths(root)
    sim = open_sim("l40s-x4")
    adapter = adapter_for_sim(sim, paths)
    return VfioSwitch(paths, adapter, PciSysfs(paths, after_write=pci_kernel(paths, "l40s-x4", None, sim.store)))


class CountingBudget:
    def __init__(self, deny: str = "") -> None:
        self.deny = deny
        self.granted: list[str] = []
        self.released: list[str] = []

    async def acquire(self, action: str) -> None:
        if self.deny:
            raise OperationError(self.deny)
        self.granted.append(action)

    async def release(self, action: str) -> None:
        self.released.append(action)


async def test_workload_config_both_ways(node: NodeClient, tmp_path: Path) -> None:
    sw = vfio_switch(tmp_path)
    budget = CountingBudget()
    rec = SwitchReconciler(node, sw, budget=budget)
    task = asyncio.create_task(rec.run())
    try:
        await follow(rec, node, WORKLOAD, "vm-passthrough", WORKLOAD_STATE, "vm-passthrough")
        assert sw.current() == "vm-passthrough"
        await follow(rec, node, WORKLOAD, "vm", WORKLOAD_STATE, "failed")
        assert sw.current() == "vm-passthrough"  # a bad value touches nothing
        await follow(rec, node, WORKLOAD, "container", WORKLOAD_STATE, "container")
        assert sw.current() == "container"
    finally:
        task.cancel()  # its Node watch stops with it, before the fixture deletes the Node
        with pytest.raises(asyncio.CancelledError):
            await task
    evs = events(node)
    assert [(r, t) for r, t, _ in evs] == [("WorkloadConfigApplied", "Normal"), ("WorkloadConfigApplied", "Normal"),
                                           ("WorkloadConfigFailed", "Warning")]
    message(evs, "WorkloadConfigApplied", "GPU(s) 0000:17:00.0, 0000:3d:00.0, 0000:97:00.0, 0000:bd:00.0 bound to vfio-pci")
    message(evs, "WorkloadConfigApplied", "container: GPU(s) ")
    message(evs, "WorkloadConfigFailed", "nvidia.com/gpu.workload.config has the value 'vm'")
    assert budget.granted == budget.released == [f"{WORKLOAD}=vm-passthrough", f"{WORKLOAD}=container"]


async def test_waits_for_pods_then_gives_up_untouched(node: NodeClient, tmp_path: Path) -> None:
    sw = vfio_switch(tmp_path)

    async def holders(gpu_indices: frozenset[int]) -> Mapping[int, tuple[Holder, ...]]:
        return {1: ("ml/train",)}

    rec = SwitchReconciler(node, sw, holders=holders,
                           options=SwitchOptions(release_timeout_s=0.3, release_poll_s=0.05))
    assert await rec.reconcile("vm-passthrough") == "failed"
    assert sw.current() == "container"
    evs = events(node)
    assert [r for r, _, _ in evs] == ["WorkloadConfigFailed", "WorkloadConfigWaitingForPods"]
    failed = message(evs, "WorkloadConfigFailed", "GPU 1 is held by pod ml/train")
    assert "nothing was changed" in failed
    assert (await node.aget()).labels[WORKLOAD_STATE] == "failed"


async def test_budget_denial_changes_nothing(node: NodeClient, tmp_path: Path) -> None:
    sw = vfio_switch(tmp_path)
    rec = SwitchReconciler(node, sw, budget=CountingBudget(deny="fleet budget: 2 of 2 nodes disrupted"))
    assert await rec.reconcile("vm-passthrough") == "failed"
    assert sw.current() == "container"
    assert "fleet budget: 2 of 2 nodes disrupted" in events(node)[-1][2]


async def test_cc_mode_labels_and_tee_refusal(node: NodeClient, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    paths = HostPaths(root)
    state = tmp_path / "sim.json"
    adapter = adapter_for_sim(open_sim("h100-nvl", state), paths)
    pci_kernel(paths, "h100-nvl", state)  # lays out the simulated host's sysfs (the CPU's TEE)
    tool, env = cc_tool(paths, "h100-nvl", state)
    sw = CcSwitch(paths, adapter, tool, env)
    rec = SwitchReconciler(node, sw)
    assert await rec.reconcile("on") == "on"
    labels = (await node.aget()).labels
    assert (labels["nvidia.com/cc.mode.state"], labels["nvidia.com/cc.ready.state"]) == ("on", "true")
    assert await rec.reconcile("off") == "off"
    labels = (await node.aget()).labels
    assert (labels["nvidia.com/cc.mode.state"], labels["nvidia.com/cc.ready.state"]) == ("off", "false")
    paths("/sys/module/kvm_amd/parameters/sev_snp").write_text("N\n")
    assert await rec.reconcile("devtools") == "failed"
    assert sw.current() == "off"
    labels = (await node.aget()).labels
    assert (labels["nvidia.com/cc.mode.state"], labels["nvidia.com/cc.ready.state"]) == ("failed", "")
    evs = events(node)
    assert [(r, t) for r, t, _ in evs] == [("CcModeApplied", "Normal"), ("CcModeApplied", "Normal"),
                                           ("CcModeFailed", "Warning")]
    message(evs, "CcModeApplied", "CC mode off → on")
    message(evs, "CcModeApplied", "CC mode on → off")
    message(evs, "CcModeFailed", "nvidia.com/cc.mode=devtools refused: the CPU has no TEE enabled")
