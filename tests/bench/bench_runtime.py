"""Figures for the containerd editor: render/drop-in time per corpus file and a full configure cycle.

Prints a table and one JSON line; no assertions.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from nodeagent.hostpaths import HostPaths
from nodeagent.runtime import configure as rc
from nodeagent.runtime import containerd as ctd

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "containerd"


def _ms(fn: object, n: int = 20) -> float:
    assert callable(fn)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1000


def main() -> None:
    figures: dict[str, float] = {}
    desired = ctd.Desired(set_as_default=True, enable_cdi=True)
    for p in sorted(CORPUS.glob("*.toml")):
        text = p.read_text()
        figures[f"render_ms[{p.name}]"] = round(_ms(lambda t=text: ctd.render(t, desired)), 2)
        figures[f"dropin_ms[{p.name}]"] = round(_ms(lambda t=text: ctd.render_dropin(t, desired)), 2)
    root = Path(tempfile.mkdtemp())
    try:
        cfg = root / "etc/containerd/config.toml"
        cfg.parent.mkdir(parents=True)
        shutil.copyfile(CORPUS / "containerd-1.6-default.toml", cfg)
        paths = HostPaths(root)
        t0 = time.perf_counter()
        rc.configure(paths, rc.Options(set_as_default=True))
        t1 = time.perf_counter()
        rc.configure(paths, rc.Options(set_as_default=True))
        t2 = time.perf_counter()
        rc.unconfigure(paths)
        t3 = time.perf_counter()
        figures.update(configure_ms=round((t1 - t0) * 1000, 1), reconfigure_ms=round((t2 - t1) * 1000, 1),
                       unconfigure_ms=round((t3 - t2) * 1000, 1))
    finally:
        shutil.rmtree(root)
    for k, v in figures.items():
        print(f"{k:48} {v:8.2f}")
    print(json.dumps({"bench": "runtime", **figures}))


if __name__ == "__main__":
    main()
