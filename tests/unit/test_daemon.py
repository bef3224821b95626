"""The daemon's own logic with small in-process components: start order, readiness, failures, reload."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.config import AgentConfig, HealthSettings, apply_overrides
from nodeagent.daemon import Component, ComponentSpec, Context, Daemon
from nodeagent.errors import ConfigError, OperationError
from nodeagent.gpu.inventory import Gpu, Inventory
from nodeagent.hostpaths import HostPaths
from nodeagent.sdnotify import Notifier
from tests.unit._gpu import QuietGpus


def _gpu(i: int) -> Gpu:
    return Gpu(
        index=i, uuid=f"GPU-{i}", name="Test GPU", pci_bus_id=f"0000:0{i}:00.0", pci_device_id=0x233010DE,
        memory_mib=81559, numa_node=0, compute_major=9, compute_minor=0, minor_number=i, architecture="hopper",
    )


class Gpus(QuietGpus):
    """A GpuSource whose GPU count the test changes."""

    def __init__(self, count: int = 2) -> None:
        self.count = count
        self.calls = 0
        self.closed = False

    def discover(self, *, partial: bool = False) -> Inventory:
        self.calls += 1
        return Inventory("550.54.15", 12040, tuple(_gpu(i) for i in range(self.count)))

    def close(self) -> None:
        self.closed = True


class Recorder(Component):
    def __init__(self, name: str, log: list[str], *, gates: bool = False, fail_start: int = 0,
                 hang_stop: bool = False) -> None:
        super().__init__()
        self.name = name
        self.log = log
        self.gates_ready = gates
        self.fail_start = fail_start
        self.hang_stop = hang_stop
        self.inventories: list[int] = []

    async def start(self, ctx: Context) -> None:
        if self.fail_start:
            raise OperationError(f"{self.name} cannot start")
        self.log.append(f"start {self.name} node={ctx.node_name}")

    async def on_inventory(self, inventory: Inventory) -> None:
        self.inventories.append(len(inventory.gpus))

    async def resync(self) -> None:
        self.log.append(f"resync {self.name}")

    async def stop(self) -> None:
        self.log.append(f"stop {self.name}")
        if self.hang_stop:
            await asyncio.sleep(60)


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[tuple[socket.socket, Notifier]]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "n.sock")
    s.bind(path)
    s.setblocking(False)
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
    yield s, n
    s.close()


def drain(s: socket.socket) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(s.recv(4096))
        except BlockingIOError:
            return out


def make(cfg: AgentConfig, comps: dict[str, Component | None], notifier: Notifier | None = None,
         reload: object = None, sections: dict[str, set[str]] | None = None,
         gpus: Gpus | None = None) -> Daemon:
    sections = sections or {}
    built: dict[str, int] = {}

    def builder(name: str):  # type: ignore[no-untyped-def]
        def build(ctx: Context) -> Component | None:
            built[name] = built.get(name, 0) + 1
            return comps[name]
        return build

    specs = [ComponentSpec(n, frozenset(sections.get(n, set())), builder(n)) for n in comps]
    d = Daemon(cfg, HostPaths(Path("/")), gpu_factory=lambda c, p: gpus or Gpus(), specs=specs,
               notifier=notifier or Notifier({}), reload_config=reload, ready_fallback=5)  # type: ignore[arg-type]
    d.built = built  # type: ignore[attr-defined]
    return d


async def wait_for(cond, timeout: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_start_ready_stop(notify: tuple[socket.socket, Notifier]) -> None:
    s, n = notify
    log: list[str] = []
    dp = Recorder("dp", log, gates=True)
    pub = Recorder("pub", log)
    d = make(AgentConfig(node_name="n1"), {"dp": dp, "pub": pub}, n)
    task = asyncio.create_task(d.run(install_signals=False))
    await wait_for(lambda: "start pub node=n1" in log)
    assert log[:2] == ["start dp node=n1", "start pub node=n1"]
    assert dp.inventories == [2] and pub.inventories == [2]
    await asyncio.sleep(0.05)
    assert not any(m.startswith(b"READY=1") for m in drain(s)), "READY before the gate opened"
    dp.ready.set()
    await wait_for(lambda: d._ready_sent)
    msgs = drain(s)
    assert any(m.startswith(b"READY=1\nSTATUS=2 GPU(s)") for m in msgs)
    await asyncio.sleep(0.25)
    assert b"WATCHDOG=1" in drain(s)
    d.request_stop()
    assert await asyncio.wait_for(task, 5) == 0
    assert log[-2:] == ["stop pub", "stop dp"]  # reverse order
    assert b"STOPPING=1" in drain(s)


async def test_failed_component_does_not_stop_others_and_is_retried() -> None:
    log: list[str] = []
    bad = Recorder("bad", log, fail_start=1)
    good = Recorder("good", log)
    d = make(AgentConfig(), {"bad": bad, "good": good})
    task = asyncio.create_task(d.run(install_signals=False))
    await wait_for(lambda: d._ready_sent)
    assert d.errors == {"bad": "failed to start: bad cannot start"}
    assert "bad" in d.status_line()
    bad.fail_start = 0
    d.request_resync()
    await wait_for(lambda: not d.errors)
    assert "start bad node=" in log[-1] or any(x.startswith("start bad") for x in log)
    d.request_stop()
    await asyncio.wait_for(task, 5)


async def test_inventory_change_reaches_components_on_resync() -> None:
    log: list[str] = []
    c = Recorder("c", log)
    gpus = Gpus(2)
    d = make(AgentConfig(), {"c": c}, gpus=gpus)
    task = asyncio.create_task(d.run(install_signals=False))
    await wait_for(lambda: c.inventories == [2])
    d.request_resync()
    await wait_for(lambda: "resync c" in log)
    assert c.inventories == [2]  # unchanged inventory is not re-sent
    gpus.count = 1
    d.request_resync()
    await wait_for(lambda: c.inventories == [2, 1])
    d.request_stop()
    await asyncio.wait_for(task, 5)
    assert gpus.closed


async def test_hanging_stop_is_bounded() -> None:
    c = Recorder("c", [], hang_stop=True)
    d = make(AgentConfig(), {"c": c})
    task = asyncio.create_task(d.run(install_signals=False))
    await wait_for(lambda: d._ready_sent)
    t0 = asyncio.get_running_loop().time()
    d.request_stop()
    await asyncio.wait_for(task, 6)
    assert asyncio.get_running_loop().time() - t0 < 4.5


async def test_reload_rebuilds_only_changed_sections() -> None:
    log: list[str] = []
    configs = [AgentConfig()]
    comps: dict[str, Component | None] = {"metrics": Recorder("metrics", log), "mig": Recorder("mig", log)}
    d = make(AgentConfig(), comps, reload=lambda: configs[-1],
             sections={"metrics": {"metrics"}, "mig": {"mig"}})
    task = asyncio.create_task(d.run(install_signals=False))
    await wait_for(lambda: d._ready_sent)
    configs.append(apply_overrides(AgentConfig(), {"metrics.address": "127.0.0.1:9401"}))
    comps["metrics"] = Recorder("metrics", log)
    await d.reload()
    assert d.built == {"metrics": 2, "mig": 1}  # type: ignore[attr-defined]
    assert d.config.metrics.address == "127.0.0.1:9401"
    # unchanged config: nothing rebuilt
    await d.reload()
    assert d.built == {"metrics": 2, "mig": 1}  # type: ignore[attr-defined]
    d.request_stop()
    await asyncio.wait_for(task, 5)


async def test_bad_reload_keeps_running_config() -> None:
    def broken() -> AgentConfig:
        raise ConfigError("/etc/nodeagent/config.toml: unknown key 'x'")

    d = make(AgentConfig(health=HealthSettings(window=5)), {"c": Recorder("c", [])}, reload=broken)
    task = asyncio.create_task(d.run(install_signals=False))
    await wait_for(lambda: d._ready_sent)
    await d.reload()
    assert d.config.health.window == 5
    assert "reload rejected" in d.status_line()
    d.request_stop()
    await asyncio.wait_for(task, 5)


class Live(Recorder):
    """Takes a change of ``[metrics] interval`` while running; refuses an interval of 13 before anything changes."""

    def check_reload(self, new: AgentConfig) -> None:
        if new.metrics.interval == 13:
            raise ConfigError("c.toml: key 'metrics.interval' 13 is refused by the running component")

    async def reconfigure(self, old: AgentConfig, new: AgentConfig, changed: frozenset[str]) -> bool:
        self.log.append(f"live {old.metrics.interval:g} -> {new.metrics.interval:g}")
        return changed == {"metrics"} and old.metrics.address == new.metrics.address


async def test_a_component_takes_a_change_live_or_refuses_it_before_anything_changes() -> None:
    log: list[str] = []
    configs = [AgentConfig()]
    comps: dict[str, Component | None] = {"m": Live("m", log), "other": Recorder("other", log)}
    d = make(AgentConfig(), comps, reload=lambda: configs[-1], sections={"m": {"metrics"}, "other": {"metrics"}})
    task = asyncio.create_task(d.run(install_signals=False))
    await wait_for(lambda: d._ready_sent)
    configs.append(apply_overrides(AgentConfig(), {"metrics.interval": 7.0}))
    await d.reload()
    assert d.built == {"m": 1, "other": 2}  # type: ignore[attr-defined]  # taken live; the other rebuilt
    assert f"live {AgentConfig().metrics.interval:g} -> 7" in log and d.config.metrics.interval == 7.0
    configs.append(apply_overrides(AgentConfig(), {"metrics.interval": 13.0}))
    await d.reload()
    assert d.config.metrics.interval == 7.0 and d.built == {"m": 1, "other": 2}  # type: ignore[attr-defined]
    assert "reload rejected: c.toml: key 'metrics.interval' 13 is refused" in d.status_line()
    d.request_stop()
    await asyncio.wait_for(task, 5)


async def test_global_change_rebuilds_everything() -> None:
    configs = [dataclasses.replace(AgentConfig(), node_name="b")]
    d = make(AgentConfig(node_name="a"), {"x": Recorder("x", []), "y": None}, reload=lambda: configs[-1])
    task = asyncio.create_task(d.run(install_signals=False))
    await wait_for(lambda: d._ready_sent)
    await d.reload()
    assert d.node_name == "b"
    assert d.built == {"x": 2, "y": 2}  # type: ignore[attr-defined]
    d.request_stop()
    await asyncio.wait_for(task, 5)


async def test_diagnostics_count_tasks_threads_and_fds(caplog: pytest.LogCaptureFixture) -> None:
    dp = Recorder("dp", [], gates=True)
    d = make(AgentConfig(node_name="n1"), {"dp": dp})
    task = asyncio.create_task(d.run(install_signals=False))
    await wait_for(lambda: d.inventory is not None)
    spawned = d.spawn(asyncio.sleep(30), "sleeper")
    diag = d.diagnostics()
    assert diag["tasks"] >= 2 and diag["threads"] >= 1 and diag["fds"] > 0
    assert diag["task_kinds"].get("sleep") == 1
    with caplog.at_level(logging.INFO, logger="nodeagent.daemon"):
        d.log_diagnostics()
    assert re.search(r"diagnostics: \d+ asyncio task\(s\), \d+ thread\(s\), \d+ open fd\(s\); tasks: .*sleep x1",
                     caplog.text)
    spawned.cancel()
    d.request_stop()
    assert await asyncio.wait_for(task, 5) == 0
