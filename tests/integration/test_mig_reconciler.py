"""Label-driven MIG reconfiguration against the real kube-apiserver (and the kubelet device manager).

GPUs are the NVML simulator; the Node, its labels and Events live in a real kube-apiserver; the
device-plugin resources are judged by the kubelet's own device-manager code in the harness.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from nodeagent.daemon.shared import GpuChanges
from nodeagent.gpu.inventory import Inventory
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.kube.client import KubeClient
from nodeagent.kube.node import NodeClient, NodeView
from nodeagent.mig.apply import MigStateFile
from nodeagent.mig.reconciler import (
    CONFIG_LABEL,
    GENERATION_ANNOTATION,
    STATE_LABEL,
    MigReconciler,
    MigReconcilerOptions,
)
from nodeagent.nvmlsource import adapter_for_sim
from nodeagent.simulator import inject
from nodeagent.simulator.open import open_sim
from nodeagent.simulator.state import SimStore
from tests.peers import KubeApiServer, KubeletHarness

TERMINAL = {"success", "failed", "rebooting"}


class RecordingPublisher:
    """Stands in for the device-plugin service where only the calls matter."""

    def __init__(self, changes: GpuChanges | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.changes = changes
        self.in_change: list[bool] = []  # at each update/readvertise: whether a GPU change was marked running

    async def withdraw(self, gpu_indices: set[int]) -> None:
        self.calls.append(("withdraw", sorted(gpu_indices)))

    async def readvertise(self, gpu_indices: set[int]) -> None:
        self.calls.append(("readvertise", sorted(gpu_indices)))
        self._note()

    async def update(self, inventory: Inventory) -> None:
        self.calls.append(("update", sum(len(g.mig_devices) for g in inventory.gpus)))
        self._note()

    def _note(self) -> None:
        if self.changes is not None:
            self.in_change.append(self.changes.mark() is None)


@pytest.fixture
def node(kube_apiserver: KubeApiServer, request: pytest.FixtureRequest) -> Iterator[NodeClient]:
    from kubernetes import client as k8s

    name = "mig-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:50]
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


class StateLog:
    """Every value of the state label the apiserver hands out, through a real watch."""

    def __init__(self, node: NodeClient) -> None:
        self.values: list[str] = []
        self._cond = threading.Condition()
        self._watch = node.watch(self._on)

    def _on(self, view: NodeView) -> None:
        v = view.labels.get(STATE_LABEL)
        with self._cond:
            if v and (not self.values or self.values[-1] != v):
                self.values.append(v)
            self._cond.notify_all()

    def stop(self) -> None:
        self._watch.stop()


def sim(machine: str) -> tuple[NvmlAdapter, SimStore]:
    nvml = open_sim(machine)
    return adapter_for_sim(nvml), nvml.store


async def run_until_terminal(rec: MigReconciler, node: NodeClient, timeout: float = 20.0) -> str:
    """Run the reconciler loop until it has written a terminal state for the current label value."""
    task = asyncio.create_task(rec.run())
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            await asyncio.sleep(0.05)
            if task.done():
                task.result()
            if rec.last_state in TERMINAL:
                view = await node.aget()
                if view.labels.get(STATE_LABEL) == rec.last_state:
                    return rec.last_state
        raise AssertionError(f"no terminal state within {timeout}s (last {rec.last_state})")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def layout(adapter: NvmlAdapter) -> dict[int, list[tuple[str, int]]]:
    return {g.index: sorted((d.profile, d.placement_start) for d in g.mig_devices) for g in adapter.discover().gpus}


def events(node: NodeClient) -> list[tuple[str, str, str]]:
    return [(e["reason"], e["type"], e["message"]) for e in node.list_events()]


async def test_label_pending_to_success(node: NodeClient, tmp_path: Path) -> None:
    adapter, _ = sim("dgx-a100-40gb")
    changes = GpuChanges()  # the daemon's: a resync's discovery overlapping the apply is not published
    pub = RecordingPublisher(changes)
    log = StateLog(node)
    try:
        node.patch_labels({CONFIG_LABEL: "all-balanced"})
        rec = MigReconciler(node, adapter, tmp_path, publisher=pub, changing=changes.changing)
        assert await run_until_terminal(rec, node) == "success"
    finally:
        log.stop()
    assert log.values == ["pending", "success"]
    assert pub.in_change and all(pub.in_change) and changes.mark() == changes.generation > 0
    assert all(v == [("1g.5gb", 2), ("1g.5gb", 3), ("2g.10gb", 0), ("3g.20gb", 4)] for v in layout(adapter).values())
    assert pub.calls[0] == ("withdraw", list(range(8)))
    assert pub.calls[-2:] == [("update", 32), ("readvertise", list(range(8)))]
    reasons = [e[0] for e in events(node)]
    assert "MigConfigApplied" in reasons
    assert MigStateFile(tmp_path).load()["phase"] == "success"  # type: ignore[index]


async def test_unknown_config_fails_with_event_and_touches_nothing(node: NodeClient, tmp_path: Path) -> None:
    adapter, store = sim("dgx-a100-40gb")
    inject.write_mig_layout(store, 0, ["7g.40gb"])
    before = layout(adapter)
    pub = RecordingPublisher()
    node.patch_labels({CONFIG_LABEL: "all-3g.99gb"})
    rec = MigReconciler(node, adapter, tmp_path, publisher=pub)
    assert await run_until_terminal(rec, node) == "failed"
    assert layout(adapter) == before
    assert pub.calls == []
    (_reason, type_, message), = [e for e in events(node) if e[0] == "MigConfigFailed"]
    assert type_ == "Warning"
    assert "no config named 'all-3g.99gb' (known: all-disabled, all-enabled, all-balanced" in message


async def test_config_file_and_layout_that_cannot_fit(node: NodeClient, tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\nmig-configs:\n  too-big:\n    - devices: [0]\n      mig-enabled: true\n"
                   "      mig-devices: {3g.20gb: 2, 1g.5gb: 1}\n")
    adapter, _ = sim("dgx-a100-40gb")
    node.patch_labels({CONFIG_LABEL: "too-big"})
    rec = MigReconciler(node, adapter, tmp_path / "state", options=MigReconcilerOptions(config_file=cfg))
    assert await run_until_terminal(rec, node) == "failed"
    msg = next(e[2] for e in events(node) if e[0] == "MigConfigFailed")
    assert "need 9 memory slices but NVIDIA A100-SXM4-40GB has 8" in msg


async def test_failure_midway_rolls_back_and_ends_failed(node: NodeClient, tmp_path: Path) -> None:
    adapter, store = sim("dgx-h100")
    inject.write_mig_layout(store, 1, ["7g.80gb"])
    before = layout(adapter)
    inject.fail_next(store, "nvmlDeviceCreateGpuInstanceWithPlacement", int(pynvml.NVML_ERROR_UNKNOWN), after=4)
    pub = RecordingPublisher()
    node.patch_labels({CONFIG_LABEL: "all-3g.40gb"})
    rec = MigReconciler(node, adapter, tmp_path, publisher=pub)
    assert await run_until_terminal(rec, node) == "failed"
    assert layout(adapter) == before
    # the restored layout is advertised again, the withdrawn GPUs listed again
    assert pub.calls[-2:] == [("update", 1), ("readvertise", [0, 1, 2, 3, 4, 5, 6, 7])]
    msg = next(e[2] for e in events(node) if e[0] == "MigConfigFailed")
    assert "restored to their previous layout" in msg


async def test_restart_mid_way_ends_terminal(node: NodeClient, tmp_path: Path) -> None:
    """An agent killed while applying leaves `pending`, a half-made layout and its state file behind;
    the next agent finishes the job."""
    adapter, store = sim("dgx-a100-80gb")
    inject.write_mig_layout(store, 0, ["3g.40gb"])  # half of all-3g.40gb on GPU 0
    MigStateFile(tmp_path).update(config="all-3g.40gb", phase="applying", touched=[0, 1])
    node.patch_labels({CONFIG_LABEL: "all-3g.40gb", STATE_LABEL: "pending"})
    rec = MigReconciler(node, adapter, tmp_path)
    assert await run_until_terminal(rec, node) == "success"
    assert all(v == [("3g.40gb", 0), ("3g.40gb", 4)] for v in layout(adapter).values())
    # Same value again (e.g. after the restart) with everything in place: success without touching GPUs.
    uuids = {d.uuid for g in adapter.discover().gpus for d in g.mig_devices}
    rec2 = MigReconciler(node, adapter, tmp_path)
    assert await run_until_terminal(rec2, node) == "success"
    assert {d.uuid for g in adapter.discover().gpus for d in g.mig_devices} == uuids


async def test_generation_annotation_reapplies_same_value(node: NodeClient, tmp_path: Path) -> None:
    adapter, store = sim("a30x4")
    node.patch_labels({CONFIG_LABEL: "all-2g.12gb"})
    rec = MigReconciler(node, adapter, tmp_path)
    task = asyncio.create_task(rec.run())
    try:
        for _ in range(200):
            await asyncio.sleep(0.05)
            if rec.last_state == "success":
                break
        assert rec.last_state == "success"
        inject.write_mig_layout(store, 2, ["4g.24gb"])  # someone changed GPU 2 by hand
        rec.last_state = None
        await node.apatch_labels({})  # nothing: same key, no reconcile
        node.patch_metadata(annotations={GENERATION_ANNOTATION: "2"})
        for _ in range(200):
            await asyncio.sleep(0.05)
            if rec.last_state == "success":
                break
        assert rec.last_state == "success"
        assert layout(adapter)[2] == [("2g.12gb", 0), ("2g.12gb", 2)]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_reboot_required_then_resume_after_boot(node: NodeClient, tmp_path: Path) -> None:
    adapter, store = sim("dgx-a100-40gb")
    for i in range(8):  # a held device keeps the mode change pending; the reset that would apply it fails
        inject.hold_device(store, i, "nvidia-persistenced")
    inject.fail_next(store, "simResetGpu", int(pynvml.NVML_ERROR_RESET_REQUIRED), count=8)
    reboots: list[int] = []

    def reboot() -> None:  # the reboot adapter: here the simulated host reboots
        reboots.append(1)
        inject.reboot(store)

    def boot_id() -> str:
        return str(store.read()["boot"])

    node.patch_labels({CONFIG_LABEL: "all-7g.40gb"})
    opts = MigReconcilerOptions(with_reboot=True)
    rec = MigReconciler(node, adapter, tmp_path, options=opts, reboot=reboot, boot_id=boot_id)
    assert await run_until_terminal(rec, node) == "rebooting"
    assert reboots == [1]
    assert MigStateFile(tmp_path).load()["phase"] == "rebooting"  # type: ignore[index]
    # After the boot a new agent resumes the persisted selection and finishes.
    adapter2 = adapter_for_sim(open_sim_from(store))
    rec2 = MigReconciler(node, adapter2, tmp_path, options=opts, reboot=reboot, boot_id=boot_id)
    assert await run_until_terminal(rec2, node) == "success"
    assert reboots == [1]
    assert all(v == [("7g.40gb", 0)] for v in layout(adapter2).values())


def open_sim_from(store: SimStore) -> Any:
    from nodeagent.simulator.nvml import SimulatedNvml

    return SimulatedNvml(store)


async def test_label_change_advertises_new_resources_at_kubelet(
    node: NodeClient, tmp_path: Path, kubelet_harness: KubeletHarness
) -> None:
    from nodeagent.deviceplugin.service import DevicePluginService
    from nodeagent.sharing.spec import parse_plugin_config

    adapter, _ = sim("dgx-h100")
    plugin_cfg = parse_plugin_config("version: v1\nflags:\n  migStrategy: mixed\n", source="plugin.yaml")
    svc = DevicePluginService(plugin_dir=kubelet_harness.plugin_dir, plugin_config=plugin_cfg)
    await svc.start(adapter.discover())
    try:
        await asyncio.to_thread(kubelet_harness.wait, "nvidia.com/gpu", total=8, registered=True)
        node.patch_labels({CONFIG_LABEL: "all-3g.40gb"})
        rec = MigReconciler(node, adapter, tmp_path, publisher=svc)
        assert await run_until_terminal(rec, node) == "success"
        _, res = await asyncio.to_thread(kubelet_harness.wait, "nvidia.com/mig-3g.40gb", total=16, healthy=16)
        assert len(res.devices) == 16
    finally:
        await svc.stop()


async def test_restart_after_kill_mid_apply_restores_then_applies(node: NodeClient, tmp_path: Path) -> None:
    """An agent died between creating a GPU instance and its compute instance: the next agent first brings
    the half-built GPUs back to their checkpoint, then applies the selected config and ends `success`."""
    from nodeagent.mig.apply import Applier
    from nodeagent.mig.planner import plan
    from nodeagent.mig.spec import generate_standard, resolve
    from tests.unit.test_mig_recovery import DyingAdapter, Killed

    adapter, store = sim("dgx-h100")
    for i in range(8):
        inject.write_mig_layout(store, i, ["3g.40gb", "3g.40gb"])
    inv = adapter.discover()
    configs = generate_standard(inv)
    name, entries = configs.select("all-1g.10gb")
    the_plan = plan(inv, resolve(name, entries, inv, configs.source))
    unknown = int(pynvml.NVML_ERROR_UNKNOWN)
    inject.fail_next(store, "nvmlGpuInstanceCreateComputeInstance", unknown, after=9)
    inject.fail_next(store, "nvmlGpuInstanceDestroy", unknown, after=16)  # the 16 planned destroys succeed
    with pytest.raises(Killed):
        Applier(DyingAdapter(adapter, "create", 10, "inside"), state=MigStateFile(tmp_path)).apply(the_plan, inv)
    inject.recover(store)
    assert len(adapter.discover().gpu(1).bare_gpu_instances) == 1
    node.patch_labels({CONFIG_LABEL: "all-1g.10gb", STATE_LABEL: "pending"})
    pub = RecordingPublisher()
    rec = MigReconciler(node, adapter, tmp_path, publisher=pub)
    assert await run_until_terminal(rec, node) == "success"
    assert all(v == [("1g.10gb", s) for s in range(7)] for v in layout(adapter).values())
    assert not any(g.bare_gpu_instances for g in adapter.discover().gpus)
    assert pub.calls[0] == ("withdraw", list(range(8)))
    recovered = [e for e in events(node) if e[0] == "MigApplyRecovered"]
    assert recovered and "restored GPU 1, 2, 3, 4, 5, 6, 7 to the previous layout" in recovered[0][2]
    assert "GPU 0 already complete in the new layout" in recovered[0][2]
    assert MigStateFile(tmp_path).inflight() == []


@pytest.mark.parametrize("value", ["", "all-balanced-typo", "ALL.DISABLED"])
async def test_bad_label_values_end_failed_with_an_event_naming_the_value(
    node: NodeClient, tmp_path: Path, value: str
) -> None:
    """Refused input: a value that names no config (or is empty) ends `failed`, never `pending`, with a
    Warning Event quoting the value; no GPU and no device-plugin resource is touched."""
    adapter, store = sim("a30x4")
    inject.write_mig_layout(store, 1, ["4g.24gb"])
    before = {g.index: [(d.uuid, d.profile) for d in g.mig_devices] for g in adapter.discover().gpus}
    pub = RecordingPublisher()
    log = StateLog(node)
    try:
        node.patch_labels({CONFIG_LABEL: value})
        results: list[tuple[str, float]] = []
        rec = MigReconciler(node, adapter, tmp_path, publisher=pub, on_result=lambda r, t: results.append((r, t)))
        assert await run_until_terminal(rec, node) == "failed"
    finally:
        log.stop()
    assert [r for r, _ in results] == ["failed"] and 0 < results[0][1] < 20  # what the metrics observe
    assert log.values[-1] == "failed" and "success" not in log.values
    assert {g.index: [(d.uuid, d.profile) for d in g.mig_devices] for g in adapter.discover().gpus} == before
    assert pub.calls == []
    uid = node.get().uid  # the node name is reused by each parameter: only this Node's events count
    (type_, message), = [(e["type"], e["message"]) for e in node.list_events()
                         if e["reason"] == "MigConfigFailed" and e["involvedObject"]["uid"] == uid]
    assert type_ == "Warning"
    assert message.startswith(f"MIG config {value!r} failed: ")
    if value:
        assert f"no config named {value!r} (known: all-disabled, all-enabled, all-balanced" in message
    else:
        assert "label nvidia.com/mig.config has the empty value ''" in message
        assert "(known: all-disabled, all-enabled, all-balanced" in message


async def test_absent_label_is_no_request(node: NodeClient, tmp_path: Path) -> None:
    adapter, _ = sim("a30x4")
    rec = MigReconciler(node, adapter, tmp_path)
    assert await rec.reconcile(await node.aget()) is None
    uid = node.get().uid
    assert STATE_LABEL not in node.get().labels
    assert [e for e in node.list_events() if e["involvedObject"]["uid"] == uid] == []


async def test_touched_gpus_withdrawn_at_kubelet_untouched_keep_serving(
    node: NodeClient, tmp_path: Path, kubelet_harness: KubeletHarness
) -> None:
    """pending → success on half the GPUs: the kubelet sees exactly the touched GPUs' devices withdrawn while the
    plugin stays registered (no re-registration, the untouched four never leave), then the new MIG resources."""
    from nodeagent.deviceplugin.service import DevicePluginService
    from nodeagent.sharing.spec import parse_plugin_config

    adapter, _ = sim("dgx-h100")
    inv = adapter.discover()
    untouched = {g.uuid for g in inv.gpus if g.index >= 4}
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\nmig-configs:\n  half:\n    - devices: [0, 1, 2, 3]\n      mig-enabled: true\n"
                   "      mig-devices: {3g.40gb: 2}\n")
    plugin_cfg = parse_plugin_config("version: v1\nflags:\n  migStrategy: mixed\n", source="plugin.yaml")
    svc = DevicePluginService(plugin_dir=kubelet_harness.plugin_dir, plugin_config=plugin_cfg)
    await svc.start(inv)
    log = StateLog(node)
    try:
        await asyncio.to_thread(kubelet_harness.wait, "nvidia.com/gpu", total=8, registered=True)
        seq = max(u.seq for u in kubelet_harness.updates())
        node.patch_labels({CONFIG_LABEL: "half"})
        rec = MigReconciler(node, adapter, tmp_path / "state", publisher=svc,
                            options=MigReconcilerOptions(config_file=cfg))
        assert await run_until_terminal(rec, node) == "success"
        _, mig = await asyncio.to_thread(kubelet_harness.wait, "nvidia.com/mig-3g.40gb", total=8, healthy=8)
        _, gpu = await asyncio.to_thread(kubelet_harness.wait, "nvidia.com/gpu", total=4, registered=True)
    finally:
        log.stop()
        await svc.stop()
    assert log.values == ["pending", "success"]
    assert {d.id for d in gpu.devices} == untouched
    seen = [u.resource for u in kubelet_harness.updates("nvidia.com/gpu", since=seq)]
    assert seen and all(r.registered for r in seen)  # withdrawn, not unregistered: the plugin kept serving
    assert all(untouched <= {d.id for d in r.devices} for r in seen)  # the untouched GPUs never left
    assert {d.id for d in seen[0].devices} == untouched  # the first change is the withdrawal of GPUs 0-3
    assert len(mig.devices) == 8


async def test_waits_for_the_pods_holding_a_changing_gpu_then_applies(node: NodeClient, tmp_path: Path) -> None:
    """Holders seen twice, then gone: one MigWaitingForPods Event naming them, then the apply; the state
    hook saw every value the label got."""
    adapter, _ = sim("dgx-a100-40gb")
    pub = RecordingPublisher()
    asked: list[frozenset[int]] = []

    async def holders(gpu_indices: frozenset[int]) -> dict[int, tuple[str, ...]]:
        asked.append(gpu_indices)
        # GPU 9 is not one of the changing GPUs: never waited for
        return {0: ("ml/a", "ml/b"), 9: ("x/y",)} if len(asked) <= 2 else {9: ("x/y",)}

    states: list[str] = []
    node.patch_labels({CONFIG_LABEL: "all-balanced"})
    rec = MigReconciler(node, adapter, tmp_path, publisher=pub, holders=holders, on_state=states.append,
                        options=MigReconcilerOptions(release_timeout_s=30, release_poll_s=0.05))
    assert await run_until_terminal(rec, node) == "success"
    assert states == ["pending", "success"]
    # the seven free GPUs are changed at the first answer, GPU 0 alone is asked about until it is free
    assert asked == [frozenset(range(8)), frozenset({0}), frozenset({0})]
    assert pub.calls[0] == ("withdraw", list(range(8)))  # withdrawn before the first question
    # GPUs 1-7 listed again in their new layout while GPU 0 stayed withdrawn, then GPU 0 with them
    assert pub.calls[1:] == [("update", 28), ("readvertise", list(range(1, 8))),
                             ("update", 32), ("readvertise", list(range(8)))]
    waiting = [e for e in events(node) if e[0] == "MigWaitingForPods"]
    assert waiting == [("MigWaitingForPods", "Normal",
                        "MIG config all-balanced waits up to 30s: GPU 0 is held by pods ml/a, ml/b")]
    assert all(v for v in layout(adapter).values())


async def test_pods_never_let_go_or_kubelet_silent_ends_failed_changing_only_what_was_free(
    node: NodeClient, tmp_path: Path
) -> None:
    """A kubelet that never answers: no GPU counts as free, nothing changes. A pod that never lets GPU 3 go:
    the seven free GPUs are changed, GPU 3 is not; both end ``failed`` with every GPU listed again."""
    from nodeagent.errors import KubeletError

    adapter, _ = sim("dgx-a100-40gb")
    before = layout(adapter)
    for attempt, answer in enumerate(("silent", "held")):
        pub = RecordingPublisher()

        async def holders(gpu_indices: frozenset[int], answer: str = answer) -> dict[int, tuple[str, ...]]:
            if answer == "silent":
                raise KubeletError("PodResources List on /k.sock failed: UNAVAILABLE", subject="/k.sock")
            return {3: ("ml/train",)}

        node.patch_labels({CONFIG_LABEL: "all-balanced"})
        node.patch_metadata(annotations={GENERATION_ANNOTATION: str(attempt)})
        rec = MigReconciler(node, adapter, tmp_path, publisher=pub, holders=holders,
                            options=MigReconcilerOptions(release_timeout_s=0.3, release_poll_s=0.05))
        assert await run_until_terminal(rec, node) == "failed"
        assert pub.calls[0] == ("withdraw", list(range(8)))
        assert pub.calls[-1] == ("readvertise", list(range(8)))  # every GPU listed again
        now = layout(adapter)
        if answer == "silent":
            assert now == before  # nothing applied, nothing reset
            assert pub.calls[-2] == ("update", 0)  # advertised again as they were
        else:
            assert now[3] == before[3]  # the held GPU untouched
            assert all(now[i] == [("1g.5gb", 2), ("1g.5gb", 3), ("2g.10gb", 0), ("3g.20gb", 4)]
                       for i in range(8) if i != 3)
            assert pub.calls[-2] == ("update", 28)
    failed = sorted(e[2] for e in events(node) if e[0] == "MigConfigFailed")
    assert failed == [
        "MIG config 'all-balanced' failed: GPU 3 is held by pod ml/train after waiting 0.3s for the GPU(s) to be "
        "released; GPU(s) 0, 1, 2, 4, 5, 6, 7 were changed, GPU(s) 3 were not",
        "MIG config 'all-balanced' failed: pod use unknown (PodResources List on /k.sock failed: UNAVAILABLE) "
        "after waiting 0.3s for the GPU(s) to be released; nothing was changed",
    ]
