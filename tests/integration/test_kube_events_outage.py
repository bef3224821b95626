"""Events sent while the API server is unreachable: queued, sent once it answers, never twice."""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from nodeagent.kube.client import KubeClient, connect
from nodeagent.kube.events import GPU_UNHEALTHY, EventRecorder
from nodeagent.kube.node import NodeClient
from tests.e2e._proxy import Outage
from tests.integration._kube import wait_for
from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers


@pytest.fixture
def outage(kube_apiserver: KubeApiServer) -> Iterator[Outage]:
    url = urllib.parse.urlsplit(kube_apiserver.url)
    proxy = Outage((url.hostname or "127.0.0.1", url.port or 443))
    proxy.restore()
    yield proxy
    proxy.cut()


def proxied(server: KubeApiServer, proxy: Outage, dest: Path) -> KubeClient:
    doc = yaml.safe_load(server.kubeconfig.read_text())
    for c in doc["clusters"]:
        c["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    dest.write_text(yaml.safe_dump(doc))
    return KubeClient(connect(dest))


def events_of(kube: KubeClient, node: str) -> list[dict[str, object]]:
    out = kube.request("GET", f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name={node}")
    items: list[dict[str, object]] = out.get("items", [])
    return items


def test_gpu_unhealthy_sent_after_the_api_returns(
    kube: KubeClient, node_name: str, kube_apiserver: KubeApiServer, outage: Outage, tmp_path: Path
) -> None:
    """GpuUnhealthy recorded during an outage was lost for good; now it is queued and sent once, in order."""
    agent_kube = proxied(kube_apiserver, outage, tmp_path / "kubeconfig")
    try:
        node = NodeClient(agent_kube, node_name)
        node.uid()  # known before the outage, as in the running agent
        rec = EventRecorder(node, retry_start_s=0.1, retry_max_s=0.5)
        outage.cut()
        assert rec.health_changed("3 (GPU-x, H100)", False, "XID 79") is False
        assert rec.health_changed("3 (GPU-x, H100)", False, "XID 79") is False  # de-duplicated while queued
        assert rec.record("MigReconfigured", "MIG layout applied") is False  # queued behind it
        assert rec.pending == 2
        time.sleep(1.0)  # a few failed retries
        assert rec.pending == 2 and events_of(kube, node_name) == []
        outage.restore()
        wait_for(lambda: rec.pending == 0, timeout=20)
        got = events_of(kube, node_name)
        assert [e["reason"] for e in sorted(got, key=lambda e: str(e["eventTime"]))] == [GPU_UNHEALTHY,
                                                                                         "MigReconfigured"]
        assert "XID 79" in json.dumps(got)
        # the same event again inside the window is still suppressed after the retry
        assert rec.health_changed("3 (GPU-x, H100)", False, "XID 79") is False
        assert rec.sent == 2 and rec.suppressed == 2
        assert len(events_of(kube, node_name)) == 2
        rec.close()
    finally:
        agent_kube.close()
