"""``nodeagent doctor`` on simulated nodes that have each finding: the level, the line, the fix command
(with the options in use, --root included), the exit code; and the Node checks against a real API."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e._agent import REPO
from tests.peers.apiserver import KubeApiServer

NODEAGENT = [sys.executable, "-m", "nodeagent"]


@pytest.fixture
def root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="nadoc-", dir="/tmp") as d:  # short: sockets live below it
        yield Path(d) / "node"


def _env(root: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("NODEAGENT_", "KUBERNETES_", "KUBECONFIG"))
    }
    env.update(HOME=str(root.parent / "home"), PYTHONPATH=str(REPO))
    return env


def _na(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*NODEAGENT, "--root", str(root), *args],
        cwd=root.parent,
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _doctor(root: Path, *args: str) -> tuple[int, list[dict[str, Any]]]:
    r = _na(root, "doctor", "--no-kube", "--json", *args)
    assert r.returncode in (0, 1, 2), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == r.returncode
    return r.returncode, doc["findings"]


def _one(findings: list[dict[str, Any]], area: str, level: str, words: str) -> dict[str, Any]:
    hits = [f for f in findings if f["area"] == area and f["level"] == level and words in f["text"]]
    assert len(hits) == 1, (area, level, words, findings)
    return hits[0]


def test_fresh_node_then_bootstrapped(root: Path) -> None:
    sim = ["--simulate", "dgx-h100"]
    code, findings = _doctor(root, *sim)
    assert code == 1
    areas = [f["area"] for f in findings if f["area"] in ("driver", "containerd", "cdi", "kubelet", "node")]
    assert list(dict.fromkeys(areas)) == ["driver", "containerd", "cdi", "kubelet", "node"]  # in that order
    assert sorted(areas, key=areas.index) == areas  # each area's findings together
    _one(findings, "driver", "ok", "driver 550.54.15, CUDA 12.4 (simulated)")
    _one(findings, "gpus", "ok", "8 GPU(s): NVIDIA H100 80GB HBM3")
    wire = _one(findings, "containerd", "warning", "not wired for the NVIDIA runtime")
    assert wire["fix"] == f"nodeagent --root {root} runtime configure"
    cdi = _one(findings, "cdi", "warning", "no CDI spec at /var/run/cdi/nvidia.yaml")
    assert cdi["fix"] == f"nodeagent --root {root} cdi generate --simulate dgx-h100"
    _one(findings, "kubelet", "warning", "/var/lib/kubelet/device-plugins does not exist")
    _one(findings, "node", "ok", "not checked (--no-kube)")

    assert _na(root, "bootstrap", *sim, "--no-kube").returncode == 0
    code, findings = _doctor(root, *sim)
    _one(findings, "containerd", "ok", "wired: runtimes nvidia")
    _one(findings, "cdi", "ok", "/var/run/cdi/nvidia.yaml is current")
    assert not [f for f in findings if f["level"] == "error"], findings
    text = _na(root, "doctor", "--no-kube", *sim)
    assert text.returncode == code
    assert "ok      cdi        /var/run/cdi/nvidia.yaml is current" in text.stdout, text.stdout


def test_stale_cdi_lost_gpu_and_pending_mig(root: Path) -> None:
    state = str(root / "a100.json")  # the simulated node's state, inside its root
    sim = ["--simulate", "dgx-a100-80gb", "--sim-state", state]
    assert _na(root, "bootstrap", *sim, "--no-kube").returncode == 0
    assert _na(root, "sim", "mig", *sim, "--gpu", "0", "3g.40gb", "3g.40gb").returncode == 0
    code, findings = _doctor(root, *sim)
    stale = _one(findings, "cdi", "warning", "differs from the GPUs now (stale)")
    assert (
        stale["fix"] == f"nodeagent --root {root} cdi generate --simulate dgx-a100-80gb --sim-state {state}"
    )
    _one(findings, "gpus", "ok", "GPU 0: MIG on, 3g.40gb@0, 3g.40gb@4")

    assert _na(root, "sim", "inject", "lost", "--sim-state", state, "--gpu", "3").returncode == 0
    code, findings = _doctor(root, *sim)
    assert code == 2
    _one(findings, "health", "error", "GPU 3 has fallen off the bus")

    vm_root = root.parent / "vm"
    vm_state = str(vm_root / "vm.json")
    vm = ["--simulate", "vm-a100-passthrough", "--sim-state", vm_state]
    assert _na(vm_root, "mig", "apply", *vm, "-c", "all-enabled").returncode == 3
    code, findings = _doctor(vm_root, *vm)
    pending = _one(findings, "gpus", "warning", "GPU 0: MIG mode on is pending (now off)")
    assert pending["fix"] == (
        f"nodeagent --root {vm_root} sim reboot --simulate vm-a100-passthrough --sim-state {vm_state}"
    )
    assert _na(vm_root, *pending["fix"].split()[3:]).returncode == 0  # the fix, as printed, does it
    code, findings = _doctor(vm_root, *vm)
    assert not [f for f in findings if f["area"] == "gpus" and f["level"] != "ok"], findings


def test_other_plugins_registrations_and_a_broken_containerd_config(root: Path) -> None:
    sim = ["--simulate", "t4x1"]
    plugins = root / "var/lib/kubelet/device-plugins"
    plugins.mkdir(parents=True)
    held = []
    for name in ("kubelet.sock", "nvidia-gpu.sock", "vendor-x.sock"):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(plugins / name))
        held.append(s)
    (plugins / "kubelet_internal_checkpoint").write_text(
        json.dumps(
            {"Data": {"PodDeviceEntries": [], "RegisteredDevices": {"nvidia.com/gpu": ["GPU-a", "GPU-b"]}}}
        )
    )
    try:
        code, findings = _doctor(root, *sim)
    finally:
        for s in held:
            s.close()
    _one(
        findings,
        "kubelet",
        "warning",
        "/var/lib/kubelet/device-plugins/vendor-x.sock: a device-plugin socket",
    )
    assert not [f for f in findings if "nvidia-gpu.sock" in f["text"]], findings  # nodeagent's own name
    _one(findings, "kubelet", "ok", "registered with the kubelet: nvidia.com/gpu (2 devices)")

    (root / "etc/containerd").mkdir(parents=True)
    (root / "etc/containerd/config.toml").write_text("version = 2\n[plugins\n")
    code, findings = _doctor(root, *sim)
    assert code == 2
    broken = _one(findings, "containerd", "error", "invalid TOML at line 2")
    assert "by hand" in broken["fix"]


def test_node_checks_against_the_api(root: Path, kube_apiserver: KubeApiServer) -> None:
    node = "doctor-node"
    kube_apiserver.request("DELETE", f"/api/v1/nodes/{node}")
    status, body = kube_apiserver.request(
        "POST",
        "/api/v1/nodes",
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node,
                "labels": {
                    "nvidia.com/gpu.product": "Tesla-T4",
                    "nvidia.com/gpu.count": "1",
                    "nvidia.com/mig.config": "all-1g.5gb",
                    "nvidia.com/mig.config.state": "failed",
                },
            },
            "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
        },
    )
    assert status == 201, body

    def doctor(name: str) -> subprocess.CompletedProcess[str]:
        return _na(
            root,
            "doctor",
            "--simulate",
            "t4x1",
            "--kubeconfig",
            str(kube_apiserver.kubeconfig),
            "--node-name",
            name,
            "--json",
        )

    try:
        r = doctor(node)
        assert r.returncode == 2, r.stderr
        findings = json.loads(r.stdout)["findings"]
        _one(findings, "node", "ok", "2 nvidia.com/gpu.* labels (product Tesla-T4, count 1)")
        _one(findings, "node", "error", "nvidia.com/mig.config=all-1g.5gb failed")
        _one(findings, "node", "warning", "allocatable nvidia.com/gpu is 0, 1 GPU(s) discovered")
        _one(findings, "node", "warning", "taint nvidia.com/gpu=:NoSchedule")
        missing = doctor("no-such-node")
        _one(json.loads(missing.stdout)["findings"], "node", "error", "Node no-such-node cannot be read")
    finally:
        kube_apiserver.request("DELETE", f"/api/v1/nodes/{node}")
