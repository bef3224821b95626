"""Remediation with the DRA plane alone (no device plugin), on the real kube-apiserver of every release the suite
has (1.34 and 1.35 with DRADeviceTaints on, 1.36 and 1.37 where device taints are beta): an XID reaches the plane's own health monitor, the remediation holds the GPU out, its
device stays in the node's ResourceSlice with the taint ``gpu.nodeagent.io/remediation`` while the GPU is out,
loses it once the GPU is reset and offered; a GPU that cannot be reset stays out, tainted NoExecute (the
policy ``noexecute_when_out``), and the Node says a reboot is required. Where the server drops device taints the
held GPU's devices leave the slices instead."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.config import AgentConfig, RemediationSettings, SimulateSettings
from nodeagent.daemon.components.remediation import RemediationComponent
from nodeagent.daemon.shared import DraLink
from nodeagent.dra.component import DraComponent
from nodeagent.dra.slices import REMEDIATION_TAINT_KEY, UNHEALTHY_TAINT_KEY
from nodeagent.gpu.health import HealthMonitorSettings
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient
from nodeagent.nvmlsource import open_nvml
from nodeagent.simulator import inject
from nodeagent.simulator.machine import load_machine
from nodeagent.simulator.state import SimStore
from tests.integration._releases import shared_release_apiserver
from tests.integration.test_dra_kubelet import poll
from tests.integration.test_dra_slices import slices_of
from tests.integration.test_dra_withdraw import Plane as WithdrawPlane
from tests.unit.test_remediation_component import FakeCtx, FakePodResources, NoPlugin

pytestmark = pytest.mark.peers
kube_apiserver = shared_release_apiserver  # every test once per Kubernetes release, on servers shared with others


class Plane(WithdrawPlane):
    """test_dra_withdraw's plane, with the remediation's hold-out, offer-again and the plane's own monitor."""

    async def hold_out(self, gpu_indices: set[int], reason: str, effect: str) -> None:
        await self.dra.hold_out(gpu_indices, reason, effect)

    async def offer_again(self, gpu_indices: set[int]) -> None:
        await self.dra.offer_again(gpu_indices)

    def monitor(self) -> Any:
        return self.dra.monitor


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rdra-", dir="/tmp"))  # socket paths must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def taints_of(kube: KubeClient, node: str, device: str) -> dict[str, str] | None:
    """Taint key → effect of ``device`` in the node's slices; None when the device is not listed."""
    for s in slices_of(kube, node):
        for d in s["spec"]["devices"]:
            if d["name"] == device:
                return {t["key"]: t["effect"] for t in d.get("taints", [])}
    return None


def node_condition(kube: KubeClient, node: str, kind: str) -> dict[str, Any]:
    obj = kube.request("GET", f"/api/v1/nodes/{node}", action="read the node")
    found: dict[str, Any] = {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}.get(kind, {})
    return found


async def test_dra_plane_alone_an_xid_taints_the_device_while_the_gpu_is_out(
        kube: KubeClient, node_name: str, root: Path) -> None:
    state = root / "sim.json"
    nvml = open_nvml("dgx-h100", state, HostPaths(root))
    store = SimStore(load_machine("dgx-h100"), state)
    cfg = dataclasses.replace(AgentConfig(), simulate=SimulateSettings(machine="dgx-h100"),
                              remediation=RemediationSettings(enabled=True, evictions="direct", step_timeout=10.0,
                                                              noexecute_when_out=True))
    dra = DraComponent(paths=HostPaths(root), kube=kube, node_name=node_name, nvml=nvml, verify_interval_s=60,
                       health_settings=HealthMonitorSettings.from_env({}, recovery_window_s=60.0,
                                                                      poll_interval_s=0.2))
    link = DraLink()
    try:
        await dra.start(nvml.discover())
        link.attach(Plane(dra))
        await dra.wait_published()
        assert taints_of(kube, node_name, "gpu-3") == {}
        ctx = FakeCtx(root, cfg, nvml, kube, NoPlugin(), FakePodResources([]), node=node_name, dra=link)
        comp = RemediationComponent(ctx)  # type: ignore[arg-type]
        await comp.start(ctx)  # type: ignore[arg-type]
        assert dra.monitor is not None and comp._on_xid in dra.monitor.xid_listeners

        # a process still on GPU 3 (no pod owns it): the run waits at stop-users, the GPU out meanwhile
        inject.inject_process(store, 3, 4242, "python")
        began = time.monotonic()
        inject.inject_xid(store, 3, 48, recovery_action=1)
        out = await poll(lambda: (lambda t: t if t and REMEDIATION_TAINT_KEY in t else None)(
            taints_of(kube, node_name, "gpu-3")), "gpu-3 tainted by the remediation")
        tainted_in = time.monotonic() - began
        assert out == {UNHEALTHY_TAINT_KEY: "NoSchedule", REMEDIATION_TAINT_KEY: "NoSchedule"}, out
        assert node_condition(kube, node_name, "nodeagent.io/GPURemediation")["status"] == "True"
        # the other GPUs' devices untouched
        assert all(taints_of(kube, node_name, f"gpu-{i}") == {} for i in (0, 1, 2, 4, 5, 6, 7))
        # a claim for GPU 3 would not be prepared meanwhile either
        assert dra.preparer is not None and 3 in dra.preparer.withdrawn
        inject.kill_process(store, 3, 4242)  # the user ends: reset, check, offer
        await poll(lambda: node_condition(kube, node_name, "nodeagent.io/GPURemediation")["status"] == "False",
                   "the remediation ends")
        back = await poll(lambda: (lambda t: t is not None and REMEDIATION_TAINT_KEY not in t
                                   and UNHEALTHY_TAINT_KEY not in t)(taints_of(kube, node_name, "gpu-3")),
                          "gpu-3 untainted")
        assert back and nvml.recovery_action_of(ctx.inventory.gpus[3].uuid) == 0
        assert 3 not in dra.preparer.withdrawn
        done_in = time.monotonic() - began

        # GPU 5's reset fails: it stays out, NoExecute, and the Node says a reboot is required
        inject.fail_next(store, "simResetGpu", 999)
        inject.inject_xid(store, 5, 48, recovery_action=1)
        await poll(lambda: node_condition(kube, node_name, "nodeagent.io/RebootRequired").get("status") == "True",
                   "RebootRequired")
        cond = node_condition(kube, node_name, "nodeagent.io/RebootRequired")
        assert cond["reason"] == "GPURecoveryFailed" and ctx.inventory.gpus[5].uuid in cond["message"], cond
        out = await poll(lambda: (lambda t: t if t and t.get(REMEDIATION_TAINT_KEY) == "NoExecute" else None)(
            taints_of(kube, node_name, "gpu-5")), "gpu-5 NoExecute")
        assert out[UNHEALTHY_TAINT_KEY] == "NoSchedule", out
        # an API server that drops device taints (DRADeviceTaints off before 1.36), as the dry run would say:
        # the held GPU's devices leave the slices instead, and come back when it is offered
        dra.publisher.taints = False
        await dra.hold_out({1}, "reset-gpu")
        await poll(lambda: taints_of(kube, node_name, "gpu-1") is None, "gpu-1 left out")
        assert 1 in dra.preparer.withdrawn
        await dra.offer_again({1})
        assert await poll(lambda: taints_of(kube, node_name, "gpu-1") == {}, "gpu-1 listed again")
        print(f"DRA alone: XID → device tainted {tainted_in:.2f}s; → untainted again {done_in:.2f}s")
        for t in ctx.tasks:
            t.cancel()
    finally:
        await dra.stop()
        nvml.close()
