"""The files the agent config names (device-plugin config, MIG config and hooks): validated at start and on
SIGHUP like config.toml itself, and an edit of one of them alone rebuilds the component that uses it."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from nodeagent.config import AgentConfig, apply_overrides
from nodeagent.daemon import ComponentSpec, ConfigFiles, Daemon, read_config_files
from nodeagent.errors import ConfigError
from nodeagent.hostpaths import HostPaths
from nodeagent.sdnotify import Notifier
from tests.unit.test_daemon import Gpus, Recorder, wait_for

DP = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
MIG = "version: v1\nmig-configs:\n  mine:\n  - devices: all\n    mig-enabled: true\n    mig-devices:\n      1g.10gb: 7\n"
HOOKS = "version: v1\nhooks:\n  apply-start:\n  - workdir: /\n    command: /bin/true\n"


def cfg(**overrides: object) -> AgentConfig:
    return apply_overrides(AgentConfig(), overrides)


def write(root: Path, host_path: str, text: str) -> Path:
    path = HostPaths(root)(host_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_read_nothing(tmp_path: Path) -> None:
    files = read_config_files(AgentConfig(), HostPaths(tmp_path))
    assert files.plugin_config is None and files.mig is not None
    assert files.mig.configs is None and files.mig.hooks is None
    # the default MIG file may be missing (standard configs); its absence is part of the fingerprint
    assert set(files.digests) == {"mig"}


def test_valid_files_are_parsed(tmp_path: Path) -> None:
    write(tmp_path, "/etc/nodeagent/dp.yaml", DP)
    write(tmp_path, "/etc/nodeagent/mig-config.yaml", MIG)
    write(tmp_path, "/etc/nodeagent/hooks.yaml", HOOKS)
    files = read_config_files(cfg(**{"device_plugin.config": "/etc/nodeagent/dp.yaml",
                                     "mig.hooks_file": "/etc/nodeagent/hooks.yaml"}), HostPaths(tmp_path))
    assert files.plugin_config.sharing.strategy == "time-slicing"
    assert files.mig is not None and files.mig.configs is not None
    assert files.mig.configs.names == ("mine",)
    assert files.mig.hooks is not None
    assert set(files.digests) == {"device_plugin", "mig"}


@pytest.mark.parametrize(("text", "expected"), [
    ("version: v1\nsharing: [\n", "not valid YAML"),
    ("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/mig-1g.10gb\n      replicas: 2\n", "sharing.mps"),
    ("version: v1\nflagz: {}\n", "flagz"),
    (None, "device-plugin config (device_plugin.config) not found"),
])
def test_bad_device_plugin_config_names_the_file(tmp_path: Path, text: str | None, expected: str) -> None:
    path = HostPaths(tmp_path)("/etc/dp.yaml")
    if text is not None:
        write(tmp_path, "/etc/dp.yaml", text)
    with pytest.raises(ConfigError) as e:
        read_config_files(cfg(**{"device_plugin.config": "/etc/dp.yaml"}), HostPaths(tmp_path))
    assert str(e.value).startswith(str(path)) and expected in str(e.value)
    assert "\n" not in str(e.value)


def test_disabled_parts_do_not_read_their_files(tmp_path: Path) -> None:
    write(tmp_path, "/etc/dp.yaml", "sharing: [")
    write(tmp_path, "/etc/nodeagent/mig-config.yaml", "mig-configs: [")
    read_config_files(cfg(**{"device_plugin.config": "/etc/dp.yaml", "device_plugin.enabled": False,
                             "mig.enabled": False}), HostPaths(tmp_path))
    read_config_files(cfg(**{"kube": False}), HostPaths(tmp_path))  # no API: no MIG reconciler


@pytest.mark.parametrize(("overrides", "text", "expected"), [
    ({}, "version: v1\nmig-configs: [\n", "mig-config.yaml: not valid YAML"),
    ({}, "version: v2\nmig-configs: {}\n", "unsupported version"),
    ({"mig.config_file": "/etc/mine.yaml"}, None, "mine.yaml: MIG config file (mig.config_file) not found"),
    ({"mig.hooks_file": "/etc/hooks.yaml"}, None, "hooks.yaml: MIG hooks file (mig.hooks_file) not found"),
])
def test_bad_mig_files_name_the_file(tmp_path: Path, overrides: dict[str, object], text: str | None,
                                      expected: str) -> None:
    if text is not None:
        write(tmp_path, "/etc/nodeagent/mig-config.yaml", text)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        read_config_files(cfg(**overrides), HostPaths(tmp_path))


async def test_reload_rebuilds_the_component_whose_file_changed_and_refuses_a_broken_file() -> None:
    digests = {"device_plugin": "a", "mig": "m"}
    broken: list[str] = []

    def read(config: AgentConfig, paths: HostPaths) -> ConfigFiles:
        if broken:
            raise ConfigError(broken[-1])
        return ConfigFiles(plugin_config=digests["device_plugin"], digests=dict(digests))

    log: list[str] = []
    comps = {"dp": Recorder("dp", log), "mig": Recorder("mig", log)}

    def build(name: str):  # type: ignore[no-untyped-def]
        return lambda ctx: comps[name]

    specs = [ComponentSpec("dp", frozenset({"device_plugin"}), build("dp")),
             ComponentSpec("mig", frozenset({"mig"}), build("mig"))]
    d = Daemon(AgentConfig(), HostPaths(Path("/")), gpu_factory=lambda c, p: Gpus(), specs=specs,
               notifier=Notifier({}), reload_config=AgentConfig, ready_fallback=5, read_files=read)
    task = asyncio.create_task(d.run(install_signals=False))
    await wait_for(lambda: d._ready_sent)
    assert d.ctx.files.plugin_config == "a"
    await d.reload()  # nothing changed
    assert log.count("start dp node=" + d.node_name) == 1
    digests["device_plugin"] = "b"  # only the device-plugin file changed
    await d.reload()
    assert d.ctx.files.plugin_config == "b"
    assert [x.split()[0] + " " + x.split()[1] for x in log if x.startswith(("start", "stop"))] == [
        "start dp", "start mig", "stop dp", "start dp"]
    broken.append("/etc/dp.yaml: not valid YAML")  # a broken edit: refused, the running files stay
    digests["device_plugin"] = "c"
    await d.reload()
    assert d.ctx.files.plugin_config == "b"
    assert "reload rejected: /etc/dp.yaml: not valid YAML" in d.status_line()
    d.request_stop()
    await asyncio.wait_for(task, 5)


def test_a_broken_file_stops_the_daemon_before_anything_opens() -> None:
    opened: list[str] = []

    def read(config: AgentConfig, paths: HostPaths) -> ConfigFiles:
        raise ConfigError("/etc/dp.yaml: sharing.mps: not supported")

    def gpu(config: AgentConfig, paths: HostPaths) -> Gpus:
        opened.append("gpu")
        return Gpus()

    with pytest.raises(ConfigError, match=r"sharing\.mps"):
        Daemon(AgentConfig(), HostPaths(Path("/")), gpu_factory=gpu, specs=[], notifier=Notifier({}),
               read_files=read)
    assert opened == []


def configmap_volume(root: Path, files: dict[str, str]) -> None:
    """/etc/nodeagent laid out as the kubelet lays out a ConfigMap volume: the files in a timestamped
    directory, ``..data`` a link to it, and each name a link through ``..data``."""
    etc = root / "etc/nodeagent"
    stamp = etc / "..2026_11_26_18_00_00.123456789"
    stamp.mkdir(parents=True)
    (etc / "..data").symlink_to(stamp.name)
    for name, text in files.items():
        (stamp / name).write_text(text)
        (etc / name).symlink_to(f"..data/{name}")


@pytest.mark.parametrize(("name", "key"), [
    ("config.toml", None),
    ("dp.yaml", "device_plugin.config"),
    ("mig-config.yaml", "mig.config_file"),
    ("hooks.yaml", "mig.hooks_file"),
])
def test_errors_in_a_configmap_volume_name_the_file_not_its_timestamp_directory(tmp_path: Path, name: str,
                                                                                 key: str | None) -> None:
    from nodeagent.config import load_config

    good = {"config.toml": "", "dp.yaml": DP, "mig-config.yaml": MIG, "hooks.yaml": HOOKS}
    good[name] = "version: v1\n  bad: [\n" if name != "config.toml" else "[agent\n"
    configmap_volume(tmp_path, good)
    paths = HostPaths(tmp_path)
    with pytest.raises(ConfigError) as e:
        if key is None:
            load_config(paths)
        else:
            read_config_files(cfg(**{"device_plugin.config": "/etc/nodeagent/dp.yaml",
                                     "mig.hooks_file": "/etc/nodeagent/hooks.yaml"}), paths)
    assert str(e.value).startswith(f"{tmp_path}/etc/nodeagent/{name}"), str(e.value)
    assert "..data" not in str(e.value) and "..2026" not in str(e.value), str(e.value)


def mps(replicas: int) -> str:
    return f"version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {replicas}\n"


UNSERVABLE = ("/etc/dp.yaml: sharing.mps.resources[0] (nvidia.com/gpu): replicas 100 is more than the 48 clients "
              "one MPS server accepts on GPU 0 (Test GPU, compute capability 9.0)")


async def test_mps_replicas_no_gpu_can_serve_stop_the_start_before_any_component() -> None:
    from nodeagent.sharing.spec import parse_plugin_config

    def read(config: AgentConfig, paths: HostPaths) -> ConfigFiles:
        return ConfigFiles(plugin_config=parse_plugin_config(mps(100), source="/etc/dp.yaml"))

    log: list[str] = []
    d = Daemon(AgentConfig(), HostPaths(Path("/")), gpu_factory=lambda c, p: Gpus(),
               specs=[ComponentSpec("dp", frozenset({"device_plugin"}), lambda ctx: Recorder("dp", log))],
               notifier=Notifier({}), ready_fallback=5, read_files=read)
    with pytest.raises(ConfigError) as e:
        await asyncio.wait_for(d.run(install_signals=False), 5)
    assert str(e.value) == UNSERVABLE and e.value.exit_code == 2
    assert log == []


async def test_a_reload_to_mps_replicas_no_gpu_can_serve_is_rejected_and_changes_nothing() -> None:
    from nodeagent.sharing.spec import parse_plugin_config

    text = [mps(4)]

    def read(config: AgentConfig, paths: HostPaths) -> ConfigFiles:
        return ConfigFiles(plugin_config=parse_plugin_config(text[-1], source="/etc/dp.yaml"),
                           digests={"device_plugin": text[-1]})

    log: list[str] = []
    d = Daemon(AgentConfig(), HostPaths(Path("/")), gpu_factory=lambda c, p: Gpus(),
               specs=[ComponentSpec("dp", frozenset({"device_plugin"}), lambda ctx: Recorder("dp", log))],
               notifier=Notifier({}), reload_config=AgentConfig, ready_fallback=5, read_files=read)
    task = asyncio.create_task(d.run(install_signals=False))
    await wait_for(lambda: d._ready_sent)
    running = d.files
    text.append(mps(100))
    await d.reload()
    assert d.files is running and d.files.plugin_config.sharing.resources[0].replicas == 4
    assert f"reload rejected: {UNSERVABLE}" in d.status_line()
    assert [x for x in log if x.startswith(("start", "stop"))] == [f"start dp node={d.node_name}"]
    d.request_stop()
    await asyncio.wait_for(task, 5)


def test_run_refuses_an_mps_config_the_gpus_cannot_serve_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nodeagent.cli import main

    dp = write(tmp_path, "/etc/dp.yaml", mps(100))
    with pytest.raises(SystemExit) as e:
        main(["--root", str(tmp_path), "run", "--simulate", "dgx-h100", "--no-kube", "--metrics-address", "",
              "--device-plugin-config", str(dp)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"error: {dp}: sharing.mps.resources[0] (nvidia.com/gpu): replicas 100 is more "
                                    "than the 48 clients one MPS server accepts on GPU 0 (NVIDIA H100 80GB HBM3, "
                                    "compute capability 9.0)"), err
    assert not (tmp_path / "var/lib/kubelet/device-plugins").exists() or not any(
        (tmp_path / "var/lib/kubelet/device-plugins").glob("nvidia-*.sock"))
