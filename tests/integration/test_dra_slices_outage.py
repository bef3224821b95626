"""The DRA pool through an API outage, on every release the DRA tests run against (v1.34.4 to v1.37.2, the
session's shared API servers of tests/integration/_releases.py): a failed slice write is retried and the
pool catches up once the API is back. Only the forwarder between the agent and the server is cut."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from nodeagent.kube.client import KubeClient, connect
from tests.integration._releases import shared_release_apiserver
from tests.integration.test_dra_slices import slices_of
from tests.peers.apiserver import KubeApiServer
from tests.unit._dp_inventories import nvswitch_box

pytestmark = pytest.mark.peers

kube_apiserver = shared_release_apiserver


async def test_component_resyncs_slices_after_an_api_outage(
    kube_apiserver: KubeApiServer, kube: KubeClient, node_name: str, tmp_path: Path
) -> None:
    """The agent reaches the API only through a forwarder that is cut while the inventory changes."""
    import asyncio
    import shutil
    import tempfile

    from nodeagent.dra.component import DraComponent
    from nodeagent.hostpaths import HostPaths
    from tests.e2e._proxy import forwarded

    kubeconfig = tmp_path / "kubeconfig"
    outage = forwarded(kube_apiserver.url, kube_apiserver.kubeconfig, kubeconfig)
    agent_kube = KubeClient(connect(kubeconfig))
    root = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    dra = DraComponent(paths=HostPaths(root), kube=agent_kube, node_name=node_name, verify_interval_s=60)
    inv = nvswitch_box(3)
    cut = False
    try:
        await dra.start(inv)
        assert await dra.wait_published() == 1
        outage.cut()
        cut = True
        lost = replace(inv, gpus=(*inv.gpus[:2], replace(inv.gpus[2], lost=True)))
        await dra.on_inventory(lost)
        for _ in range(100):  # the write fails and is retried
            if dra.last_error:
                break
            await asyncio.sleep(0.05)
        assert dra.last_error
        assert sorted(d["name"] for s in slices_of(kube, node_name) for d in s["spec"]["devices"]) == [
            "gpu-0",
            "gpu-1",
            "gpu-2",
        ]
        outage.restore()
        cut = False
        assert await dra.wait_published(timeout=30) == 2
        [s] = slices_of(kube, node_name)
        assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0", "gpu-1"]
        assert s["spec"]["pool"]["generation"] == 2
        assert dra.last_error == ""
    finally:
        if cut:
            outage.restore()
        await dra.stop()
        agent_kube.close()
        outage.cut()
        shutil.rmtree(root, ignore_errors=True)
    assert slices_of(kube, node_name) == []
