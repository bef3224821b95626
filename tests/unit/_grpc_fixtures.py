"""Fixtures the unit tests of the gRPC servers share (made available to every test by tests/conftest.py): a
short directory for Unix sockets, a device-plugin service on a two-GPU NVSwitch box, and a DRA driver server
with one claim the API server knows."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from nodeagent.deviceplugin.service import DevicePluginService
from nodeagent.dra.health import HealthFeed
from nodeagent.dra.server import DraServer
from tests.unit._dp_inventories import nvswitch_box
from tests.unit.test_dra_service import Claims, claim, make_preparer


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Socket paths must stay under 108 bytes: pytest's tmp_path is too deep."""
    d = Path(tempfile.mkdtemp(prefix="na-sock-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def service(short_dir: Path) -> AsyncIterator[DevicePluginService]:
    """The device-plugin service on two NVSwitch GPUs, its sockets in ``short_dir/dp``."""
    svc = DevicePluginService(plugin_dir=short_dir / "dp")
    await svc.start(nvswitch_box(2))
    try:
        yield svc
    finally:
        await svc.stop()


@pytest.fixture
async def served(short_dir: Path) -> AsyncIterator[tuple[DraServer, Claims]]:
    """The DRA driver's servers under ``short_dir/kubelet`` with claim ``u1`` (request gpu → gpu-1) known."""
    claims = Claims(claim("u1", "one", [("gpu", "gpu-1")]))
    p = make_preparer(short_dir, claims)
    feed = HealthFeed()
    await feed.update(sorted(p.devices), {})
    server = DraServer(short_dir / "kubelet", p, feed)
    await server.start()
    try:
        yield server, claims
    finally:
        await server.stop()
