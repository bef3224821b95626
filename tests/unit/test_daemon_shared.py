"""The typed links between daemon components (``ctx.shared``): a reader sees the running device plugin and
metrics registry, nothing while none runs, and a reload that replaces one never leaves the old one linked."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nodeagent.config import AgentConfig, DevicePluginSettings
from nodeagent.daemon import Component, ComponentSpec, Context, Daemon
from nodeagent.daemon.shared import DevicePluginLink, MetricsLink, Shared
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths
from nodeagent.sdnotify import Notifier
from tests.unit.test_daemon import Gpus, wait_for


class FakePlugin(Component):
    """Publishes through ``ctx.shared.device_plugin`` like the real device-plugin component."""

    name = "dp"

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag
        self.withdrawn: list[set[int]] = []
        self.updates = 0
        self._ctx: Context | None = None

    @property
    def plugin_config(self) -> Any:
        return f"config-{self.tag}"

    def served(self) -> list[str]:
        return [f"nvidia.com/{self.tag}"]

    def health(self) -> dict[int, bool]:
        return {0: True, 1: False}

    def last_xids(self) -> dict[int, int]:
        return {1: 79}

    def registered(self) -> dict[str, bool]:
        return {"nvidia.com/gpu": True}

    def allocations(self) -> dict[tuple[str, str], int]:
        return {("nvidia.com/gpu", "answered"): 3}

    async def withdraw(self, gpu_indices: set[int]) -> None:
        self.withdrawn.append(gpu_indices)

    async def readvertise(self, gpu_indices: set[int]) -> None:
        self.withdrawn.append(set())

    async def update(self, inventory: Inventory) -> None:
        self.updates += 1

    def device_gpus(self, gpu_indices: frozenset[int]) -> dict[tuple[str, str], int]:
        return {(f"nvidia.com/{self.tag}", f"GPU-{i}"): i for i in gpu_indices}

    async def start(self, ctx: Context) -> None:
        self._ctx = ctx
        ctx.shared.device_plugin.attach(self)

    async def stop(self) -> None:
        assert self._ctx is not None
        self._ctx.shared.device_plugin.detach(self)


class Sink:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, float]] = []
        self.publishes: list[Any] = []

    def observe_reconcile(self, component: str, result: str, seconds: float) -> None:
        self.seen.append((component, result, seconds))

    def count_publish(self, writes: Mapping[str, int]) -> None:
        self.publishes.append(writes)


async def test_device_plugin_link_follows_the_running_plugin_across_a_reload() -> None:
    plugins = [FakePlugin("a")]
    spec = ComponentSpec("dp", frozenset({"device_plugin"}), lambda ctx: plugins[-1])
    configs = [AgentConfig()]
    d = Daemon(AgentConfig(), HostPaths(Path("/")), gpu_factory=lambda c, p: Gpus(), specs=[spec],
               notifier=Notifier({}), reload_config=lambda: configs[-1], ready_fallback=0.1)
    task = asyncio.create_task(d.run(install_signals=False))
    try:
        await wait_for(lambda: d._ready_sent)
        link = d.ctx.shared.device_plugin
        snap = link.snapshot()
        assert (snap.served, snap.plugin_config, dict(snap.health)) == (("nvidia.com/a",), "config-a",
                                                                         {0: True, 1: False})
        assert link.last_xids() == {1: 79}
        assert link.registered() == {"nvidia.com/gpu": True}
        assert link.allocations() == {("nvidia.com/gpu", "answered"): 3}
        await link.withdraw({1})
        assert plugins[0].withdrawn == [{1}]
        # a reload rebuilds the device plugin: readers see the new one, the old one is unlinked
        plugins.append(FakePlugin("b"))
        configs.append(AgentConfig(device_plugin=DevicePluginSettings(config="/etc/dp.yaml")))
        await d.reload()
        assert link.snapshot().served == ("nvidia.com/b",)
        link.detach(plugins[0])  # a late detach of the old plugin does not unlink the new one
        assert link.snapshot().plugin_config == "config-b"
        assert d.ctx.shared is d.shared  # the links outlive reloads
    finally:
        d.request_stop()
        await asyncio.wait_for(task, 5)
    assert link.snapshot().served == () and link.health() == {} and link.last_xids() == {}
    assert link.registered() == {} and link.allocations() == {}


async def test_links_without_a_provider_read_empty_and_drop_writes() -> None:
    dp = DevicePluginLink()
    assert dp.snapshot().served == () and dp.snapshot().plugin_config is None and dp.health() == {}
    await dp.withdraw({0})  # nobody serves: nothing to withdraw, no error
    await dp.update(Inventory("550.54.15", 12040, ()))
    metrics = MetricsLink()
    metrics.observe_reconcile("mig", "success", 1.0)  # dropped: no registry runs
    sink = Sink()
    metrics.attach(sink)
    metrics.observe_reconcile("mig", "success", 2.0)
    metrics.count_publish({"status": 1})
    metrics.detach(Sink())  # another sink's detach changes nothing
    metrics.observe_reconcile("mig", "failed", 3.0)
    metrics.detach(sink)
    metrics.observe_reconcile("mig", "failed", 4.0)
    assert sink.seen == [("mig", "success", 2.0), ("mig", "failed", 3.0)] and sink.publishes == [{"status": 1}]


async def test_advertiser_writes_the_cdi_spec_before_the_device_plugin_advertises() -> None:
    order: list[str] = []

    class Plugin:
        plugin_config = None

        def served(self) -> list[str]:
            return []

        def health(self) -> dict[int, bool]:
            return {}

        def last_xids(self) -> dict[int, int]:
            return {}

        def registered(self) -> dict[str, bool]:
            return {}

        def allocations(self) -> dict[tuple[str, str], int]:
            return {}

        async def withdraw(self, gpu_indices: set[int]) -> None:
            order.append(f"withdraw {sorted(gpu_indices)}")

        async def readvertise(self, gpu_indices: set[int]) -> None:
            order.append(f"readvertise {sorted(gpu_indices)}")

        async def update(self, inventory: Inventory) -> None:
            order.append("advertise")

        def device_gpus(self, gpu_indices: frozenset[int]) -> dict[tuple[str, str], int]:
            return {}

    async def refresh(inventory: Inventory) -> None:
        order.append("cdi")

    shared = Shared()
    shared.device_plugin.attach(Plugin())
    inv = Inventory(driver_version="550.54.15", cuda_driver_version=12040)
    await shared.advertiser.update(inv)  # no CDI writer attached: advertising still happens
    shared.cdi.attach(refresh)
    await shared.advertiser.withdraw({1})
    await shared.advertiser.update(inv)
    shared.cdi.detach(refresh)
    await shared.advertiser.update(inv)
    assert order == ["advertise", "withdraw [1]", "cdi", "advertise", "advertise"]


async def test_health_link_forwards_the_plugins_unhealthy_map_and_starts_a_late_sink_from_the_last_one() -> None:

    from nodeagent.daemon.shared import HealthLink

    class Dra:
        def __init__(self) -> None:
            self.seen: list[dict[tuple[int, int | None], str]] = []

        async def set_health(self, unhealthy: Mapping[tuple[int, int | None], str]) -> None:
            self.seen.append(dict(unhealthy))

    link = HealthLink()
    await link.publish({(1, None): "XID 48"})  # nobody attached yet: kept
    first = Dra()
    await link.attach(first)
    assert first.seen == [{(1, None): "XID 48"}]
    await link.publish({})
    assert first.seen[-1] == {}
    second = Dra()
    await link.attach(second)  # a rebuilt DRA plane replaces the first
    link.detach(first)  # a late detach of the old one does not unlink the new one
    await link.publish({(0, 3): "XID 94"})
    assert second.seen == [{}, {(0, 3): "XID 94"}] and len(first.seen) == 2
