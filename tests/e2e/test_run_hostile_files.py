"""``nodeagent run`` with a FIFO where its CDI spec belongs: it never blocks in open, serves the kubelet,
reports the file in one line and still stops at once on SIGTERM."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.e2e._agent import node_root, running_agent
from tests.e2e.test_run import demo_args
from tests.peers.harness import KubeletHarness

pytestmark = pytest.mark.peers


def test_a_fifo_at_the_cdi_spec_path_does_not_hang_run(
    tmp_path: Path, kubelet_harness: KubeletHarness
) -> None:
    with node_root(kubelet_harness) as root:
        spec = root / "var/run/cdi/nvidia.yaml"
        spec.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(spec)
        try:
            with running_agent(tmp_path, root, demo_args(root)) as agent:
                agent.wait_notify("READY=1", timeout=20)
                kubelet_harness.wait("nvidia.com/gpu", registered=True, total=8, healthy=8)
                code, took = agent.stop(signal.SIGTERM)
                log = agent.log()
                assert code == 0 and took < 5.0, log[-3000:]
                fifo_lines = [ln for ln in log.splitlines() if "is a FIFO" in ln]
                assert fifo_lines and all(len(ln) < 400 for ln in fifo_lines), log[-3000:]
                assert "Traceback" not in log
        finally:
            spec.unlink()
