"""The device-plugin servers over real gRPC on Unix sockets, seen from a plain client.

Registration and the kubelet's view are covered against the real device manager in
test_deviceplugin_kubelet.py; this file checks what only a direct client can see.
"""

from __future__ import annotations

import asyncio
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from nodeagent.deviceplugin.api import pb2, pb2_grpc
from nodeagent.deviceplugin.service import DevicePluginService
from nodeagent.errors import ConfigError, InputError
from nodeagent.gpu.health import HealthMonitorSettings
from nodeagent.sharing.spec import parse_plugin_config
from tests.unit._dp_inventories import mig_box, nvswitch_box


class Quiet:
    """A health source with no events (our own interface); flip ``lost`` to lose a GPU."""

    def __init__(self) -> None:
        self.lost: set[int] = set()

    def wait_events(self, timeout_ms: int) -> list[Any]:
        import time

        time.sleep(min(timeout_ms, 20) / 1000)
        return []

    def gpu_healthy(self, index: int) -> bool:
        return index not in self.lost

    fault_domain: str | None = None  # no UUIDs shared with other sources

    def recovery_action(self, index: int) -> int:
        return 0

    def gpu_uuid(self, index: int) -> str:
        return f"GPU-{index}"


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[DevicePluginService]:
    svc = DevicePluginService(plugin_dir=tmp_path / "dp")
    yield svc
    await svc.stop()


def stub(path: Path) -> tuple[Any, Any]:
    ch = grpc.aio.insecure_channel(f"unix://{path}")
    return ch, pb2_grpc.DevicePluginStub(ch)


async def test_sockets_options_and_clean_stop(tmp_path: Path) -> None:
    d = tmp_path / "dp"
    svc = DevicePluginService(
        plugin_dir=d, plugin_config=parse_plugin_config("version: v1\nflags:\n  migStrategy: mixed\n")
    )
    before = set(asyncio.all_tasks())
    await svc.start(mig_box("1g.10gb+me", per_gpu=1, gpus_on=1, gpus_off=1))
    names = sorted(p.name for p in d.iterdir())
    assert names == ["nvidia-gpu.sock", "nvidia-mig-1g.10gb.me.sock"]
    for p in d.iterdir():
        assert stat.S_ISSOCK(p.stat().st_mode) and stat.S_IMODE(p.stat().st_mode) == 0o600
    ch, s = stub(d / "nvidia-gpu.sock")
    async with ch:
        opts = await s.GetDevicePluginOptions(pb2.Empty())
        assert opts.get_preferred_allocation_available and not opts.pre_start_required
        assert await s.PreStartContainer(pb2.PreStartContainerRequest(devices_ids=["x"])) == pb2.PreStartContainerResponse()
        stream = s.ListAndWatch(pb2.Empty())
        first = await stream.read()
        assert [dev.health for dev in first.devices] == ["Healthy"]
    await svc.stop()
    assert list(d.iterdir()) == []
    await asyncio.sleep(0)
    assert {t for t in asyncio.all_tasks() if not t.done()} - before == set()


async def test_list_and_watch_resends_on_update_and_withdraw(service: DevicePluginService) -> None:
    await service.start(nvswitch_box(4))
    ch, s = stub(service.plugin_dir / "nvidia-gpu.sock")
    async with ch:
        stream = s.ListAndWatch(pb2.Empty())
        first = await stream.read()
        assert len(first.devices) == 4 and first.devices[0].topology.nodes[0].ID == 0
        await service.update(nvswitch_box(4), parse_plugin_config(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"))
        second = await asyncio.wait_for(stream.read(), 2)
        assert len(second.devices) == 8 and second.devices[1].ID.endswith("::1")
        await service.withdraw({0, 1})
        third = await asyncio.wait_for(stream.read(), 2)
        assert len(third.devices) == 4
        assert service.served_resources()["nvidia.com/gpu"] == [d.ID for d in third.devices]


async def test_invalid_update_changes_nothing(service: DevicePluginService) -> None:
    await service.start(nvswitch_box(2))
    before = service.served_resources()
    bad = parse_plugin_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n      devices: [5]\n")
    with pytest.raises(ConfigError, match="device 5 does not exist"):
        await service.update(nvswitch_box(2), bad)
    assert service.served_resources() == before
    assert service.config.sharing.strategy == "none"


async def test_resources_appear_and_vanish(service: DevicePluginService) -> None:
    mixed = parse_plugin_config("version: v1\nflags:\n  migStrategy: mixed\n")
    await service.start(nvswitch_box(2))
    await service.update(mig_box(per_gpu=2, gpus_on=1, gpus_off=1), mixed)
    assert set(service.served_resources()) == {"nvidia.com/gpu", "nvidia.com/mig-1g.10gb"}
    assert (service.plugin_dir / "nvidia-mig-1g.10gb.sock").exists()
    await service.update(nvswitch_box(2))
    assert set(service.served_resources()) == {"nvidia.com/gpu"}
    assert not (service.plugin_dir / "nvidia-mig-1g.10gb.sock").exists()


async def test_allocate_errors_are_invalid_argument(service: DevicePluginService) -> None:
    await service.update(nvswitch_box(2), parse_plugin_config(
        "version: v1\nsharing:\n  timeSlicing:\n    failRequestsGreaterThanOne: true\n    renameByDefault: true\n"
        "    resources:\n    - name: nvidia.com/gpu\n      replicas: 3\n"))
    await service.start(nvswitch_box(2))
    ch, s = stub(service.plugin_dir / "nvidia-gpu.shared.sock")
    ids = service.served_resources()["nvidia.com/gpu.shared"]
    async with ch:
        ok = await s.Allocate(pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=ids[:1])]))
        assert ok.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == ids[0].split("::")[0]
        for bad, msg in ((["GPU-nope::0"], "GPU-nope::0 were never advertised"), (ids[:2], "failRequestsGreaterThanOne")):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await s.Allocate(pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=bad)]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and msg in (e.value.details() or "")
        # the kept answer for the same devices counts as answered too
        await s.Allocate(pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=ids[:1])]))
    # what nodeagent_allocate_requests_total shows
    assert service.allocations() == {("nvidia.com/gpu.shared", "answered"): 2, ("nvidia.com/gpu.shared", "refused"): 2}


async def test_lost_gpu_turns_unhealthy_then_recovers(tmp_path: Path) -> None:
    src = Quiet()
    svc = DevicePluginService(
        plugin_dir=tmp_path / "dp", nvml=src,
        health=HealthMonitorSettings(recovery_window_s=0.3, poll_interval_s=0.05, event_wait_ms=20),
    )
    await svc.start(nvswitch_box(2))
    try:
        ch, s = stub(svc.plugin_dir / "nvidia-gpu.sock")
        async with ch:
            stream = s.ListAndWatch(pb2.Empty())
            assert [d.health for d in (await stream.read()).devices] == ["Healthy", "Healthy"]
            src.lost.add(1)
            assert [d.health for d in (await asyncio.wait_for(stream.read(), 2)).devices] == ["Healthy", "Unhealthy"]
            src.lost.clear()
            assert [d.health for d in (await asyncio.wait_for(stream.read(), 3)).devices] == ["Healthy", "Healthy"]
    finally:
        await svc.stop()


async def test_register_failure_logged_once_and_retried(
    service: DevicePluginService, caplog: pytest.LogCaptureFixture
) -> None:
    # No kubelet in this directory: registration keeps retrying with backoff, one warning per cause.
    import logging

    caplog.set_level(logging.INFO, logger="nodeagent.deviceplugin")
    await service.start(nvswitch_box(1))
    await asyncio.sleep(0.8)
    warnings = [r for r in caplog.records if "registering nvidia.com/gpu failed" in r.getMessage()]
    assert len(warnings) == 1 and "kubelet.sock does not exist" in warnings[0].getMessage()
    assert service.registrations == {}
    assert service.served_resources()["nvidia.com/gpu"]  # still serving


async def test_relative_plugin_dir_and_too_long_socket_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative kubelet dir (``--root ./demo``) still serves on the right absolute path; a socket path a
    Unix socket cannot hold is refused with one line naming it."""
    monkeypatch.chdir(tmp_path)
    svc = DevicePluginService(plugin_dir=Path("demo/dp"))
    await svc.start(nvswitch_box(2))
    try:
        ch, s = stub(tmp_path / "demo/dp/nvidia-gpu.sock")
        async with ch:
            assert (await s.GetDevicePluginOptions(pb2.Empty())).get_preferred_allocation_available
    finally:
        await svc.stop()
    deep = tmp_path / ("x" * 100)
    svc = DevicePluginService(plugin_dir=deep)
    with pytest.raises(InputError, match=r"^device-plugin socket path .*nvidia-gpu.sock is \d+ bytes, more than"):
        await svc.start(nvswitch_box(2))
    await svc.stop()
    assert not (deep / "nvidia-gpu.sock").exists()


def _allocate_bytes(ids: list[str]) -> bytes:
    request: bytes = pb2.AllocateRequest(
        container_requests=[pb2.ContainerAllocateRequest(devices_ids=ids)]).SerializeToString()
    return request


async def test_kept_allocate_answers_follow_every_change(service: DevicePluginService) -> None:
    """Answers are kept per request bytes only until the device list or the settings change; a refusal is
    never kept; bytes that are no AllocateRequest are refused naming what they are."""
    await service.start(nvswitch_box(4))
    gpu3 = service.served_resources()["nvidia.com/gpu"][3]
    ch = grpc.aio.insecure_channel(f"unix://{service.plugin_dir / 'nvidia-gpu.sock'}")
    raw = ch.unary_unary("/v1beta1.DevicePlugin/Allocate")  # bytes in, bytes out: the exact request bytes
    async with ch:
        request = _allocate_bytes([gpu3])
        first = pb2.AllocateResponse.FromString(await raw(request))
        assert first.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == gpu3
        assert await raw(request) == first.SerializeToString()
        for _ in range(2):  # refused each time it is asked, naming the unknown ID
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await raw(_allocate_bytes(["GPU-unknown"]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "GPU-unknown" in (e.value.details() or "")
        # new settings: the same bytes get the new answer
        await service.update(nvswitch_box(4), parse_plugin_config(
            "version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, cdi-annotations]\n"))
        second = pb2.AllocateResponse.FromString(await raw(request))
        assert second.container_responses[0].annotations and second != first
        # the device withdrawn: the same bytes are refused, naming it
        await service.withdraw({3})
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await raw(request)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and gpu3 in (e.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await raw(b"\xff\xff\xff")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (e.value.details() or "").startswith("malformed AllocateRequest (3 bytes)")


async def test_streams_do_not_starve_allocate(service: DevicePluginService) -> None:
    """The methods run on the gRPC servers' own loop: streams cancelled by the dozen free their slots, streams
    left open up to the limit do not block an Allocate, one more is refused (RESOURCE_EXHAUSTED), and stop
    ends them all."""
    import threading

    from nodeagent.deviceplugin.server import MAX_LIST_AND_WATCH
    from nodeagent.grpcadapter.server import SERVER_LOOP_THREAD

    await service.start(nvswitch_box(2))
    gpu0 = service.served_resources()["nvidia.com/gpu"][0]
    request = pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=[gpu0])])
    ch, s = stub(service.plugin_dir / "nvidia-gpu.sock")
    async with ch:
        for _ in range(MAX_LIST_AND_WATCH * 3):
            stream = s.ListAndWatch(pb2.Empty())
            assert len((await stream.read()).devices) == 2
            stream.cancel()
        assert (await s.Allocate(request, timeout=5)).container_responses[0].envs
        open_streams = [s.ListAndWatch(pb2.Empty()) for _ in range(MAX_LIST_AND_WATCH)]
        for stream in open_streams:
            assert len((await asyncio.wait_for(stream.read(), 5)).devices) == 2
        assert (await s.Allocate(request, timeout=5)).container_responses[0].envs
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(s.ListAndWatch(pb2.Empty()).read(), 5)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await service.update(nvswitch_box(2), parse_plugin_config(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"))
        for stream in open_streams:  # every open stream gets the new list
            assert len((await asyncio.wait_for(stream.read(), 5)).devices) == 4
        await service.stop()
        for stream in open_streams:
            assert await asyncio.wait_for(stream.read(), 5) is grpc.aio.EOF or stream.done()
    # one thread runs every device-plugin server, however many were started and stopped
    assert [t.name for t in threading.enumerate() if t.name == SERVER_LOOP_THREAD] == [SERVER_LOOP_THREAD]
