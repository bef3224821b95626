"""CDI figures: MIG layout change → CDI spec rewritten → first Allocate naming a new MIG device resolves.

Run: .venv/bin/python tests/bench/bench_cdi.py [--rounds N]
On the simulated 8x H100 (dgx-h100), each round switches every GPU between two MIG layouts (7x 1g.10gb
and 3g.40gb + 2g.20gb + 1g.10gb...) in the simulator, as the driver would after an apply, and then times what
follows: rediscovery, CdiWriter.refresh (generate + atomic write), the device plugin's Allocate answer for a
new MIG device (cdi-cri), and the CDI reference library resolving it in a long-lived cache refreshed from
the spec directory, as containerd keeps one (tests/testbin/cdi-check -serve). Prints readable figures and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nodeagent.cdi.writer import CdiWriter
from nodeagent.deviceplugin.allocate import container_allocation
from nodeagent.sharing.devices import build_resources
from nodeagent.sharing.spec import parse_plugin_config
from tests.cdi_host import apply_layout, make_host
from tests.peers.cdicheck import CdiResolver, run_cdi_check

LAYOUTS = (
    {i: ["1g.10gb"] * 7 for i in range(8)},
    {i: ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"] for i in range(8)},
)
CONFIG = parse_plugin_config(
    "version: v1\nflags:\n  migStrategy: mixed\n  plugin:\n    deviceListStrategy: cdi-cri\n"
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    run_cdi_check([Path("/nonexistent")])  # build/locate the peer before timing anything
    keys = ("discover", "cdi_write", "allocate", "resolve", "after_inventory", "total")
    rows: dict[str, list[float]] = {k: [] for k in keys}
    with tempfile.TemporaryDirectory() as tmp:
        host = make_host(Path(tmp), "dgx-h100")
        writer = CdiWriter(host.paths)
        resolver = CdiResolver([host.spec_dir])
        writer.refresh(apply_layout(host, LAYOUTS[1]))
        for r in range(args.rounds):
            apply_layout(host, LAYOUTS[r % 2])  # the driver side of an apply (simulator + /proc, /dev)
            t0 = time.perf_counter()
            inv = host.discover()
            t1 = time.perf_counter()
            assert writer.refresh(inv)
            t2 = time.perf_counter()
            resources = build_resources(inv, CONFIG)
            res = resources["nvidia.com/mig-1g.10gb"]
            alloc = container_allocation(res, CONFIG.flags.plugin, [res.devices[-1].id])
            t3 = time.perf_counter()
            out = resolver.resolve(list(alloc.cdi_devices))
            t4 = time.perf_counter()
            inj = out["injection"]
            assert out["errors"] == {} and inj["unresolved"] == [] and "error" not in inj, out
            for key, a, b in (("discover", t0, t1), ("cdi_write", t1, t2), ("allocate", t2, t3),
                              ("resolve", t3, t4), ("after_inventory", t1, t4), ("total", t0, t4)):
                rows[key].append((b - a) * 1000)
        resolver.close()
    figures: dict[str, float] = {"rounds": args.rounds}
    for key, vals in rows.items():
        figures[f"{key}_ms_median"] = round(statistics.median(vals), 2)
        figures[f"{key}_ms_max"] = round(max(vals), 2)
    print("MIG change -> CDI spec -> Allocate name resolves, simulated 8x H100 (56/32 MIG devices)")
    for k, v in figures.items():
        print(f"{k:30s} {v}")
    print("target: < 100 ms after the apply; after_inventory excludes the simulator's rediscovery (the MIG")
    print("apply path already holds the new inventory). Load average:", " ".join(Path("/proc/loadavg").read_text().split()[:3]))
    print(json.dumps({"bench": "cdi", **figures}))


if __name__ == "__main__":
    main()
