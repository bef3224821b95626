"""A MIG change on some GPUs of a DRA node (real kube-apiserver, resource.k8s.io/v1): their devices leave
the node's ResourceSlices at once, the other GPUs' devices stay, and the next inventory lists them again."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from nodeagent.daemon.shared import Shared
from nodeagent.dra.component import DraComponent
from nodeagent.dra.service import ClaimRef
from nodeagent.gpu.inventory import Inventory
from nodeagent.hostpaths import HostPaths
from nodeagent.kube.client import KubeClient
from tests.integration.test_dra_slices import slices_of
from tests.unit._dp_inventories import nvswitch_box

pytestmark = pytest.mark.peers


class Plane:
    """What the daemon's DRA component hands ``Shared.dra``, around a bare ``DraComponent``."""

    def __init__(self, dra: DraComponent) -> None:
        self.dra = dra

    async def withdraw(self, gpu_indices: set[int]) -> None:
        await self.dra.withdraw(gpu_indices)

    async def readvertise(self, gpu_indices: set[int]) -> None:
        await self.dra.readvertise(gpu_indices)

    async def update(self, inventory: Inventory) -> None:
        await self.dra.on_inventory(inventory)

    def claims_on(self, gpu_indices: frozenset[int]) -> dict[int, tuple[ClaimRef, ...]]:
        return self.dra.claims_on(gpu_indices)


def listed(kube: KubeClient, node: str) -> list[str]:
    return sorted(d["name"] for s in slices_of(kube, node) for d in s["spec"]["devices"])


async def test_withdrawn_gpus_leave_the_slices_until_readvertised(kube: KubeClient, node_name: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    dra = DraComponent(paths=HostPaths(root), kube=kube, node_name=node_name, verify_interval_s=60)
    inv = nvswitch_box(3)

    shared = Shared()
    plane = Plane(dra)
    shared.dra.attach(plane)
    try:
        await dra.start(inv)
        assert await dra.wait_published() == 1
        await shared.advertiser.withdraw({1})  # through the link the MIG reconciler uses
        assert await dra.wait_published() == 2
        assert listed(kube, node_name) == ["gpu-0", "gpu-2"]
        await shared.advertiser.withdraw({1})  # again: nothing more to write
        assert await dra.wait_published() == 2
        await shared.advertiser.update(inv)  # a new inventory keeps a withdrawn GPU out
        assert await dra.wait_published() == 2
        assert listed(kube, node_name) == ["gpu-0", "gpu-2"]
        await shared.advertiser.readvertise({1})
        assert await dra.wait_published() == 3
        assert listed(kube, node_name) == ["gpu-0", "gpu-1", "gpu-2"]
        shared.dra.detach(plane)
        await shared.advertiser.withdraw({0})  # no DRA plane attached: nothing happens
        assert listed(kube, node_name) == ["gpu-0", "gpu-1", "gpu-2"]
    finally:
        await dra.stop()
        shutil.rmtree(root, ignore_errors=True)


async def test_a_failing_step_of_stop_still_closes_the_sockets(kube: KubeClient, node_name: str) -> None:
    """The stop's first steps (health monitor, status write) may fail; the kubelet-facing sockets close anyway
    and the error still reaches the caller."""
    root = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    dra = DraComponent(paths=HostPaths(root), kube=kube, node_name=node_name, verify_interval_s=60)
    try:
        await dra.start(nvswitch_box(2))
        server = dra.server
        assert server is not None and server.dra_path.exists() and server.reg_path.exists()

        async def broken() -> None:
            raise RuntimeError("status write failed")

        dra.wait_status_written = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="status write failed"):
            await dra.stop()
        assert dra.server is None and not server.dra_path.exists() and not server.reg_path.exists()
        assert all(t.done() for t in dra._tasks) and not dra._tasks
    finally:
        if dra.server is not None:
            await dra.stop()
        shutil.rmtree(root, ignore_errors=True)
