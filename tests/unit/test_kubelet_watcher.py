"""KubeletWatcher: a kubelet restart (kubelet.sock created again) is noticed, also through symlinks."""

from __future__ import annotations

import asyncio
import socket
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
