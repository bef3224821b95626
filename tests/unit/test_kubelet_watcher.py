"""KubeletWatcher: a kubelet restart (kubelet.sock created again) is noticed, also through symlinks."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from nodeagent.deviceplugin.registrar import KUBELET_SOCKET, KubeletWatcher


def _bind(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
    except OSError:
        s.close()  # never left for the garbage collector to report in another test
        raise
    return s


async def _restarts_seen(watched: Path, real: Path) -> int:
    """Create kubelet.sock in ``real`` twice (as a kubelet restart does); count the callbacks."""
    seen = asyncio.Event()
    count = 0

    def on_start() -> None:
        nonlocal count
        count += 1
        seen.set()

    watcher = KubeletWatcher(watched, on_start)
    watcher.start()
    try:
        for _ in range(2):
            seen.clear()
            sock = _bind(real / KUBELET_SOCKET)
            try:
                await asyncio.wait_for(seen.wait(), 5.0)
            finally:
                sock.close()
                (real / KUBELET_SOCKET).unlink()
    except asyncio.TimeoutError:
        pass
    finally:
        await watcher.stop()
    return count


@pytest.mark.parametrize("layout", ["plain", "dir-is-symlink", "parent-is-symlink", "relative-symlink"])
async def test_kubelet_sock_creation_is_seen(tmp_path: Path, layout: str) -> None:
    real = tmp_path / "real" / "device-plugins"
    real.mkdir(parents=True)
    if layout == "plain":
        watched = real
    elif layout == "dir-is-symlink":
        watched = tmp_path / "device-plugins"
        watched.symlink_to(real, target_is_directory=True)
    elif layout == "parent-is-symlink":
        (tmp_path / "kubelet").symlink_to(real.parent, target_is_directory=True)
        watched = tmp_path / "kubelet" / "device-plugins"
    else:
        watched = tmp_path / "dp"
        watched.symlink_to("real/device-plugins", target_is_directory=True)
    assert await _restarts_seen(watched, real) == 2


async def test_other_files_are_ignored(tmp_path: Path) -> None:
    calls: list[int] = []
    watcher = KubeletWatcher(tmp_path, lambda: calls.append(1))
    watcher.start()
    try:
        sock = _bind(tmp_path / "other.sock")
        (tmp_path / "kubelet.sock.tmp").write_text("")
        await asyncio.sleep(0.3)
        sock.close()
    finally:
        await watcher.stop()
    assert calls == []


async def test_under_a_root_an_absolute_link_is_followed_inside_the_root(tmp_path: Path) -> None:
    """The device-plugins directory as an absolute link out of the root: the watcher makes and watches the
    directory the link names inside the root, as a chroot would, and never the one outside."""
    from nodeagent.hostpaths import HostPaths

    # short directories of their own: the socket inside the root repeats the outside path below the root
    root, outside = Path(tempfile.mkdtemp(prefix="r", dir="/tmp")), Path(tempfile.mkdtemp(prefix="o", dir="/tmp"))
    (root / "var/lib/kubelet").mkdir(parents=True)
    link = root / "var/lib/kubelet/device-plugins"
    link.symlink_to(outside, target_is_directory=True)
    inside = root / str(outside).lstrip("/")
    calls: list[int] = []
    watcher = KubeletWatcher(link, lambda: calls.append(1), HostPaths(root))
    watcher.start()
    try:
        assert inside.is_dir()
        outer = _bind(outside / KUBELET_SOCKET)  # a kubelet of the host, outside the root: not ours to see
        await asyncio.sleep(0.3)
        outer.close()
        assert calls == []
        inner = _bind(inside / KUBELET_SOCKET)
        for _ in range(50):
            if calls:
                break
            await asyncio.sleep(0.1)
        inner.close()
        assert calls, "kubelet.sock made inside the root was not seen"
        assert os.listdir(outside) == [KUBELET_SOCKET]  # nothing of the watcher's outside
    finally:
        await watcher.stop()
        shutil.rmtree(root)
        shutil.rmtree(outside)
