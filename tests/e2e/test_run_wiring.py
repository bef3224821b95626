"""``nodeagent run`` as a real process, for the connections between its parts: a metrics port already in use
(one error, the agent serves on, binds later), a busy-GPU MIG refusal naming the pod (kubelet checkpoint +
PodResources from the real device manager), a health change reaching the Node at once (periodic resync
set to 5 minutes), MIG and publish results in the agent's own metrics; and the built-in metrics default."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nodeagent.kube.gpuobjects import API_PATH
from nodeagent.simulator.inject import inject_process
from nodeagent.simulator.state import SimStore
from tests._metrics import scrape_or_none
from tests.e2e._agent import ROOT, eventually, fresh_node_with_gpu_crd, node_root, running_agent
from tests.peers.apiserver import KubeApiServer
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

POD_UID = "3d1f5b8c-2a4e-4f60-9b7d-0c1e2f3a4b5c"


def events(server: KubeApiServer, node: str) -> list[tuple[str, str, str]]:
    status, body = server.get(f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{node}")
    assert status == 200, body
    return [(e["reason"], e["type"], e["message"]) for e in json.loads(body)["items"]]


def test_port_in_use_busy_gpu_names_the_pod_and_health_reaches_the_node_at_once(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    node = "e2e-wiring"
    fresh_node_with_gpu_crd(kube_apiserver, node)
    holder = socket.socket()  # the metrics port, taken by "another exporter"
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    sim_state = kubelet_harness.workdir / "sim.json"  # inside the root node_root gives
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'kubeconfig = "{kube_apiserver.kubeconfig}"\nresync_interval = 300.0\n'
                   "[runtime]\nenabled = false\n[metrics]\ninterval = 1.0\n"
                   "[mig]\nrelease_timeout = 0\n"  # a GPU a pod holds: refused at once, naming the process
                   '[kubelet]\npod_resources_socket = "/var/lib/kubelet/pod-resources.sock"\n')
    args = ["run", "--config", str(cfg), "--simulate", "a30x4", "--sim-state", str(sim_state), "--node-name", node]
    try:
        with node_root(kubelet_harness) as root, \
                running_agent(tmp_path, root, args, metrics=f"127.0.0.1:{port}") as agent:
            agent.wait_notify("READY=1", timeout=20)
            kubelet_harness.wait("nvidia.com/gpu", registered=True, total=4, healthy=4, timeout=20)
            eventually(lambda: len(json.loads(kube_apiserver.get(
                f"{API_PATH}?labelSelector=nodeagent.io%2Fnode%3D{node}")[1]).get("items") or []) == 4, 20,
                "4 GPU objects")
            assert agent.log().count(f"metrics: cannot listen on 127.0.0.1:{port}: Address already in use") == 1
            assert agent.proc.poll() is None

            # a pod holds one GPU through the kubelet; its process runs there (cgroup names the pod UID)
            store = SimStore.open("a30x4", sim_state)
            alloc = kubelet_harness.allocate("nvidia.com/gpu", 1, pod="train-0", namespace="ml", pod_uid=POD_UID)
            uuid = alloc.device_ids[0].split("::", 1)[0]
            busy = next(i for i, g in enumerate(store.machine.gpus) if g.uuid == uuid)
            proc = root / "proc/4242"
            proc.mkdir(parents=True)
            (proc / "cmdline").write_bytes(b"python\0train.py\0")
            (proc / "cgroup").write_text("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
                                         f"{POD_UID.replace('-', '_')}.slice/cri-containerd-0123abcd.scope\n")
            inject_process(store, busy, 4242, "python")

            status, body = kube_apiserver.request(
                "PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": {"nvidia.com/mig.config": "all-enabled"}}},
                content_type="application/merge-patch+json")
            assert status == 200, body
            (refusal,) = eventually(lambda: [e for e in events(kube_apiserver, node) if e[0] == "MigConfigFailed"],
                                    30, "MigConfigFailed event")
            assert f"GPU {busy} is held by pod ml/train-0 after waiting 0s" in refusal[2], refusal
            assert f"GPU {busy}: pid 4242 (python train.py) in pod ml/train-0 (uid {POD_UID})" in refusal[2], refusal

            # a health change with the periodic resync 5 minutes away: Event and GPU object state come at once
            holder.close()  # the port frees up; the resync the health change asks for binds it
            sick = (busy + 1) % 4
            t0 = time.monotonic()
            injected = subprocess.run([sys.executable, "-m", "nodeagent", "sim", "inject", "xid", "--sim-state",
                                       str(sim_state), "--gpu", str(sick), "--code", "48"],
                                      capture_output=True, text=True, timeout=30)
            assert injected.returncode == 0, injected.stderr
            eventually(lambda: any(e[0] == "GpuUnhealthy" and e[2].startswith(f"GPU {sick} ")
                                   for e in events(kube_apiserver, node)), 15, "GpuUnhealthy event")
            eventually(lambda: json.loads(kube_apiserver.get(f"{API_PATH}/{node}-gpu{sick}")[1])["status"]["state"]
                       == "Unhealthy", 15, "GPU object state Unhealthy")
            took = time.monotonic() - t0
            assert took < 15, took

            def last_xids() -> dict[str, float] | None:
                scraped = scrape_or_none(port)
                if scraped is None:
                    return None
                xids = {lab["gpu"]: v for lab, v in scraped.get("DCGM_FI_DEV_XID_ERRORS", [])}
                return xids if xids.get(str(sick)) == 48 else None

            # the XID the device plugin's health monitor saw reaches DCGM_FI_DEV_XID_ERRORS of that GPU only
            xids = eventually(last_xids, 15, f"DCGM_FI_DEV_XID_ERRORS 48 for GPU {sick}")
            assert xids == {str(i): (48.0 if i == sick else 0.0) for i in range(4)}, xids
            metrics = eventually(lambda: scrape_or_none(port), 10, "metrics endpoint after the port freed up")
            reconciles = {(lab["component"], lab["result"]): v for lab, v in metrics["nodeagent_reconciles_total"]}
            assert reconciles == {("mig", "failed"): 1.0}, reconciles
            assert {lab["component"] for lab, _ in metrics["nodeagent_apply_duration_seconds_count"]} == {"mig"}
            writes = {lab["target"]: v for lab, v in metrics.get("nodeagent_publish_writes_total", [])}
            assert writes.get("labels", 0) >= 1 and writes.get("gpu_objects", 0) >= 4, writes
            listening = [c.laddr for c in psutil.Process(agent.pid).net_connections(kind="inet")
                         if c.status == "LISTEN"]
            assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", port)], listening
            assert agent.log().count("cannot listen on") == 1
            code, took = agent.stop(signal.SIGTERM)
            assert code == 0 and took < 5.0, agent.log()
    finally:
        holder.close()
        for i in range(4):
            kube_apiserver.request("DELETE", f"{API_PATH}/{node}-gpu{i}")
        kube_apiserver.request("DELETE", f"/api/v1/nodes/{node}")


def test_default_metrics_listen_on_localhost_only(tmp_path: Path) -> None:
    """No metrics setting anywhere: the listener is 127.0.0.1:9400 and nothing else. Another process may hold
    9400 on this shared machine; then the one clear error is the expected outcome and nothing listens."""
    args = ["run", "--simulate", "t4x1", "--sim-state", f"{ROOT}/sim.json", "--no-kube"]
    with node_root() as root, running_agent(tmp_path, root, args, metrics=None) as agent:
        agent.wait_notify("STATUS=", timeout=20)
        eventually(lambda: "metrics on http://127.0.0.1:9400/metrics" in agent.log()
                   or "metrics: cannot listen on 127.0.0.1:9400" in agent.log(), 20, "metrics bound or refused")
        listening = [(c.laddr.ip, c.laddr.port) for c in psutil.Process(agent.pid).net_connections(kind="inet")
                     if c.status == "LISTEN"]
        if "metrics on http://127.0.0.1:9400/metrics" in agent.log():
            assert listening == [("127.0.0.1", 9400)], listening
        else:
            assert listening == [], listening
        code, _ = agent.stop(signal.SIGTERM)
        assert code == 0, agent.log()
