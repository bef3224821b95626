"""No fight with another device plugin at nodeagent's socket name (NVIDIA's plugin uses nvidia-gpu.sock
too), judged by the kubelet's own device manager: nodeagent leaves a live foreign socket alone and does
not register until it is gone, then serves; with take_over it replaces it at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from nodeagent.deviceplugin.service import DevicePluginService
from nodeagent.gpu.health import HealthMonitorSettings
from nodeagent.gpu.nvml import NvmlAdapter
from nodeagent.nvmlsource import open_nvml
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

HEALTH = HealthMonitorSettings(recovery_window_s=None, poll_interval_s=0.2, event_wait_ms=100)


def _service(harness: KubeletHarness, nvml: NvmlAdapter, *, take_over: bool = False) -> DevicePluginService:
    return DevicePluginService(
        plugin_dir=harness.plugin_dir, nvml=nvml, health=HEALTH, take_over=take_over, backoff_max_s=0.5
    )


@pytest.fixture
async def machines(tmp_path: Path) -> AsyncIterator[tuple[NvmlAdapter, NvmlAdapter]]:
    # the "other plugin" sees one T4; nodeagent sees four A30s: the kubelet's device IDs tell them apart
    other = open_nvml("t4x1", tmp_path / "t4.json")
    ours = open_nvml("a30x4", tmp_path / "a30.json")
    yield other, ours
    other.close()
    ours.close()


async def _kubelet_ids(harness: KubeletHarness, total: int) -> list[str]:
    _, res = await asyncio.to_thread(harness.wait, "nvidia.com/gpu", total=total, registered=True, timeout=15)
    return sorted(d.id for d in res.devices)


async def test_leaves_a_live_foreign_plugin_alone_then_serves_once_it_is_gone(
    kubelet_harness: KubeletHarness, machines: tuple[NvmlAdapter, NvmlAdapter]
) -> None:
    other_nvml, our_nvml = machines
    other = _service(kubelet_harness, other_nvml)
    await other.start(await asyncio.to_thread(other_nvml.discover))
    theirs = await _kubelet_ids(kubelet_harness, 1)
    socket = kubelet_harness.plugin_dir / "nvidia-gpu.sock"
    inode = socket.stat().st_ino

    ours = _service(kubelet_harness, our_nvml)
    try:
        await ours.start(await asyncio.to_thread(our_nvml.discover))  # starts: not a failure of the agent
        await asyncio.sleep(2.0)  # several register attempts
        assert socket.stat().st_ino == inode, "nodeagent replaced the other plugin's socket"
        assert await _kubelet_ids(kubelet_harness, 1) == theirs
        assert "served by another process" in ours.failures["nvidia.com/gpu"], ours.failures
        assert not ours.server("nvidia.com/gpu").running

        await other.stop()  # the other plugin goes away (its socket with it)
        mine = await _kubelet_ids(kubelet_harness, 4)
        assert not set(mine) & set(theirs)
        assert "nvidia.com/gpu" not in ours.failures
    finally:
        await ours.stop()
        await other.stop()


async def test_take_over_replaces_it(
    kubelet_harness: KubeletHarness, machines: tuple[NvmlAdapter, NvmlAdapter]
) -> None:
    other_nvml, our_nvml = machines
    other = _service(kubelet_harness, other_nvml)
    await other.start(await asyncio.to_thread(other_nvml.discover))
    await _kubelet_ids(kubelet_harness, 1)
    ours = _service(kubelet_harness, our_nvml, take_over=True)
    try:
        await ours.start(await asyncio.to_thread(our_nvml.discover))
        assert len(await _kubelet_ids(kubelet_harness, 4)) == 4
    finally:
        await ours.stop()
        await other.stop()
