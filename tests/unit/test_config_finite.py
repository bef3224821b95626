"""NaN and infinity in the agent config: refused with one line naming the key (exit 2 at start), and a
reload that meets them (or any other failure while reading) changes nothing and still ends with READY=1."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.config import AgentConfig, SimulateSettings, load_config, parse_config
from nodeagent.daemon import ComponentSpec, Daemon
from nodeagent.errors import ConfigError, InputError
from nodeagent.hostpaths import HostPaths
from nodeagent.sdnotify import Notifier
from tests.unit.test_daemon import Gpus, Recorder, drain, make, wait_for
from tests.unit.test_daemon import notify as notify  # the fixture

REPO = Path(__file__).resolve().parents[2]
FLOAT_KEYS = [("", "resync_interval"), ("metrics", "interval"), ("health", "window"),
              ("health", "poll_interval"), ("runtime", "check_interval"), ("mig", "release_timeout")]


def toml(section: str, key: str, value: str) -> str:
    return f"[{section}]\n{key} = {value}\n" if section else f"{key} = {value}\n"


@pytest.mark.parametrize(("section", "key"), FLOAT_KEYS)
@pytest.mark.parametrize("value", ["nan", "+nan", "inf", "-inf"])
def test_nan_and_inf_are_refused_naming_the_key(section: str, key: str, value: str) -> None:
    dotted = f"{section}.{key}" if section else key
    with pytest.raises(ConfigError) as e:
        parse_config(toml(section, key, value), "c.toml")
    assert str(e.value) == f"c.toml: key '{dotted}' must be a finite number, got {float(value)!r}"
    assert e.value.exit_code == 2


@pytest.mark.parametrize(("section", "key"), FLOAT_KEYS)
def test_an_interval_beyond_a_year_is_refused(section: str, key: str) -> None:
    with pytest.raises(ConfigError, match=r"must be at most 31622400 seconds, got 1e\+300$"):
        parse_config(toml(section, key, "1e300"), "c.toml")


def test_start_with_nan_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("resync_interval = nan\n")
    proc = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--root", str(tmp_path), "run", "--config", str(cfg), "--no-kube",
         "--simulate", "a30x4", "--sim-state", str(tmp_path / "s.json")],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: {cfg}: key 'resync_interval' must be a finite number, got nan\n"


def sent(s: socket.socket) -> list[bytes]:
    """What reached the notify socket, without the watchdog pings."""
    return [m for m in drain(s) if not m.startswith(b"WATCHDOG=1")]


async def test_reload_is_all_or_nothing_and_always_ends_ready(
        tmp_path: Path, notify: tuple[socket.socket, Notifier]) -> None:
    s, n = notify
    cfg = tmp_path / "config.toml"
    cfg.write_text("resync_interval = 30\n")
    bug: list[Exception] = []

    def reload() -> AgentConfig:
        if bug:
            raise bug[-1]
        return load_config(HostPaths(tmp_path), cfg)

    log: list[str] = []
    d = make(reload(), {"c": Recorder("c", log)}, n, reload=reload, sections={"c": {"resync_interval"}})
    task = asyncio.create_task(d.run(install_signals=False))
    try:
        await wait_for(lambda: d._ready_sent)
        drain(s)
        for text in ("resync_interval = nan\n", "resync_interval = inf\n", "[health]\nwindow = -inf\n"):
            cfg.write_text(text)
            await d.reload()
            msgs = sent(s)
            assert msgs[0].startswith(b"RELOADING=1") and msgs[-1].startswith(b"READY=1"), msgs
            assert d.config.resync_interval == 30 and d.config.health.window == 60
            assert "reload rejected" in d.status_line() and "finite number" in d.status_line()
        bug.append(RuntimeError("a bug while reading"))  # not a config error: rejected all the same
        await d.reload()
        msgs = sent(s)
        assert msgs[-1].startswith(b"READY=1") and d.config.resync_interval == 30
        bug.clear()
        cfg.write_text("resync_interval = 45\n")
        await d.reload()
        assert d.config.resync_interval == 45 and "reload rejected" not in d.status_line()
        assert sent(s)[-1].startswith(b"READY=1")
        assert [x.split()[0] for x in log if x.startswith(("start", "stop"))] == ["start", "stop", "start"]
    finally:
        d.request_stop()
        await asyncio.wait_for(task, 5)


async def test_a_reload_that_cannot_open_the_new_gpu_source_or_api_changes_nothing(
        notify: tuple[socket.socket, Notifier]) -> None:
    s, n = notify
    opened: list[str] = []

    def gpu_factory(config: AgentConfig, paths: HostPaths) -> Gpus:
        if config.simulate.machine == "nope":
            raise InputError("unknown machine 'nope'")
        opened.append(config.simulate.machine)
        return Gpus()

    def kube_factory(config: AgentConfig) -> object:
        if config.kubeconfig == "/broken":
            raise ConfigError("/broken: not a kubeconfig")
        return None

    configs = [AgentConfig(simulate=SimulateSettings(machine="a30x4"))]
    log: list[str] = []
    d = Daemon(configs[0], HostPaths(Path("/")), gpu_factory=gpu_factory, kube_factory=kube_factory,
               specs=[ComponentSpec("c", frozenset(), lambda ctx: Recorder("c", log))], notifier=n,
               reload_config=lambda: configs[-1], ready_fallback=5)
    task = asyncio.create_task(d.run(install_signals=False))
    try:
        await wait_for(lambda: d._ready_sent)
        gpu_before = d.gpu
        for bad in (AgentConfig(simulate=SimulateSettings(machine="nope")),
                    AgentConfig(simulate=SimulateSettings(machine="l4x2"), kubeconfig="/broken")):
            configs.append(bad)
            sent(s)
            await d.reload()
            assert sent(s)[-1].startswith(b"READY=1")
            assert d.config == configs[0] and d.gpu is gpu_before and "reload rejected" in d.status_line()
            assert [x.split()[0] for x in log if x.startswith(("start", "stop"))] == ["start"]
        assert opened == ["a30x4", "l4x2"]  # the second try opened the GPU source, then closed it again
        configs.append(AgentConfig(simulate=SimulateSettings(machine="l4x2")))
        await d.reload()
        assert d.config.simulate.machine == "l4x2" and d.gpu is not gpu_before
        assert [x.split()[0] for x in log if x.startswith(("start", "stop"))] == ["start", "stop", "start"]
    finally:
        d.request_stop()
        await asyncio.wait_for(task, 5)
