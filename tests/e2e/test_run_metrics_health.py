"""Health metrics follow a health event at once, not at the next sampling tick: an XID injected into the
simulated GPU shows in ``nodeagent_device_healthy`` and ``DCGM_FI_DEV_XID_ERRORS`` within seconds while
the sampling interval is a minute."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests._metrics import scrape_or_none
from tests.e2e._agent import ROOT, eventually, node_root, running_agent
from tests.peers._ports import free_port


def test_xid_reaches_the_metrics_at_once(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("resync_interval = 300.0\n[runtime]\nenabled = false\n[metrics]\ninterval = 60.0\n")
    port = free_port()
    args = ["run", "--config", str(cfg), "--simulate", "a30x4", "--sim-state", f"{ROOT}/sim.json", "--no-kube"]
    with node_root() as root, running_agent(tmp_path, root, args, metrics=f"127.0.0.1:{port}") as agent:

        def healthy() -> dict[str, float] | None:
            scraped = scrape_or_none(port)
            if scraped is None or "nodeagent_device_healthy" not in scraped:
                return None
            return {lab["gpu"]: v for lab, v in scraped["nodeagent_device_healthy"]}

        before = eventually(healthy, 20, "nodeagent_device_healthy")
        assert set(before.values()) == {1.0}, before
        t0 = time.monotonic()
        injected = subprocess.run(
            [
                sys.executable,
                "-m",
                "nodeagent",
                "sim",
                "inject",
                "xid",
                "--sim-state",
                str(root / "sim.json"),
                "--gpu",
                "2",
                "--code",
                "48",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert injected.returncode == 0, injected.stderr
        after = eventually(
            lambda: (h := healthy()) and h.get("2") == 0.0 and h, 20, "GPU 2 unhealthy in metrics"
        )
        took = time.monotonic() - t0
        assert after == {"0": 1.0, "1": 1.0, "2": 0.0, "3": 1.0}, after
        scraped = scrape_or_none(port)
        assert scraped is not None
        xids = {lab["gpu"]: v for lab, v in scraped["DCGM_FI_DEV_XID_ERRORS"]}
        assert xids["2"] == 48.0, xids
        assert took < 20, took  # the next periodic sample is a minute away
        print(f"XID -> metrics: {took:.2f}s")
        assert "Traceback" not in agent.log()
