"""``nodeagent run`` as a real process on a simulated DGX H100 against the real kube-apiserver and kubelet device
manager: the four GPU Node conditions through their transitions (an injected XID and its recovery, a MIG
config applied and refused, containerd unwired and wired again), one status PATCH per transition, none while
idle or after a restart, and the kubelet's own conditions left alone."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nodeagent.kube.conditions import GPU_HEALTHY, GPU_READY, MIG_CONFIGURED, RUNTIME_READY
from nodeagent.simulator.inject import inject_xid, set_recovery_action
from nodeagent.simulator.state import SimStore
from tests.e2e._agent import eventually, fresh_node_with_gpu_crd, node_root, running_agent
from tests.peers.apiserver import KubeApiServer
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

CONTAINERD = Path(__file__).resolve().parents[1] / "fixtures" / "containerd" / "containerd-1.7-systemd.toml"
DROPIN = "etc/containerd/conf.d/99-nvidia.toml"
KUBELET_READY = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status",
                 "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}


def status_patches(server: KubeApiServer) -> float:
    """PATCH requests on nodes/status the apiserver has served (its own apiserver_request_total)."""
    status, body = server.get("/metrics")
    assert status == 200
    total = 0.0
    for fam in text_string_to_metric_families(body.decode()):
        if fam.name != "apiserver_request":
            continue
        for s in fam.samples:
            lab = s.labels
            if (s.name == "apiserver_request_total" and lab.get("verb") == "PATCH" and lab.get("resource") == "nodes"
                    and lab.get("subresource") == "status"):
                total += s.value
    return total


def conditions(server: KubeApiServer, node: str) -> dict[str, dict[str, Any]]:
    status, body = server.get(f"/api/v1/nodes/{node}")
    assert status == 200, body
    return {c["type"]: c for c in json.loads(body).get("status", {}).get("conditions") or []}


def cond(server: KubeApiServer, node: str, type_: str) -> tuple[str, str, str]:
    c = conditions(server, node).get(type_) or {}
    return c.get("status", ""), c.get("reason", ""), c.get("message", "")


def set_label(server: KubeApiServer, name: str, key: str, value: str | None) -> None:
    status, body = server.request("PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": {key: value}}},
                                  content_type="application/merge-patch+json")
    assert status == 200, body


def wire_containerd(root: Path) -> None:
    cfg = root / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CONTAINERD, cfg)
    done = subprocess.run([sys.executable, "-m", "nodeagent", "--root", str(root), "runtime", "configure",
                           "--restart", "none"], capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr


def test_condition_transitions_one_write_each_none_idle(
    tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness
) -> None:
    node = "e2e-conditions"
    fresh_node_with_gpu_crd(kube_apiserver, node)
    # the kubelet's own condition, as it posts it: the agent's writes must leave it as it is
    status, body = kube_apiserver.request("PATCH", f"/api/v1/nodes/{node}/status",
                                          {"status": {"conditions": [KUBELET_READY]}},
                                          content_type="application/merge-patch+json")
    assert status == 200, body
    sim_state = kubelet_harness.workdir / "sim.json"  # inside the root node_root gives
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'kubeconfig = "{kube_apiserver.kubeconfig}"\nresync_interval = 1.0\n'
                   "[runtime]\nenabled = true\ncheck_interval = 1.0\n"
                   "[health]\nwindow = 2.0\npoll_interval = 1.0\n"
                   '[kubelet]\npod_resources_socket = "/var/lib/kubelet/pod-resources.sock"\n')
    args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", str(sim_state),
            "--node-name", node]
    figures: dict[str, float] = {}
    with node_root(kubelet_harness) as root:
        wire_containerd(root)
        start = status_patches(kube_apiserver)
        with running_agent(tmp_path, root, args) as agent:
            agent.wait_notify("READY=1", timeout=30)
            eventually(lambda: cond(kube_apiserver, node, GPU_READY)[0] == "True"
                       and cond(kube_apiserver, node, RUNTIME_READY)[0] == "True", 20, "GPUReady and RuntimeReady True")
            time.sleep(1.5)
            figures["start"] = status_patches(kube_apiserver) - start  # every nodes/status PATCH of the start
            c = conditions(kube_apiserver, node)
            assert (c[GPU_READY]["reason"], c[GPU_READY]["message"]) == ("AllGpusReady",
                                                                        "all 8 GPU(s) present and healthy")
            assert (c[GPU_HEALTHY]["status"], c[GPU_HEALTHY]["reason"]) == ("True", "AllGpusHealthy")
            assert (c[MIG_CONFIGURED]["status"], c[MIG_CONFIGURED]["reason"]) == ("Unknown", "MigConfigNotRequested")
            assert c[RUNTIME_READY]["reason"] == "RuntimeWired"
            assert c["Ready"] == KUBELET_READY

            # idle: resync every 1 s, health polled every 1 s, runtime checked every 1 s: not one status write
            time.sleep(1.0)
            before = status_patches(kube_apiserver)
            time.sleep(8.0)
            figures["idle_8s"] = status_patches(kube_apiserver) - before
            assert figures["idle_8s"] == 0

            # XID 48 with the driver asking for a GPU reset: GPUHealthy and GPUReady False in one write
            store = SimStore.open("dgx-h100", sim_state)
            uuid2 = store.machine.gpus[2].uuid
            untouched = conditions(kube_apiserver, node)[RUNTIME_READY]
            before = status_patches(kube_apiserver)
            inject_xid(store, 2, 48, recovery_action=1)
            eventually(lambda: cond(kube_apiserver, node, GPU_HEALTHY)[0] == "False", 20, "GPUHealthy False")
            time.sleep(1.5)
            figures["xid"] = status_patches(kube_apiserver) - before
            assert figures["xid"] == 1
            state, reason, message = cond(kube_apiserver, node, GPU_HEALTHY)
            assert (state, reason) == ("False", "GpuRecoveryRequired")
            assert message == f"1 of 8 GPU(s) unhealthy: GPU 2 ({uuid2}): XID 48, recovery: GPU reset"
            assert cond(kube_apiserver, node, GPU_READY) == ("False", "GpusUnhealthy",
                                                             "1 of 8 GPU(s) unhealthy: GPU 2")
            assert conditions(kube_apiserver, node)[RUNTIME_READY] == untouched  # only changed types are sent

            # the reset done: after the recovery window both are True again, in one write
            before = status_patches(kube_apiserver)
            set_recovery_action(store, 2, 0)
            eventually(lambda: cond(kube_apiserver, node, GPU_READY)[0] == "True", 30, "GPUReady True again")
            time.sleep(1.5)
            figures["recovery"] = status_patches(kube_apiserver) - before
            assert figures["recovery"] == 1
            assert cond(kube_apiserver, node, GPU_HEALTHY)[:2] == ("True", "AllGpusHealthy")

            # a MIG config applied: MIGConfigured True
            before = status_patches(kube_apiserver)
            set_label(kube_apiserver, node, "nvidia.com/mig.config", "all-1g.10gb")
            eventually(lambda: cond(kube_apiserver, node, MIG_CONFIGURED)[0] == "True", 60, "MIGConfigured True")
            assert cond(kube_apiserver, node, MIG_CONFIGURED) == ("True", "MigConfigApplied",
                                                                  "MIG config 'all-1g.10gb' is applied")
            time.sleep(1.5)
            figures["mig_applied"] = status_patches(kube_apiserver) - before
            assert 1 <= figures["mig_applied"] <= 2  # MigConfigPending first when the apply took over 2 s
            assert cond(kube_apiserver, node, GPU_READY)[0] == "True"  # 8 GPUs, now in MIG mode, all healthy

            # a name no config has: MIGConfigured False with the reconciler's reason
            before = status_patches(kube_apiserver)
            set_label(kube_apiserver, node, "nvidia.com/mig.config", "all-7g.99gb")
            eventually(lambda: cond(kube_apiserver, node, MIG_CONFIGURED)[0] == "False", 30, "MIGConfigured False")
            _, reason, message = cond(kube_apiserver, node, MIG_CONFIGURED)
            assert reason == "MigConfigFailed"
            assert message.startswith("MIG config 'all-7g.99gb' failed: "), message
            assert "no config named 'all-7g.99gb' (known: all-disabled, all-enabled" in message, message
            assert "\n" not in message
            time.sleep(1.5)
            figures["mig_failed"] = status_patches(kube_apiserver) - before
            assert figures["mig_failed"] == 1

            # somebody removes GPUReady from the Node: the watch sees it, the agent writes it again (one write)
            before = status_patches(kube_apiserver)
            code, body = kube_apiserver.request(
                "PATCH", f"/api/v1/nodes/{node}/status",
                {"status": {"conditions": [{"type": GPU_READY, "$patch": "delete"}]}},
                content_type="application/strategic-merge-patch+json")
            assert code == 200, body
            eventually(lambda: cond(kube_apiserver, node, GPU_READY)[:2] == ("True", "AllGpusReady"), 20,
                       "GPUReady written again after its removal")
            time.sleep(1.5)
            figures["restored"] = status_patches(kube_apiserver) - before - 1  # minus the removal itself
            assert figures["restored"] == 1

            # containerd unwired (the drop-in gone): RuntimeReady False; wired again: True
            dropin = root / DROPIN
            saved = dropin.read_bytes()
            before = status_patches(kube_apiserver)
            dropin.unlink()
            eventually(lambda: cond(kube_apiserver, node, RUNTIME_READY)[0] == "False", 20, "RuntimeReady False")
            _, reason, message = cond(kube_apiserver, node, RUNTIME_READY)
            assert reason == "ContainerdNotWired" and "/" + DROPIN in message, message
            dropin.write_bytes(saved)
            eventually(lambda: cond(kube_apiserver, node, RUNTIME_READY)[0] == "True", 20, "RuntimeReady True again")
            time.sleep(1.5)
            figures["runtime_off_on"] = status_patches(kube_apiserver) - before
            assert figures["runtime_off_on"] == 2

            code, _took = agent.stop(signal.SIGTERM)
            assert code == 0, agent.log()

        final = conditions(kube_apiserver, node)
        assert final["Ready"] == KUBELET_READY  # never clobbered
        # a restarted agent finds its conditions still true: it writes none of them again
        before = status_patches(kube_apiserver)
        (tmp_path / "again").mkdir()
        with running_agent(tmp_path / "again", root, args) as agent:
            agent.wait_notify("READY=1", timeout=30)
            eventually(lambda: "MigConfigFailed" in agent.log() or "all-7g.99gb" in agent.log(), 30,
                       "the MIG label reconciled again after the restart")
            time.sleep(4.0)
            figures["restart"] = status_patches(kube_apiserver) - before
            assert conditions(kube_apiserver, node) == final, agent.log()
            code, _took = agent.stop(signal.SIGTERM)
            assert code == 0, agent.log()
        assert figures["restart"] == 0
    print("condition status PATCHes:", json.dumps(figures))


def readme_taint_script() -> str:
    readme = (Path(__file__).resolve().parents[2] / "docs/node-publishing.md").read_text()
    block = readme.split("## Node conditions", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    assert block.startswith("# taint-gpu-not-ready"), block
    return block


def test_readme_taint_rule_follows_gpu_ready(tmp_path: Path, kube_apiserver: KubeApiServer) -> None:
    """The documented plain taint rule (docs/node-publishing.md), run as written with kubectl: a node whose GPUReady is False gets the
    NoSchedule taint, loses it when GPUReady is True again; a node without the condition is left alone."""
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is not installed: the README's taint rule cannot be run")
    from tests.e2e.test_run_cluster import make_node

    node, bystander = "e2e-taint-rule", "e2e-taint-bystander"
    for n in (node, bystander):
        make_node(kube_apiserver, n)
    script = readme_taint_script()

    def gpu_ready(status: str) -> None:
        code, body = kube_apiserver.request(
            "PATCH", f"/api/v1/nodes/{node}/status",
            {"status": {"conditions": [{"type": GPU_READY, "status": status, "reason": "Test", "message": "t"}]}},
            content_type="application/strategic-merge-patch+json")
        assert code == 200, body

    def run() -> None:
        done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60, check=False,
                              env={"PATH": "/usr/bin:/bin", "KUBECONFIG": str(kube_apiserver.kubeconfig),
                                   "HOME": str(tmp_path)})
        assert done.returncode == 0, done.stderr

    def taints(n: str) -> list[dict[str, Any]]:
        """The rule's taints on ``n`` (others, e.g. node.kubernetes.io/not-ready, are not its business)."""
        code, body = kube_apiserver.get(f"/api/v1/nodes/{n}")
        assert code == 200, body
        return [t for t in json.loads(body)["spec"].get("taints") or [] if t["key"].startswith("nodeagent.io/")]

    try:
        gpu_ready("False")
        run()
        assert [(t["key"], t.get("value"), t["effect"]) for t in taints(node)] == [
            ("nodeagent.io/gpu-not-ready", "true", "NoSchedule")]
        run()  # again: still exactly one taint
        assert len(taints(node)) == 1
        gpu_ready("True")
        run()
        assert taints(node) == []
        run()  # untainting an untainted node is quiet
        assert taints(node) == [] and taints(bystander) == []
    finally:
        for n in (node, bystander):
            kube_apiserver.request("DELETE", f"/api/v1/nodes/{n}")
