"""The real agent's metrics endpoint under connection floods: every scrape is answered with a whole exposition.

One ``nodeagent run --simulate dgx-h100 --no-kube`` process, and against it, one after the other, while a
scraper on 127.0.0.1 makes 20 scrapes:

- a steady trickle of 100 new connections a second from the scraper's own address, each sending
  ``GET /metrics HTTP/1.1\\r\\nX-a: `` and never the rest, all kept open;
- 3,000 idle connections from 100 loopback addresses, begun 1,500 a second, scraped from the first on;
- 40 clients sending one header line a second.

Each scrape's answer must be a 200 whose whole body parses as the text format and holds the GPU temperatures.
The threaded server before (16 threads, the slowest reader evicted after 1 s) answered 0-1, 2-6 and 0-19 of
the 20 here (two runs). The figures print with ``pytest -s``; no bound on the latencies is asserted (the machine is shared).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from tests._metrics_load import (
    IdleFlood,
    Scrapes,
    SlowHeaders,
    Trickle,
    raise_fd_limit,
    scrape_many,
    scrape_once,
)
from tests.e2e._agent import eventually, node_root, running_agent
from tests.peers._ports import free_port

METRIC = "DCGM_FI_DEV_GPU_TEMP"
SCRAPES = 20


def test_scrapes_answered_under_connection_floods(tmp_path: Path) -> None:
    raise_fd_limit(3000 + 1024)
    cfg = tmp_path / "config.toml"
    cfg.write_text("resync_interval = 300.0\n[runtime]\nenabled = false\n[metrics]\ninterval = 60.0\n")
    port = free_port()
    args = ["run", "--config", str(cfg), "--simulate", "dgx-h100", "--sim-state", str(tmp_path / "sim.json"),
            "--no-kube"]
    results: dict[str, Scrapes] = {}
    with node_root() as root, running_agent(tmp_path, root, args, metrics=f"127.0.0.1:{port}") as agent:
        eventually(lambda: scrape_once(port, METRIC, 5).ok, 30, f"{METRIC} scraped")
        with Trickle(port, rate=100) as trickle:
            time.sleep(0.5)  # 50 half-sent requests in before the first scrape
            results["trickle_100_per_s"] = scrape_many(port, SCRAPES, METRIC, interval=0.02)
            trickled = trickle.connected
        with IdleFlood(port, count=3000, sources=100, rate=1500) as idle:  # scraped while they come and stay
            results["idle_3000"] = scrape_many(port, SCRAPES, METRIC, interval=0.1)
            assert idle.opened.wait(60)
            idle_connected = idle.connected
        with SlowHeaders(port, clients=40) as slow:
            time.sleep(0.5)  # the 40 connected and sending
            results["slow_headers_40"] = scrape_many(port, SCRAPES, METRIC, interval=0.02)
        figures = {name: r.summary() for name, r in results.items()}
        print(json.dumps({"trickle_connections": trickled, "idle_connected": idle_connected,
                          "slow_reconnects": slow.reconnects, **figures}))
        for name, r in results.items():
            assert r.answered == SCRAPES, (name, r.failures())
        code, _ = agent.stop(signal.SIGTERM, timeout=30)
        assert code == 0, agent.log()
        assert "Traceback" not in agent.log()
