"""Device-plugin socket names: one socket per resource, never two resources on one socket."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.deviceplugin.server import socket_name
from nodeagent.deviceplugin.service import DevicePluginService
from nodeagent.errors import ConfigError
from nodeagent.sharing.devices import Resource
from nodeagent.sharing.spec import parse_plugin_config
from tests.unit._dp_inventories import nvswitch_box


def test_nvidia_sockets_keep_their_names() -> None:
    assert socket_name("nvidia.com/gpu") == "nvidia-gpu.sock"
    assert socket_name("nvidia.com/mig-1g.10gb.me") == "nvidia-mig-1g.10gb.me.sock"


def test_another_domain_gets_its_own_socket() -> None:
    """``example.com/gpu`` used to be served on nvidia-gpu.sock next to nvidia.com/gpu (one orphaned)."""
    names = ["nvidia.com/gpu", "example.com/gpu", "nvidia.com/example.com_gpu", "example.com/gpu.shared",
             "a.example.com/gpu", "nvidia.com/gpu-a", "nvidia.com/gpu_a"]
    sockets = [socket_name(n) for n in names]
    assert len(set(sockets)) == len(names), sockets
    assert socket_name("example.com/gpu") == "nvidia--example.com_gpu.sock"


async def test_a_rename_into_another_domain_is_served_beside_the_gpus(tmp_path: Path) -> None:
    cfg = parse_plugin_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - {name: nvidia.com/gpu, replicas: 2, devices: [0], rename: example.com/gpu}\n", source="dp.yaml")
    service = DevicePluginService(plugin_dir=tmp_path, plugin_config=cfg)
    await service.update(nvswitch_box(2))  # not started: validation only
    assert service.config is cfg


def test_two_resources_on_one_socket_are_refused_with_one_line() -> None:
    # names that only differ in a character a file name cannot hold (never valid resource names; the check
    # is the last line of defence)
    a, b = Resource(name="nvidia.com/gpu-x", devices=()), Resource(name="nvidia.com/gpu+x", devices=())
    with pytest.raises(ConfigError) as err:
        DevicePluginService._checked({a.name: a, b.name: b}, "dp.yaml")
    msg = str(err.value)
    assert "\n" not in msg
    assert "nvidia.com/gpu-x and nvidia.com/gpu+x would both be served on socket nvidia-gpu-x.sock" in msg


async def test_stopping_leaves_a_socket_another_plugin_put_at_our_name() -> None:
    """NVIDIA's plugin removes whatever is at its socket name when it starts and binds its own: nodeagent,
    stopping later (a kubelet restart, a reload, exit), must not remove that plugin's socket in turn."""
    import socket
    import tempfile

    with tempfile.TemporaryDirectory(prefix="na-sock-", dir="/tmp") as d:
        service = DevicePluginService(plugin_dir=Path(d))
        await service.start(nvswitch_box(1))
        path = Path(d) / "nvidia-gpu.sock"
        assert path.is_socket()
        path.unlink()  # the other plugin's start: cleanup, then its own socket at the same name
        other = socket.socket(socket.AF_UNIX)
        other.bind(str(path))
        other.listen()
        try:
            await service.stop()
            assert path.is_socket()  # still the other plugin's
        finally:
            other.close()
        path.unlink()
        service = DevicePluginService(plugin_dir=Path(d))
        await service.start(nvswitch_box(1))
        await service.stop()
        assert not path.exists()  # its own socket goes with it
