"""Connections inside the daemon and bootstrap: the metrics default and a port in use, pod names for busy
GPUs (kubelet checkpoint + PodResources), MIG/publish metrics, the runtime Event of ``bootstrap``."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from nodeagent.bootstrap import BootstrapParts, Options, Outcome, StepResult, bootstrap
from nodeagent.config import AgentConfig, apply_overrides, parse_config
from nodeagent.daemon import ComponentSpec, Context, Daemon, default_specs
from nodeagent.daemon.components.metrics import MetricsComponent
from nodeagent.errors import KubeError, KubeletError, RuntimeConfigError
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.podnames import CheckpointEntry, PodNameLookup, parse_checkpoint, pod_names
from nodeagent.kube.podresources import Assignment
from nodeagent.sdnotify import Notifier
from tests.unit._gpu import QuietGpus

# -- metrics default ----------------------------------------------------------------------------------


class _Kube:
    """An API client that answered (bootstrap closes it at the end)."""

    def close(self) -> None:
        pass


def test_metrics_default_is_localhost_and_empty_turns_it_off() -> None:
    assert AgentConfig().metrics.address == "127.0.0.1:9400"
    assert parse_config('[metrics]\naddress = ""\n', "c.toml").metrics.address == ""
    assert apply_overrides(AgentConfig(), {"metrics.address": ""}).metrics.address == ""
    spec = {s.name: s for s in default_specs()}["metrics"]

    class Ctx:
        config = apply_overrides(AgentConfig(), {"metrics.address": ""})

    assert spec.build(Ctx()) is None  # type: ignore[arg-type]


class NoGpus(QuietGpus):
    """No GPUs at all."""


def _metrics_daemon(address: str) -> Daemon:
    cfg = apply_overrides(AgentConfig(), {"metrics.address": address, "kube": False})

    def build(ctx: Context) -> MetricsComponent:
        return MetricsComponent(ctx)

    return Daemon(cfg, HostPaths(Path("/nonexistent-root")), gpu_factory=lambda c, p: NoGpus(),
                  specs=[ComponentSpec("metrics", frozenset({"metrics"}), build)],
                  notifier=Notifier(None), ready_fallback=0.1)


async def test_port_in_use_is_one_error_the_agent_runs_on_and_binds_later(caplog: pytest.LogCaptureFixture) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    d = _metrics_daemon(f"127.0.0.1:{port}")
    caplog.set_level(logging.INFO)
    task = asyncio.create_task(d.run(install_signals=False))
    try:
        for _ in range(200):
            if "metrics" in d.components:
                break
            await asyncio.sleep(0.01)
        await d.resync()
        await d.resync()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [f"metrics: cannot listen on 127.0.0.1:{port}: Address already in use; running without "
                          "the metrics endpoint (retried at every resync; set [metrics] address to another "
                          'HOST:PORT, or "" for none)'], errors
        assert d.errors == {} and not task.done()  # the component runs (without its listener)
        assert "metrics: cannot listen on" in d.status_line()
        holder.close()
        await d.resync()
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
        assert "nodeagent_device_healthy" in body or "nodeagent_reconciles" in body
        assert any(f"metrics: 127.0.0.1:{port} is free again" in r.getMessage() for r in caplog.records)
    finally:
        holder.close()
        d.request_stop()
        await asyncio.wait_for(task, 6)


# -- pod names ----------------------------------------------------------------------------------------

UID = "5f0c7a9e-1111-2222-3333-444455556666"
CHECKPOINT = json.dumps({"Data": {"PodDeviceEntries": [
    {"PodUID": UID, "ContainerName": "main", "ResourceName": "nvidia.com/gpu",
     "DeviceIDs": {"0": ["GPU-a"], "1": ["GPU-b"]}, "AllocResp": "x"},
    {"PodUID": "old-style", "ContainerName": "c", "ResourceName": "nvidia.com/mig-1g.10gb",
     "DeviceIDs": ["MIG-1"], "AllocResp": "x"},
    {"PodUID": "gone", "ContainerName": "c", "ResourceName": "nvidia.com/gpu", "DeviceIDs": {"0": ["GPU-z"]}},
], "RegisteredDevices": {}}, "Checksum": 1})


def test_checkpoint_parsed_in_both_device_id_forms_and_garbage_is_empty() -> None:
    entries = parse_checkpoint(CHECKPOINT)
    assert entries[0] == CheckpointEntry(UID, "main", "nvidia.com/gpu", frozenset({"GPU-a", "GPU-b"}))
    assert entries[1].device_ids == frozenset({"MIG-1"})
    assert parse_checkpoint("not json") == [] and parse_checkpoint("[]") == [] and parse_checkpoint("{}") == []


def test_uid_named_by_the_pod_holding_its_devices() -> None:
    assignments = [Assignment("ml", "train-0", "main", "nvidia.com/gpu", ("GPU-b",)),
                   Assignment("ml", "infer", "c", "nvidia.com/mig-1g.10gb", ("MIG-1",)),
                   Assignment("other", "same-id-other-resource", "c", "nvidia.com/gpu-shared", ("GPU-z",))]
    assert pod_names(parse_checkpoint(CHECKPOINT), assignments) == {UID: "ml/train-0", "old-style": "ml/infer"}


def test_lookup_reads_once_per_window_and_never_raises(tmp_path: Path) -> None:
    ckpt = tmp_path / "kubelet_internal_checkpoint"
    calls: list[int] = []
    now = [0.0]

    def listing() -> list[Assignment]:
        calls.append(1)
        if len(calls) == 3:
            raise KubeletError("PodResources List failed: UNAVAILABLE")
        return [Assignment("ml", "train-0", "main", "nvidia.com/gpu", ("GPU-a",))]

    lookup = PodNameLookup(ckpt, listing, max_age_s=2.0, clock=lambda: now[0])
    assert lookup(UID) is None and calls == []  # no checkpoint: no call to the kubelet at all
    ckpt.write_text(CHECKPOINT)
    now[0] = 5.0
    assert lookup(UID) == "ml/train-0" and lookup("gone") is None and lookup(UID) == "ml/train-0"
    assert len(calls) == 1
    now[0] = 10.0
    assert lookup(UID) == "ml/train-0" and len(calls) == 2
    now[0] = 15.0
    assert lookup(UID) is None and len(calls) == 3  # kubelet down: no name, no exception


# -- bootstrap's runtime Event ------------------------------------------------------------------------


def _parts(runtime: StepResult | Exception, restart: StepResult, recorded: list[tuple[str, str, bool]],
           connect_ok: bool = True) -> BootstrapParts:
    def configure(c: AgentConfig, p: HostPaths) -> StepResult:
        if isinstance(runtime, Exception):
            raise runtime
        return runtime

    def connect(c: AgentConfig, p: HostPaths) -> Any:
        if not connect_ok:
            raise KubeletError("API not there")
        return _Kube()

    def record(kube: Any, c: AgentConfig, component: str, message: str, ok: bool) -> str | None:
        recorded.append((component, message, ok))
        return "RuntimeConfigured" if ok else "RuntimeConfigureFailed"

    inv = Inventory("550.54.15", 12040, ())
    return BootstrapParts(
        discover=lambda c, p: inv,
        apply_mig=lambda c, p, i, n: StepResult(Outcome.UNCHANGED),
        configure_runtime=configure,
        restart_containerd=lambda c, p: restart,
        ensure_runtimeclass=lambda k, c: StepResult(Outcome.UNCHANGED),
        publish_labels=lambda k, c, p, i: StepResult(Outcome.UNCHANGED),
        connect=connect,
        record_event=record,
    )


P = HostPaths(Path("/"))
WROTE = StepResult(Outcome.CHANGED, "wrote /etc/containerd/conf.d/99-nvidia.toml (created)", {"restart_needed": True})
RESTARTED = StepResult(Outcome.CHANGED, "containerd answered 0.4s after the restart")


def test_runtime_change_is_one_normal_event_with_the_restart() -> None:
    recorded: list[tuple[str, str, bool]] = []
    report = bootstrap(AgentConfig(), P, Options(), _parts(WROTE, RESTARTED, recorded))
    assert recorded == [("runtime", "containerd wired for the NVIDIA runtime: wrote "
                         "/etc/containerd/conf.d/99-nvidia.toml (created); containerd answered 0.4s after the "
                         "restart", True)]
    assert report.events == ("RuntimeConfigured",) and report.to_dict()["events"] == ["RuntimeConfigured"]


def test_runtime_failures_are_warning_events() -> None:
    recorded: list[tuple[str, str, bool]] = []
    bad = RuntimeConfigError("/etc/containerd/config.toml: line 3: invalid TOML", subject="x")
    report = bootstrap(AgentConfig(), P, Options(), _parts(bad, RESTARTED, recorded))
    assert recorded == [("runtime", "containerd NVIDIA runtime wiring failed: /etc/containerd/config.toml: line 3: "
                         "invalid TOML", False)]
    assert report.events == ("RuntimeConfigureFailed",) and report.exit_code != 0
    recorded.clear()
    failed_restart = StepResult(Outcome.FAILED, "containerd did not answer")
    bootstrap(AgentConfig(), P, Options(), _parts(WROTE, failed_restart, recorded))
    assert recorded[0][2] is False and recorded[0][1].endswith("; restarting containerd failed: containerd did not "
                                                               "answer")


def test_no_event_when_unchanged_unreachable_or_events_off() -> None:
    recorded: list[tuple[str, str, bool]] = []
    report = bootstrap(AgentConfig(), P, Options(), _parts(StepResult(Outcome.UNCHANGED), RESTARTED, recorded))
    assert recorded == [] and report.events == () and "events" not in report.to_dict()
    bootstrap(AgentConfig(), P, Options(), _parts(WROTE, RESTARTED, recorded, connect_ok=False))
    bootstrap(AgentConfig(), P, Options(kube=False), _parts(WROTE, RESTARTED, recorded))
    off = apply_overrides(AgentConfig(), {"publish.events": False})
    bootstrap(off, P, Options(), _parts(WROTE, RESTARTED, recorded))
    assert recorded == []



def test_the_device_plugin_monitor_uses_the_daemons_event_pumps_across_reloads() -> None:
    from nodeagent.daemon.components.deviceplugin import DevicePluginComponent

    cfg = apply_overrides(AgentConfig(), {"kube": False, "metrics.address": ""})
    d = Daemon(cfg, HostPaths(Path("/nonexistent-root")), gpu_factory=lambda c, p: NoGpus(), specs=[],
               notifier=Notifier({}))
    first, second = DevicePluginComponent(d.ctx), DevicePluginComponent(d.ctx)
    assert first.service.monitor is not None and second.service.monitor is not None
    assert first.service.monitor.pumps is d.pumps and second.service.monitor.pumps is d.pumps
    assert first.service.monitor.source is d.gpu


async def test_the_publisher_closes_its_event_recorder_when_a_reload_replaces_it_and_at_shutdown() -> None:
    from nodeagent.daemon.components.publisher import PublisherComponent

    built: list[PublisherComponent] = []

    def publisher(ctx: Context) -> PublisherComponent:
        built.append(PublisherComponent(ctx))
        return built[-1]

    configs = [apply_overrides(AgentConfig(), {"metrics.address": ""})]
    d = Daemon(configs[0], HostPaths(Path("/nonexistent-root")), gpu_factory=lambda c, p: NoGpus(),
               kube_factory=lambda c: _Kube(), notifier=Notifier({}), reload_config=lambda: configs[-1],
               specs=[ComponentSpec("publisher", frozenset({"publish"}), publisher)], ready_fallback=0.1)
    task = asyncio.create_task(d.run(install_signals=False))
    try:
        for _ in range(100):
            if d._ready_sent:
                break
            await asyncio.sleep(0.05)
        assert len(built) == 1 and not built[0].publisher.events._closed
        configs.append(apply_overrides(configs[0], {"publish.events": False}))
        await d.reload()
        assert len(built) == 2 and built[0].publisher.events._closed and not built[1].publisher.events._closed
    finally:
        d.request_stop()
        await asyncio.wait_for(task, 5)
    assert built[1].publisher.events._closed


async def test_the_runtime_check_uses_the_kubelet_dir_and_logs_each_warning_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import nodeagent.runtime.configure as configure_mod
    from nodeagent.daemon.components.runtime import RuntimeCheckComponent
    from nodeagent.runtime.configure import Options as RuntimeOptions
    from nodeagent.runtime.configure import Result

    seen: list[RuntimeOptions] = []

    def configure(paths: HostPaths, opts: RuntimeOptions) -> Result:
        seen.append(opts)
        return Result(changed=False, restart_needed=False, mode="drop-in", dry_run=True,
                      warnings=["/etc/containerd/config.toml disables the CRI plugin"])

    monkeypatch.setattr(configure_mod, "configure", configure)
    cfg = apply_overrides(AgentConfig(), {"kube": False, "metrics.address": "", "kubelet.dir": "/data/kubelet",
                                          "runtime.check_interval": 0.0})
    d = Daemon(cfg, HostPaths(Path("/nonexistent-root")), gpu_factory=lambda c, p: NoGpus(), specs=[],
               notifier=Notifier({}))
    check = RuntimeCheckComponent(d.ctx)
    with caplog.at_level(logging.WARNING):
        await check.check()
        await check.check()
    assert [o.kubelet_dir for o in seen] == ["/data/kubelet"] * 2 and all(o.dry_run for o in seen)
    warned = [r.getMessage() for r in caplog.records if "disables the CRI plugin" in r.getMessage()]
    assert warned == ["runtime check: /etc/containerd/config.toml disables the CRI plugin"]
    assert check.drift is False


async def test_the_runtime_class_is_retried_at_each_resync_until_the_api_answers() -> None:

    from nodeagent.daemon.components.runtime import RuntimeCheckComponent
    from nodeagent.errors import KubeError

    class Api(_Kube):
        def __init__(self) -> None:
            self.up = False
            self.created: list[str] = []

        def request(self, method: str, path: str, **kw: Any) -> Any:
            if not self.up:
                raise KubeError("connection refused", retryable=True)
            if method == "GET":
                raise KubeError("not found", status=404)
            self.created.append(kw["body"]["metadata"]["name"])
            return {}

    api = Api()
    cfg = apply_overrides(AgentConfig(), {"metrics.address": "", "runtime.check_interval": 0.0})
    d = Daemon(cfg, HostPaths(Path("/nonexistent-root")), gpu_factory=lambda c, p: NoGpus(), specs=[],
               kube_factory=lambda c: api, notifier=Notifier({}))
    check = RuntimeCheckComponent(d.ctx)
    await check._runtime_class()  # the API is down at start: nothing created, nothing raised
    await check.resync()
    assert api.created == [] and not check.runtime_class_done
    api.up = True
    await check.resync()
    assert api.created == ["nvidia"] and check.runtime_class_done
    await check.resync()  # done: no more writes
    assert api.created == ["nvidia"]


# -- the slices an earlier run with DRA left (plane "device-plugin") -----------------------------------


class _SliceKube:
    """ResourceSlices in memory; ``fail`` raises that error at the next list and is then cleared."""

    def __init__(self, slices: dict[str, tuple[str, str]], fail: KubeError | None = None) -> None:
        self.slices = slices  # name → (node, driver)
        self.fail = fail
        self.lists = 0

    def list_resource_slices(self, *, field_selector: str | None = None) -> list[dict[str, Any]]:
        self.lists += 1
        if self.fail is not None:
            e, self.fail = self.fail, None
            raise e
        wanted = dict(kv.split("=", 1) for kv in (field_selector or "").split(","))
        return [{"metadata": {"name": n}} for n, (node, driver) in self.slices.items()
                if wanted == {"spec.nodeName": node, "spec.driver": driver}]

    def delete_resource_slice(self, name: str) -> bool:
        return self.slices.pop(name, None) is not None


class _LeftoverCtx:
    def __init__(self, kube: _SliceKube, plane: str = "device-plugin") -> None:
        self.kube = kube
        self.node_name = "n1"
        self.config = apply_overrides(AgentConfig(), {"device_plugin.plane": plane})

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        return asyncio.ensure_future(coro)


def test_plane_device_plugin_with_the_api_builds_the_leftover_cleanup_only() -> None:
    from nodeagent.daemon.components.dra import DraLeftoversComponent

    spec = {s.name: s for s in default_specs()}["dra"]
    assert isinstance(spec.build(_LeftoverCtx(_SliceKube({}))), DraLeftoversComponent)  # type: ignore[arg-type]
    no_api = _LeftoverCtx(_SliceKube({}))
    no_api.kube = None  # type: ignore[assignment]
    assert spec.build(no_api) is None  # type: ignore[arg-type]


async def test_leftover_slices_of_the_node_and_driver_are_deleted_after_an_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from nodeagent.daemon.components.dra import DraLeftoversComponent

    kube = _SliceKube({"n1-a": ("n1", "gpu.nodeagent.io"), "n1-b": ("n1", "gpu.nodeagent.io"),
                       "n2-a": ("n2", "gpu.nodeagent.io"), "n1-nv": ("n1", "gpu.nvidia.com")},
                      fail=KubeError("connection refused", retryable=True))
    comp = DraLeftoversComponent(_LeftoverCtx(kube))  # type: ignore[arg-type]
    caplog.set_level(logging.INFO)
    await comp.start(_LeftoverCtx(kube))  # type: ignore[arg-type]
    for _ in range(100):
        if any("not deleted (tried again at the next resync): connection refused" in r.getMessage()
               for r in caplog.records):
            break
        await asyncio.sleep(0.01)
    assert len(kube.slices) == 4
    for _ in range(100):  # the outage is over: a resync once the first attempt has ended tries again
        await comp.resync()
        if len(kube.slices) == 2:
            break
        await asyncio.sleep(0.01)
    assert sorted(kube.slices) == ["n1-nv", "n2-a"]
    messages = [r.getMessage() for r in caplog.records]
    assert "deleted 2 DRA ResourceSlice(s) of n1 left by an earlier run (plane is device-plugin)" in messages
    lists = kube.lists
    await comp.resync()  # done: no more requests
    await asyncio.sleep(0.05)
    assert kube.lists == lists
    await comp.stop()


@pytest.mark.parametrize("status", [403, 404])
async def test_no_dra_role_or_api_is_nothing_to_delete_quietly(status: int, caplog: pytest.LogCaptureFixture) -> None:
    from nodeagent.daemon.components.dra import DraLeftoversComponent

    kube = _SliceKube({"n1-a": ("n1", "gpu.nodeagent.io")}, fail=KubeError("no", status=status))
    ctx = _LeftoverCtx(kube)
    comp = DraLeftoversComponent(ctx)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO)
    await comp.start(ctx)  # type: ignore[arg-type]
    for _ in range(100):
        if kube.lists:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    await comp.resync()
    await asyncio.sleep(0.05)
    assert kube.lists == 1 and "n1-a" in kube.slices
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and "ResourceSlice" in r.getMessage()]
    await comp.stop()


# -- a rediscovery that overlapped a change of the GPUs -----------------------------------------------------


async def test_a_discovery_that_overlapped_a_mig_change_is_not_published() -> None:
    """A resync's discovery runs in a thread; when a MIG apply changed the GPUs meanwhile it may have read a
    layout half-way, and publishing it after the apply's own (newer) inventory would list a GPU as it no
    longer is. The daemon drops it; the next discovery, with no change running, is published."""
    import threading

    reading, read_on = threading.Event(), threading.Event()

    class SlowGpus(NoGpus):
        def __init__(self) -> None:
            self.driver = "550.54.15"

        def discover(self, *, partial: bool = False) -> Inventory:
            reading.set()
            read_on.wait(5)
            return Inventory(self.driver, 12040, ())

    gpus = SlowGpus()
    cfg = apply_overrides(AgentConfig(), {"kube": False, "metrics.address": ""})
    d = Daemon(cfg, HostPaths(Path("/nonexistent-root")), gpu_factory=lambda c, p: gpus, specs=[],
               notifier=Notifier({}))
    changes = d.shared.gpu_changes
    read_on.set()
    assert await d._discover() and d.inventory is not None  # nothing running: published
    first = d.inventory

    gpus.driver = "560.35.03"  # what a half-way read would see, different from the published inventory
    read_on.clear()
    reading.clear()
    discovery = asyncio.ensure_future(d._discover())
    assert await asyncio.to_thread(reading.wait, 5)
    with changes.changing():  # a MIG stage applied and published while the discovery read
        pass
    read_on.set()
    assert not await discovery and d.inventory is first

    reading.clear()
    with changes.changing():  # and one that is still running when the discovery starts
        assert changes.mark() is None
        assert not await d._discover() and d.inventory is first
    assert await d._discover() and d.inventory is not first and d.inventory.driver_version == "560.35.03"
