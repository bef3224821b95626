"""``nodeagent controller`` on the REAL kube-apiserver with NVIDIA's ComputeDomain CRD installed unchanged: the
leader makes the domain's ResourceClaimTemplate (owned by the domain, pinned to one clique), keeps
``status.nodes``/``status.status`` true to what the nodes report on their own Nodes, and a second controller
stands by until the leader's Lease expires (the leader is killed with SIGKILL: no release), then takes over."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.computedomain import reconcile as rc
from nodeagent.computedomain.controller import run
from nodeagent.computedomain.lease import LeaderElector, LeaseConfig
from nodeagent.dra.channels import CLIQUE_LABEL
from nodeagent.errors import KubeError
from nodeagent.kube.client import MERGE_PATCH, KubeClient
from tests.integration._computedomain import install_crd
from tests.integration._kube import wait_for
from tests.peers.apiserver import KubeApiServer

pytestmark = pytest.mark.peers

NS = "cd-tenant"
LEASE_NS = "cd-lease"
CLIQUE = "7b968a6d-c8aa-45e1-9e07-e1e51be99c31.1"
OTHER = "7b968a6d-c8aa-45e1-9e07-e1e51be99c31.2"
CDS = f"/apis/resource.nvidia.com/v1beta1/namespaces/{NS}/computedomains"
RCT = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates"
LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases"


def _node(kube: KubeClient, name: str, clique: str, ip: str) -> None:
    kube.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node",
                                                "metadata": {"name": name, "labels": {CLIQUE_LABEL: clique}}})
    kube.request("PATCH", f"/api/v1/nodes/{name}/status", content_type=MERGE_PATCH,
                 body={"status": {"addresses": [{"type": "InternalIP", "address": ip}]}})


def report(kube: KubeClient, node: str, reports: dict[str, str] | None) -> None:
    """What a node's agent writes on its own Node."""
    value = None if reports is None else rc.encode_report(reports)
    kube.request("PATCH", f"/api/v1/nodes/{node}", content_type=MERGE_PATCH,
                 body={"metadata": {"annotations": {rc.REPORT_ANNOTATION: value}}})


@pytest.fixture(scope="module")
def cluster(kube_apiserver: KubeApiServer, kube: KubeClient) -> Iterator[list[str]]:
    install_crd(kube_apiserver)
    for ns in (NS, LEASE_NS):
        try:
            kube.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                             "metadata": {"name": ns}})
        except KubeError as e:
            assert e.status == 409
    tag = uuid.uuid4().hex[:6]
    nodes = [f"cd-{tag}-a", f"cd-{tag}-b", f"cd-{tag}-c"]
    _node(kube, nodes[0], CLIQUE, "10.77.0.1")
    _node(kube, nodes[1], CLIQUE, "10.77.0.2")
    _node(kube, nodes[2], OTHER, "10.77.0.3")
    yield nodes
    for n in nodes:
        kube.request("DELETE", f"/api/v1/nodes/{n}")


def holder(kube: KubeClient, name: str) -> str:
    try:
        return str(kube.request("GET", f"{LEASE}/{name}")["spec"].get("holderIdentity") or "")
    except KubeError as e:
        assert e.status == 404
        return ""


def get_cd(kube: KubeClient, name: str) -> dict[str, Any]:
    return kube.request("GET", f"{CDS}/{name}")


def test_template_status_and_leader_handover(kube_apiserver: KubeApiServer, kube: KubeClient,
                                             cluster: list[str], tmp_path: Path) -> None:
    a, b, _other_clique = cluster
    lease = f"ctl-{uuid.uuid4().hex[:6]}"
    name = f"job-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    # the leader: `nodeagent controller` as a process, short Lease so the test is quick
    log = (tmp_path / "leader.log").open("wb")
    leader = subprocess.Popen(
        [sys.executable, "-m", "nodeagent", "controller", "--kubeconfig", str(kube_apiserver.kubeconfig),
         "--lease-namespace", LEASE_NS, "--lease-name", lease, "--identity", "first",
         "--lease-duration", "2", "--renew-deadline", "1.5", "--retry-period", "0.2", "--interval", "0.2"],
        stdout=subprocess.DEVNULL, stderr=log,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stop = threading.Event()
    standby = LeaderElector(kube, LeaseConfig(LEASE_NS, lease, "second", 2.0, 1.5, 0.2))
    led_early: list[bool] = []
    thread: threading.Thread | None = None
    try:
        wait_for(lambda: holder(kube, lease) == "first" or leader.poll() is not None, timeout=20)
        assert leader.poll() is None, (tmp_path / "leader.log").read_text()[-2000:]
        print(f"leader up: {time.monotonic() - t0:.1f}s")
        thread = threading.Thread(target=run, args=(kube, standby, stop), kwargs={"interval": 0.2}, daemon=True)
        thread.start()

        cd = kube.request("POST", CDS, body={
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain", "metadata": {"name": name},
            "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"},
                                                "allocationMode": "All"}}})
        uid = cd["metadata"]["uid"]
        tmpl = wait_for(lambda: _get(kube, f"{RCT}/{name}-channel"), timeout=15)
        assert tmpl["metadata"]["ownerReferences"][0]["uid"] == uid
        assert tmpl["metadata"]["annotations"][rc.CLIQUE_ANNOTATION] == CLIQUE  # the larger clique
        params = tmpl["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
        assert params == {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig",
                          "domainID": uid, "allocationMode": "All"}
        wait_for(lambda: get_cd(kube, name).get("status", {}).get("status") == "NotReady", timeout=10)

        # the nodes report: a Ready, b NotReady -> NotReady with both listed; b Ready -> Ready
        report(kube, a, {uid: "Ready"})
        report(kube, b, {uid: "NotReady"})
        st = wait_for(lambda: _status_with(kube, name, 2), timeout=10)
        assert st["status"] == "NotReady"
        assert {n["name"]: (n["ipAddress"], n["cliqueID"], n["status"]) for n in st["nodes"]} == {
            a: ("10.77.0.1", CLIQUE, "Ready"), b: ("10.77.0.2", CLIQUE, "NotReady")}
        assert sorted(n["index"] for n in st["nodes"]) == [0, 1]
        report(kube, b, {uid: "Ready"})
        wait_for(lambda: get_cd(kube, name)["status"]["status"] == "Ready", timeout=10)
        led_early.append(standby.leading)

        # the leader dies without giving the Lease up; the standby takes over once it expired
        killed = time.monotonic()
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        wait_for(lambda: holder(kube, lease) == "second", timeout=15)
        took = time.monotonic() - killed
        print(f"handover after {took:.1f}s")
        assert took >= 1.0, f"the standby took a Lease that had not expired ({took:.2f}s)"
        # and now the standby keeps the domain: a leaves
        report(kube, a, None)
        st = wait_for(lambda: _status_with(kube, name, 1), timeout=10)
        assert st["status"] == "NotReady" and st["nodes"][0]["name"] == b
        # the template of a deleted domain goes (no garbage collector runs here)
        kube.request("DELETE", f"{CDS}/{name}")
        wait_for(lambda: _get(kube, f"{RCT}/{name}-channel") is None, timeout=10)
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait(10)
        stop.set()
        if thread is not None:
            thread.join(10)
        log.close()
        for n in (a, b):
            report(kube, n, None)
    assert led_early == [False], "the standby led while the leader renewed"
    assert holder(kube, lease) == "", "the standby did not give the Lease up on a clean stop"
    print(f"controller test: {time.monotonic() - t0:.1f}s")



def _get(kube: KubeClient, path: str) -> dict[str, Any] | None:
    try:
        return kube.request("GET", path)
    except KubeError as e:
        assert e.status == 404
        return None


def _status_with(kube: KubeClient, name: str, count: int) -> dict[str, Any] | None:
    st = get_cd(kube, name).get("status") or {}
    return st if len(st.get("nodes") or []) == count else None


def test_foreign_template_untouched_and_bad_domain_skipped(kube: KubeClient, cluster: list[str]) -> None:
    """A template of the user's own under the domain's name is never replaced; an invalid report of a Node
    does not stop the pass."""
    from nodeagent.computedomain.controller import Controller

    name = f"mine-{uuid.uuid4().hex[:6]}"
    kube.request("POST", RCT, body={"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                                    "metadata": {"name": name},
                                    "spec": {"spec": {"devices": {"requests": [
                                        {"name": "x", "exactly": {"deviceClassName": "other"}}]}}}})
    kube.request("POST", CDS, body={"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
                                    "metadata": {"name": name},
                                    "spec": {"channel": {"resourceClaimTemplate": {"name": name}}}})
    kube.request("PATCH", f"/api/v1/nodes/{cluster[2]}", content_type=MERGE_PATCH,
                 body={"metadata": {"annotations": {rc.REPORT_ANNOTATION: "not json"}}})
    try:
        res = Controller(kube).reconcile_once()
        assert any("does not own" in p and name in p for p in res.problems), res.problems
        assert any(cluster[2] in p and rc.REPORT_ANNOTATION in p for p in res.problems), res.problems
        assert f"{NS}/{name}" in res.statuses
        still = kube.request("GET", f"{RCT}/{name}")
        assert still["spec"]["spec"]["devices"]["requests"][0]["name"] == "x"
        assert not still["metadata"].get("ownerReferences")
    finally:
        report(kube, cluster[2], None)
        kube.request("DELETE", f"{CDS}/{name}")
        kube.request("DELETE", f"{RCT}/{name}")
    assert json.dumps(res.created) == "[]"


def test_node_reporter_writes_its_own_report_only_when_changed(kube: KubeClient, cluster: list[str]) -> None:
    """The agent's side: its report on its own Node, written once per change, removed when empty; the
    controller reads exactly that value."""
    from nodeagent.computedomain.report import NodeReporter

    node = cluster[0]
    ready = [True]
    rep = NodeReporter(kube, node, imex_ready=lambda: ready[0])
    writes = kube.stats.writes
    assert rep.sync({"u2", "u1"}) and not rep.sync(["u1", "u2"])
    assert kube.stats.writes == writes + 1
    got = kube.request("GET", f"/api/v1/nodes/{node}")
    assert rc.node_facts(got)[0].reports == {"u1": "Ready", "u2": "Ready"}
    ready[0] = False
    assert rep.sync({"u1"})
    assert rc.node_facts(kube.request("GET", f"/api/v1/nodes/{node}"))[0].reports == {"u1": "NotReady"}
    assert rep.sync(set())
    got = kube.request("GET", f"/api/v1/nodes/{node}")
    assert rc.REPORT_ANNOTATION not in (got["metadata"].get("annotations") or {})


async def test_dra_plane_publishes_the_channel_device_of_its_clique(kube: KubeClient) -> None:
    """A node whose GPUs report one NVLink clique publishes ``channel-0`` with that clique in its pool beside its
    GPUs; when the fabric stops agreeing (a GPU in another clique) the channel device leaves the pool."""
    import dataclasses

    from nodeagent.dra.component import DraComponent
    from nodeagent.gpu.inventory import Fabric
    from nodeagent.hostpaths import HostPaths
    from tests.integration._kube import throwaway_node
    from tests.unit._dp_inventories import nvswitch_box

    cluster_uuid = "7b968a6d-c8aa-45e1-9e07-e1e51be99c31"
    ok = Fabric(state=3, status=0, cluster_uuid=cluster_uuid, clique_id=1, health_mask=None, health_summary=1)
    box = nvswitch_box(2)
    inv = dataclasses.replace(box, gpus=tuple(dataclasses.replace(g, fabric=ok) for g in box.gpus))
    root = Path(tempfile.mkdtemp(prefix="cd-", dir="/tmp"))  # socket paths must stay under 108 bytes
    with throwaway_node(kube, "cd-dra") as node:
        dra = DraComponent(paths=HostPaths(root), kube=kube, node_name=node, verify_interval_s=60)
        await dra.start(inv)
        try:
            await dra.wait_published()
            devs = {d["name"]: d for s in kube.list_resource_slices(field_selector=f"spec.nodeName={node}")
                    for d in s["spec"]["devices"]}
            assert sorted(devs) == ["channel-0", "gpu-0", "gpu-1"]
            assert devs["channel-0"]["attributes"] == {"type": {"string": "channel"}, "id": {"int": 0},
                                                       "clique": {"string": f"{cluster_uuid}.1"}}
            split = dataclasses.replace(inv, gpus=(inv.gpus[0], dataclasses.replace(
                inv.gpus[1], fabric=dataclasses.replace(ok, clique_id=2))))
            await dra.on_inventory(split)
            await dra.wait_published()
            names = {d["name"] for s in kube.list_resource_slices(field_selector=f"spec.nodeName={node}")
                     for d in s["spec"]["devices"]}
            assert names == {"gpu-0", "gpu-1"}
        finally:
            await dra.stop()
            shutil.rmtree(root, ignore_errors=True)


def test_changes_are_acted_on_at_once_not_at_the_resync(kube_apiserver: KubeApiServer, kube: KubeClient,
                                                        cluster: list[str]) -> None:
    """The leader watches: with the resync and the retry interval both an hour, a new ComputeDomain gets its
    template and a node's report reaches the domain's status within seconds; while nothing relevant changes
    (a Node's other labels, heartbeats) it sends no request but its Lease renewals."""
    from nodeagent.kube.client import connect

    a, b, _ = cluster
    ctl = KubeClient(connect(kube_apiserver.kubeconfig))  # its own client: its requests are counted apart
    stop = threading.Event()
    elector = LeaderElector(ctl, LeaseConfig(LEASE_NS, f"watch-{uuid.uuid4().hex[:6]}", "w", 2.0, 1.5, 0.2))
    thread = threading.Thread(target=run, args=(ctl, elector, stop),
                              kwargs={"interval": 3600.0, "resync": 3600.0, "watch_timeout_s": 60}, daemon=True)
    warm, name = f"warm-{uuid.uuid4().hex[:6]}", f"quick-{uuid.uuid4().hex[:6]}"

    def domain(n: str) -> dict[str, Any]:
        return kube.request("POST", CDS, body={
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain", "metadata": {"name": n},
            "spec": {"numNodes": 1, "channel": {"resourceClaimTemplate": {"name": f"{n}-channel"}}}})

    domain(warm)
    thread.start()
    try:
        # the first pass on taking the Lease handles what exists already
        wait_for(lambda: _get(kube, f"{RCT}/{warm}-channel"), timeout=15)
        wait_for(lambda: get_cd(kube, warm).get("status", {}).get("status") == "NotReady", timeout=10)
        wait_for(lambda: ctl.stats.watches >= 3, timeout=10)  # Nodes, ComputeDomains, templates

        # quiet: another label on a Node and nothing else wakes no pass (three lists): over 1.5 s only the
        # Lease's renewals (a read and an update each). A pass the watches' first lists woke may still run late
        # on a loaded machine, so the window is tried up to three times, each with a new label change.
        windows: list[dict[str, int]] = []
        for i in range(3):
            before = dict(ctl.stats.by_method)
            kube.request("PATCH", f"/api/v1/nodes/{a}", content_type=MERGE_PATCH,
                         body={"metadata": {"labels": {"example.com/unrelated": str(i)}}})
            t_quiet = time.monotonic()
            wait_for(lambda t=t_quiet: time.monotonic() - t > 1.5, timeout=5)  # type: ignore[misc]
            windows.append({m: n - before.get(m, 0) for m, n in ctl.stats.by_method.items() if n - before.get(m, 0)})
            if set(windows[-1]) <= {"GET", "PUT"} and windows[-1].get("GET", 0) <= windows[-1].get("PUT", 0) + 1:
                break
        else:
            raise AssertionError(f"a change the controller does not read woke a pass: {windows}")

        t0 = time.monotonic()
        uid = domain(name)["metadata"]["uid"]
        wait_for(lambda: _get(kube, f"{RCT}/{name}-channel"), timeout=10)
        made = time.monotonic() - t0
        t1 = time.monotonic()
        report(kube, a, {uid: "Ready"})
        wait_for(lambda: get_cd(kube, name).get("status", {}).get("status") == "Ready", timeout=10)
        ready = time.monotonic() - t1
        print(f"watch: template {made:.2f}s after the domain, status Ready {ready:.2f}s after the report")
        assert made < 10 and ready < 10  # an hour's resync never came into it
        assert ctl.stats.watches >= 3  # Nodes, ComputeDomains, templates
    finally:
        stop.set()
        thread.join(10)
        ctl.close()
        report(kube, a, None)
        kube.request("PATCH", f"/api/v1/nodes/{a}", content_type=MERGE_PATCH,
                     body={"metadata": {"labels": {"example.com/unrelated": None}}})
        for n in (warm, name):
            if _get(kube, f"{CDS}/{n}") is not None:
                kube.request("DELETE", f"{CDS}/{n}")
    assert not thread.is_alive()
    del b
