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


async def test_a_start_cancelled_midway_is_still_the_servers_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kubelet restart cancels the registration of the last one while its server is being started in the
    servers' thread: that start used to go on unseen (``running`` False) and publish its socket, which the
    next start then took for another plugin's ("served by another process", nothing registered until the
    kubelet removed it). Now the server so started is the server's own: stopped by ``stop``, replaced by
    ``start``."""
    import asyncio
    import contextlib
    import tempfile
    import threading

    import nodeagent.deviceplugin.server as dp_server
    from nodeagent.grpcadapter.server import LoopThreadServer
    from nodeagent.sharing.devices import build_resources
    from nodeagent.sharing.spec import DEFAULT_CONFIG

    entered, go = threading.Event(), threading.Event()
    real_start = LoopThreadServer.start

    def held_start(self: LoopThreadServer) -> None:
        entered.set()
        go.wait(10)
        real_start(self)

    with tempfile.TemporaryDirectory(prefix="na-sock-", dir="/tmp") as d:
        resource = build_resources(nvswitch_box(1), DEFAULT_CONFIG)["nvidia.com/gpu"]
        server = dp_server.ResourceServer(Path(d), resource, DEFAULT_CONFIG.flags.plugin, scores={},
                                          policy=DEFAULT_CONFIG.allocation_policy, health_of=lambda _: True)
        monkeypatch.setattr(LoopThreadServer, "start", held_start)
        task = asyncio.create_task(server.start())
        await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        await asyncio.sleep(0)
        go.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert task.cancelled()
        monkeypatch.setattr(LoopThreadServer, "start", real_start)
        assert server.running  # the server the cancelled start brought up is known
        await server.stop()
        assert not server.socket_path.exists()  # and stopped with its socket
        await server.start()  # a start after it meets no "other process"
        assert server.running and dp_server.foreign_listener(server.socket_path) is None
        # a socket of this process left at the path (not this server's) is no other plugin's either
        await server.stop()
        stray = LoopThreadServer(server.socket_path, [], refusals=server.refusals)
        await asyncio.to_thread(stray.start)
        try:
            await server.start()
            assert server.running
        finally:
            await asyncio.to_thread(stray.stop, 0)
        await server.stop()
        assert not server.socket_path.exists()


async def test_a_live_socket_of_another_process_is_left_alone() -> None:
    """The no-fight rule: a socket another process listens on at our name is never replaced."""
    import subprocess
    import sys
    import tempfile

    from nodeagent.deviceplugin.server import ForeignPluginError, foreign_listener

    with tempfile.TemporaryDirectory(prefix="na-sock-", dir="/tmp") as d:
        path = Path(d) / "nvidia-gpu.sock"
        with subprocess.Popen(
            [sys.executable, "-c", "import socket, sys; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); "
             "s.listen(); print('up', flush=True); sys.stdin.read()", str(path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as other:
            assert other.stdout is not None and other.stdout.readline() == "up\n"
            assert foreign_listener(path) == other.pid
            service = DevicePluginService(plugin_dir=Path(d))
            await service.start(nvswitch_box(1))
            assert not service.server("nvidia.com/gpu").running
            assert "is served by another process (process" in service.failures["nvidia.com/gpu"]
            with pytest.raises(ForeignPluginError):
                await service.server("nvidia.com/gpu").start()
            await service.stop()
            assert path.is_socket() and foreign_listener(path) == other.pid
            other.kill()
