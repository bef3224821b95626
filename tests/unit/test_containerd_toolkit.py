"""The leak-guard editor for nvidia-container-runtime's config.toml, and host fact detection."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.errors import ConfigError
from nodeagent.hostpaths import HostPaths
from nodeagent.runtime import host, toolkit

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "toolkit" / "config.toml"


def test_leak_guard_adds_keys_and_keeps_everything_else() -> None:
    old = FIXTURE.read_text()
    new = toolkit.render_leak_guard(old)
    assert toolkit.leak_guard_on(new) and not toolkit.leak_guard_on(old)
    assert toolkit.render_leak_guard(new) == new
    added = [ln for ln in new.splitlines() if ln not in old.splitlines()]
    assert added == [
        "accept-nvidia-visible-devices-envvar-when-unprivileged = false",
        "accept-nvidia-visible-devices-as-volume-mounts = true",
    ]
    # the keys are top-level: before the first table
    assert new.index("accept-nvidia-visible-devices-as-volume-mounts = true") < new.index("[nvidia-container-cli]")


def test_leak_guard_flips_existing_values_in_place() -> None:
    old = "accept-nvidia-visible-devices-envvar-when-unprivileged = true # was open\n[x]\ny = 1\n"
    new = toolkit.render_leak_guard(old)
    assert new.startswith("accept-nvidia-visible-devices-envvar-when-unprivileged = false # was open\n")
    back = toolkit.restore_keys(new, old)  # used only when the file was edited since: values, not bytes
    assert [ln for ln in back.splitlines() if ln.strip()] == [ln for ln in old.splitlines() if ln.strip()]


def test_leak_guard_on_missing_file_and_bad_toml() -> None:
    assert toolkit.leak_guard_on(toolkit.render_leak_guard(None))
    with pytest.raises(ConfigError, match="line 1, column"):
        toolkit.render_leak_guard("= nope\n", source="/etc/nvidia-container-runtime/config.toml")


def test_systemd_cgroup_detection(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path)
    assert host.systemd_cgroup(paths) is False
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    assert host.systemd_cgroup(paths) is True
    kubelet = tmp_path / "var/lib/kubelet/config.yaml"
    kubelet.parent.mkdir(parents=True)
    kubelet.write_text("kind: KubeletConfiguration\ncgroupDriver: cgroupfs\n")
    assert host.systemd_cgroup(paths) is False
    kubelet.write_text("kind: KubeletConfiguration\ncgroupDriver: systemd\n")
    assert host.systemd_cgroup(paths) is True
    assert host.cgroup_v2(paths) is False


def test_containerd_version_from_binary_under_root(tmp_path: Path) -> None:
    paths = HostPaths(tmp_path)
    assert host.containerd_version(paths) is None
    real = Path("/usr/bin/containerd")
    assert real.exists(), "install Debian's containerd: apt-get install -y containerd runc"
    (tmp_path / "usr/bin").mkdir(parents=True)
    # A link to the host's binary would point outside the root (HostPaths follows it inside the root, where
    # it loops); a wrapper script inside the root runs the real one.
    wrapper = tmp_path / "usr/bin/containerd"
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    found = host.containerd_version(paths)
    assert found is not None and found[0] >= 1
