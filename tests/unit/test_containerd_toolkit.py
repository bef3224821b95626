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
    assert new.index("accept-nvidia-visible-devices-as-volume-mounts = true") < new.index(
        "[nvidia-container-cli]"
    )


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


def test_containerd_version_under_root_never_runs_the_roots_binary(tmp_path: Path) -> None:
    """A root (an image, another disk) is read, never executed: a containerd there that would run leaves
    no trace; the version comes from the root's dpkg database or the binary's Go build information."""
    paths = HostPaths(tmp_path)
    assert host.containerd_version(paths) is None
    marker = tmp_path.parent / f"{tmp_path.name}-ran"
    wrapper = tmp_path / "usr/bin/containerd"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(
        f"#!/bin/sh\ntouch {marker}\necho 'containerd github.com/containerd/containerd 1.7.0'\n"
    )
    wrapper.chmod(0o755)
    assert host.containerd_version(paths) is None
    assert not marker.exists()
    status = tmp_path / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True)
    status.write_text(
        "Package: containerd\nStatus: deinstall ok config-files\nVersion: 1.4.1-1\n\n"
        "Package: runc\nStatus: install ok installed\nVersion: 1.1.5+ds1-1\n\n"
        "Package: containerd.io\nStatus: install ok installed\nVersion: 1:1.7.25-1\n"
    )
    assert host.containerd_version(paths) == (1, 7, 25)
    assert not marker.exists()


def _buildinfo(mod_lines: list[str]) -> bytes:
    def uvarint_string(text: str) -> bytes:
        data, n, out = text.encode(), len(text), b""
        while True:
            out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
            n >>= 7
            if not n:
                return out + data

    header = b"\xff Go buildinf:" + bytes([8, 2]) + bytes(16)
    return (
        b"\x7fELF" + bytes(200) + header + uvarint_string("go1.26.8") + uvarint_string("\n".join(mod_lines))
    )


@pytest.mark.parametrize(
    ("lines", "want"),
    [
        (
            [
                "path\tnodeagent.test/containerd2/cmd/containerd",
                "mod\tnodeagent.test/containerd2\t(devel)\t",
                "dep\tgithub.com/containerd/containerd/v2\tv2.4.2\th1:x=",
                "build\tCGO_ENABLED=0",
            ],
            (2, 4, 2),
        ),
        (
            [
                "path\tgithub.com/containerd/containerd/cmd/containerd",
                "mod\tgithub.com/containerd/containerd\tv1.7.27-0.20250101000000-abcdef123456\t",
            ],
            (1, 7, 27),
        ),
        (["path\tgithub.com/containerd/containerd/cmd/containerd", "build\t-compiler=gc"], None),
    ],
)
def test_containerd_version_from_go_build_information(
    tmp_path: Path, lines: list[str], want: tuple[int, int, int] | None
) -> None:
    binary = tmp_path / "usr/local/bin/containerd"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(_buildinfo(lines) + bytes(64))
    assert host.containerd_version(HostPaths(tmp_path)) == want


def test_containerd_version_on_the_host_asks_the_binary() -> None:
    real = Path("/usr/bin/containerd")
    assert real.exists(), "install Debian's containerd: apt-get install -y containerd runc"
    found = host.containerd_version(HostPaths(Path("/")))
    assert found is not None and found[0] >= 1
