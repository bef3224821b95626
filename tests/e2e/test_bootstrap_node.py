"""``nodeagent bootstrap`` as a real process: image build under --root judged by containerd, and a node
prepared against the real kube-apiserver (RuntimeClass + labels), each run twice to prove idempotence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomlkit
import yaml

from tests.e2e._agent import REPO
from tests.peers.apiserver import KubeApiServer
from tests.peers.containerd import Containerd

pytestmark = pytest.mark.peers


def bootstrap(*args: str) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        report = {}
    return proc.returncode, report, proc.stderr


def results(report: dict[str, Any]) -> dict[str, str]:
    return {s["step"]: s["result"] for s in report["steps"]}


def rerooted(root: Path, config: Path, out: Path) -> Path:
    """A copy of the root config whose host-absolute imports point into ``root`` (what the host will see)."""
    doc = tomlkit.parse(config.read_text())
    doc["imports"] = [str(root) + i if i.startswith("/") else i for i in doc.get("imports", [])]
    out.write_text(tomlkit.dumps(doc))
    return out


def test_image_build_under_root_is_idempotent_and_loads_in_containerd(tmp_path: Path, containerd: Containerd) -> None:
    root = tmp_path / "image"
    root.mkdir()
    args = ["--root", str(root), "bootstrap", "--simulate", "dgx-h100", "--sim-state", str(root / "sim.json"),
            "--no-kube"]
    code, report, err = bootstrap(*args)
    assert code == 0, err
    assert results(report) == {
        "discover": "unchanged", "mig": "skipped", "runtime": "changed", "containerd-restart": "skipped",
        "cdi": "changed", "runtimeclass": "skipped", "labels": "skipped",
    }
    assert report["steps"][0]["details"]["gpus"] == 8
    cfg = root / "etc/containerd/config.toml"
    dump = containerd.config_dump(rerooted(root, cfg, tmp_path / "judge.toml"))
    runtimes = dump["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["nvidia"]["options"]["BinaryName"] == "/usr/bin/nvidia-container-runtime"
    leak_guard = (root / "etc/nvidia-container-runtime/config.toml").read_text()
    assert "accept-nvidia-visible-devices-envvar-when-unprivileged = false" in leak_guard

    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    code, report, err = bootstrap(*args)
    assert code == 0, err
    assert report["changed"] is False
    assert results(report)["runtime"] == "unchanged" and results(report)["cdi"] == "unchanged"
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_mig_config_applied_once_and_unknown_name_exits_2(tmp_path: Path) -> None:
    root = tmp_path / "r"
    root.mkdir()
    base = ["--root", str(root), "bootstrap", "--simulate", "dgx-h100", "--sim-state", str(root / "sim.json"),
            "--no-kube"]
    code, report, err = bootstrap(*base, "--mig-config", "all-1g.10gb")
    assert code == 0, err
    assert results(report)["mig"] == "changed"
    assert report["steps"][1]["details"]["gpus"] == list(range(8))
    # the CDI step runs after MIG on the rediscovered GPUs: the spec names the 56 new MIG devices
    assert results(report)["cdi"] == "changed"
    spec = yaml.safe_load((root / "var/run/cdi/nvidia.yaml").read_text())
    names = {d["name"] for d in spec["devices"]}
    assert {f"{g}:{n}" for g in range(8) for n in range(7)} <= names and "all" in names
    code, report, _ = bootstrap(*base, "--mig-config", "all-1g.10gb")
    assert code == 0 and results(report)["mig"] == "unchanged" and report["changed"] is False
    assert results(report)["cdi"] == "unchanged"
    code, report, _ = bootstrap(*base, "--mig-config", "no-such-config")
    assert code == 2
    assert results(report)["mig"] == "failed"
    assert "no-such-config" in report["steps"][1]["reason"]


def test_reboot_required_exits_3_and_the_next_boot_finishes(tmp_path: Path) -> None:
    """An Ampere MIG mode change in a passthrough VM (NVML: RESET_REQUIRED, no GPU reset from the guest):
    the report says reboot-required and the exit code is 3; the other steps still ran. After the host
    rebooted, the same command finishes the MIG config with exit 0."""
    root = tmp_path / "r"
    root.mkdir()
    state = str(root / "sim.json")
    sim = ["--simulate", "vm-a100-passthrough", "--sim-state", state]
    base = ["--root", str(root), "bootstrap", *sim, "--no-kube", "--mig-config", "all-1g.10gb"]
    code, report, err = bootstrap(*base)
    assert code == 3, err
    assert report["exit_code"] == 3
    assert results(report)["mig"] == "reboot-required"
    assert "reboot" in report["steps"][1]["reason"]
    assert results(report)["runtime"] == "changed"  # the remaining steps ran
    reboot = subprocess.run([sys.executable, "-m", "nodeagent", "sim", "reboot", "--sim-state", state],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert reboot.returncode == 0, reboot.stderr
    code, report, err = bootstrap(*base)
    assert code == 0, err
    assert results(report)["mig"] == "changed" and results(report)["runtime"] == "unchanged"
    code, report, err = bootstrap(*base)
    assert code == 0 and report["changed"] is False, err


def test_runtimeclass_and_labels_against_the_apiserver(tmp_path: Path, kube_apiserver: KubeApiServer) -> None:
    node = "bootstrap-e2e-node"
    status, _ = kube_apiserver.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                                 "metadata": {"name": node}})
    assert status in (201, 409)
    root = tmp_path / "r"
    root.mkdir()
    args = ["--root", str(root), "bootstrap", "--simulate", "dgx-h100", "--sim-state", str(root / "sim.json"),
            "--kubeconfig", str(kube_apiserver.kubeconfig), "--node-name", node]
    code, report, err = bootstrap(*args)
    assert code == 0, err
    res = results(report)
    assert res["runtimeclass"] in ("changed", "unchanged")  # another test may have created it already
    assert res["labels"] == "changed"
    status, body = kube_apiserver.get(f"/api/v1/nodes/{node}")
    labels = json.loads(body)["metadata"]["labels"]
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/gpu.product"].startswith("NVIDIA-H100")
    status, body = kube_apiserver.get("/apis/node.k8s.io/v1/runtimeclasses/nvidia")
    assert status == 200 and json.loads(body)["handler"] == "nvidia"

    code, report, err = bootstrap(*args)
    assert code == 0, err
    assert report["changed"] is False, report
    assert results(report)["labels"] == "unchanged"


def test_node_not_registered_yet_is_skipped(tmp_path: Path, kube_apiserver: KubeApiServer) -> None:
    root = tmp_path / "r"
    root.mkdir()
    code, report, err = bootstrap("--root", str(root), "bootstrap", "--simulate", "t4x1", "--kubeconfig",
                                  str(kube_apiserver.kubeconfig), "--node-name", "not-yet-registered")
    assert code == 0, err
    assert results(report)["labels"] == "skipped"
    assert "not registered yet" in report["steps"][-1]["reason"]


def test_unreachable_api_skips_kube_steps(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\n"
        "contexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\n"
        "users:\n- name: u\n  user:\n    token: x\n"
    )
    root = tmp_path / "r"
    root.mkdir()
    code, report, err = bootstrap("--root", str(root), "bootstrap", "--simulate", "t4x1", "--kubeconfig",
                                  str(kubeconfig), "--node-name", "n")
    assert code == 0, err
    assert results(report)["runtimeclass"] == "skipped"
    assert "API not reachable" in report["steps"][-2]["reason"]
