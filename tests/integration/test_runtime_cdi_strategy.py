"""The containerd wiring switches CDI on by itself when the device plugin hands out CDI device names
(``deviceListStrategy`` ``cdi-annotations`` or ``cdi-cri``), where the installed containerd needs it:

* containerd 1.7 reads ``enable_cdi`` (default false): nodeagent writes ``enable_cdi = true``;
* containerd 2.0-2.3 have CDI on by default (only an explicit ``false`` turns it off);
* containerd 2.4 dropped the key (CDI always on): nothing is written, and the running containerd 2.4's
  CRI service reports CDI on.

Unlike ``[runtime] cdi = true`` this adds no ``nvidia-cdi`` runtime: the device plugin's CDI names are
injected by containerd itself. Driven through ``bootstrap``'s runtime step with an agent config whose
device-plugin config names the strategy. There is no containerd 1.7 peer: for 1.7 the test gives nodeagent
a ``containerd --version`` that says 1.7, checks the key in the drop-in, and Debian's containerd 1.6 judges
that the result still loads with the nvidia runtime (1.6 itself has no CDI and ignores the key).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from nodeagent.bootstrap import _configure_runtime
from nodeagent.config import AgentConfig, DevicePluginSettings, RuntimeSettings
from nodeagent.runtime.configure import options_from_settings
from nodeagent.runtime.containerd import DEFAULT_BINARY
from tests.integration._containerd import ContainerdHostPaths
from tests.peers.containerd import Containerd
from tests.peers.containerd2 import Containerd2

if sys.version_info >= (3, 11):
    import tomllib
else:  # the backport of the same parser
    import tomli as tomllib

pytestmark = pytest.mark.peers

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "containerd"
V2_CRI = "io.containerd.grpc.v1.cri"


def _agent(tmp: Path, fixture: str, strategy: str) -> tuple[AgentConfig, Path]:
    etc = tmp / "etc"
    etc.mkdir(parents=True)
    config = etc / "config.toml"
    config.write_text((FIXTURES / fixture).read_text().replace("/etc/containerd/", f"{etc}/"))
    plugin = tmp / "device-plugin.yaml"
    plugin.write_text(f"version: v1\nflags:\n  plugin:\n    deviceListStrategy: {strategy}\n")
    agent = dataclasses.replace(
        AgentConfig(),
        device_plugin=DevicePluginSettings(config=str(plugin)),
        runtime=RuntimeSettings(containerd_config=str(config), mode="drop-in",
                                dropin=str(etc / "conf.d" / "99-nvidia.toml"), leak_guard=False),
    )  # fmt: skip
    return agent, config


def _fake_containerd(tmp: Path, version: str) -> Path:
    script = tmp / "containerd-version"
    script.write_text(f"#!/bin/sh\necho 'containerd github.com/containerd/containerd {version} 0123456'\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(
    ("strategies", "expected"),
    [((), False), (("envvar",), False), (("volume-mounts",), False), (("cdi-cri",), True),
     (("envvar", "cdi-annotations"), True)],
)  # fmt: skip
def test_strategies_that_need_cdi_injection(strategies: tuple[str, ...], expected: bool) -> None:
    opts = options_from_settings(RuntimeSettings(), device_list_strategies=strategies)
    assert opts.cdi_devices is expected and opts.cdi is False


def test_containerd_2_4_has_cdi_on_without_a_key(containerd2: Containerd2, tmp_path: Path) -> None:
    agent, config = _agent(tmp_path, "v2/containerd-2.4-default.toml", "cdi-cri")
    paths = ContainerdHostPaths(Path("/"), state=tmp_path / "state", containerd=containerd2.binary)
    _configure_runtime(agent, paths)
    dropin = Path(agent.runtime.dropin)
    assert dropin.exists() and "enable_cdi" not in dropin.read_text() + config.read_text()
    running = containerd2.start(config)
    status = containerd2.cri_status(running)
    assert "nvidia" in status.handlers and "nvidia-cdi" not in status.handlers
    assert status.config.get("enableCDI", True) is True and status.config["cdiSpecDirs"]
    assert running.runtimes["nvidia"]["Options"]["BinaryName"] == DEFAULT_BINARY


@pytest.mark.parametrize(("strategy", "written"), [("cdi-annotations", True), ("cdi-cri", True), ("envvar", False)])
def test_containerd_1_7_gets_enable_cdi_for_cdi_strategies(
    containerd: Containerd, tmp_path: Path, strategy: str, written: bool
) -> None:
    agent, config = _agent(tmp_path, "containerd-1.7-systemd.toml", strategy)
    paths = ContainerdHostPaths(Path("/"), state=tmp_path / "state",
                                containerd=_fake_containerd(tmp_path, "v1.7.22"))  # fmt: skip
    result = _configure_runtime(agent, paths)
    dropin = tomllib.loads(Path(agent.runtime.dropin).read_text())
    cri = dropin["plugins"][V2_CRI]
    assert cri.get("enable_cdi") is (True if written else None)
    assert set(cri["containerd"]["runtimes"]) >= {"nvidia"} and "nvidia-cdi" not in cri["containerd"]["runtimes"]
    assert not any("no CDI support" in w for w in result.details.get("warnings", []))
    # Debian's containerd (1.6) still loads the result with the nvidia runtime from the drop-in
    dump = containerd.config_dump(config)
    assert dump["plugins"][V2_CRI]["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == DEFAULT_BINARY


def test_containerd_1_6_is_told_it_has_no_cdi(containerd: Containerd, tmp_path: Path) -> None:
    """Debian's containerd 1.6 itself: the key is written but a warning says 1.6 cannot use it."""
    agent, _ = _agent(tmp_path, "containerd-1.7-systemd.toml", "cdi-cri")
    paths = ContainerdHostPaths(Path("/"), state=tmp_path / "state", containerd=containerd.binary)
    result = _configure_runtime(agent, paths)
    assert any("no CDI support" in w for w in result.details.get("warnings", []))
