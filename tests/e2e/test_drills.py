"""Fault drills: kill -9 of the agent in the middle of node-critical work.

- during a runtime configure (`nodeagent bootstrap`): the containerd files are whole (old or new, containerd
  loads them) and the next run finishes the job, then reports no change;
- during a MIG apply (`nodeagent run`, label driven): after a restart every GPU has the old or the new
  layout, never a mix, and the state label ends terminal.
The kill lands at several points in time; whatever it hits, the invariants must hold.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e._agent import REPO, running_agent
from tests.e2e.test_bootstrap_node import rerooted
from tests.e2e.test_run_cluster import agent_config, eventually, make_node, node_obj, set_label
from tests.peers.apiserver import KubeApiServer
from tests.peers.containerd import Containerd
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers

ORIGINAL = """version = 2

[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = true
"""


def layouts(sim_state: Path) -> list[tuple[bool, tuple[str, ...]]]:
    out = subprocess.run([sys.executable, "-m", "nodeagent", "discover", "--sim-state", str(sim_state), "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=True).stdout
    inv: dict[str, Any] = json.loads(out)
    return [(g["mig_current"], tuple(sorted(d["profile"] for d in g["mig_devices"]))) for g in inv["gpus"]]


@pytest.mark.parametrize("delay", [0.35, 0.45, 0.6])
def test_kill_during_runtime_configure(tmp_path: Path, containerd: Containerd, delay: float) -> None:
    root = tmp_path / "root"
    cfg = root / "etc/containerd/config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(ORIGINAL)
    args = [sys.executable, "-m", "nodeagent", "--root", str(root), "bootstrap", "--simulate", "t4x1", "--no-kube"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # whatever was hit: the main config is the original or the new one, and containerd loads it
    text = cfg.read_text()
    assert text == ORIGINAL or 'imports = ["/etc/containerd/conf.d/99-nvidia.toml"]' in text
    containerd.config_dump(rerooted(root, cfg, tmp_path / "judge.toml"))
    dropin = root / "etc/containerd/conf.d/99-nvidia.toml"
    if dropin.exists():
        containerd.config_dump(dropin)
    # the next run finishes the job; the one after changes nothing
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    again = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert json.loads(again.stdout)["changed"] is False
    dump = containerd.config_dump(rerooted(root, cfg, tmp_path / "judge.toml"))
    runtimes = dump["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["nvidia"]["options"]["SystemdCgroup"] is True  # copied from runc
    assert "runc" in runtimes


# Known failure (reported to the MIG owner): a kill between creating a GPU instance and its compute
# instance leaves an orphan GI; on restart the reconciler neither rolls back to the checkpoint it saved
# ("phase: applying") nor removes the orphan, so the new plan hits NVML_ERROR_INSUFFICIENT_RESOURCES and
# the GPU stays with a mixed layout. Not strict: when the kill lands elsewhere the drill passes.
@pytest.mark.xfail(strict=False, reason="MIG apply does not recover from kill -9 between GI and CI creation")
@pytest.mark.parametrize("delay", [0.05, 0.3])
def test_kill_during_mig_apply(tmp_path: Path, kube_apiserver: KubeApiServer, kubelet_harness: KubeletHarness,
                               delay: float) -> None:
    node = f"e2e-drill-mig-{int(delay * 1000)}"
    make_node(kube_apiserver, node)
    sim = tmp_path / "sim.json"
    cfg = agent_config(tmp_path, kube_apiserver.kubeconfig)
    args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", str(sim), "--node-name", node,
            "--kubelet-dir", str(kubelet_harness.plugin_dir.parent)]
    with running_agent(tmp_path, args) as agent:
        agent.wait_notify("READY=1", timeout=20)
        old = layouts(sim)
        set_label(kube_apiserver, node, "nvidia.com/mig.config", "all-1g.10gb")
        time.sleep(delay)
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait()
    new = [(True, ("1g.10gb",) * 7)] * 8
    (tmp_path / "notify.sock").unlink()
    with running_agent(tmp_path, args) as agent:
        agent.wait_notify("READY=1", timeout=20)
        state = lambda: node_obj(kube_apiserver, node)["metadata"]["labels"].get("nvidia.com/mig.config.state")  # noqa: E731
        eventually(lambda: state() in ("success", "failed"), 60, "a terminal mig.config.state")
        final = layouts(sim)
        for i, layout in enumerate(final):
            assert layout in (old[i], new[i]), f"GPU {i} has a mixed layout {layout}"
        assert state() == "success", agent.log()
        assert final == new
        code, _ = agent.stop()
        assert code == 0
