"""The quick commands timed as whole processes, beside ``nvidia-ctk --version`` as the yardstick of a
process that does almost nothing.

Run (after `source tests/testbin/setup.sh`, for $NODEAGENT_NVIDIA_CTK): .venv/bin/python tests/bench/bench_cli.py
[--rounds N]. Commands: ``nodeagent --help``, ``discover --simulate dgx-h100`` and ``runtime show`` /
``runtime configure --dry-run`` under a ``--root`` sandbox holding a containerd 1.7 config; ``discover`` once more
with no byte-code cache at all (every module compiled from source at each start, as when the environment sets
PYTHONDONTWRITEBYTECODE on a fresh checkout, which tests/run.sh therefore unsets). Runs alternate
(nodeagent, yardstick, nodeagent, ...) so the ratio is taken pair by pair on a drifting machine. Also counts
the modules each command imports (``python -X importtime``). Prints medians and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "containerd"
NODEAGENT = [sys.executable, "-m", "nodeagent"]


def _timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, env=env, check=False, timeout=120)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.decode(errors='replace')[-2000:]}")
    return elapsed * 1000


def _modules(args: list[str], env: dict[str, str]) -> int:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "nodeagent", *args],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    return sum(1 for line in proc.stderr.splitlines() if line.startswith("import time:")) - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    ctk = os.environ.get("NODEAGENT_NVIDIA_CTK")
    yardstick = [ctk, "--version"] if ctk and Path(ctk).exists() else None
    tmp = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    try:
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "XDG_RUNTIME_DIR": str(tmp)}
        root = tmp / "root"
        (root / "etc/containerd").mkdir(parents=True)
        shutil.copy(CORPUS / "containerd-1.7-systemd.toml", root / "etc/containerd/config.toml")
        commands = {
            "help": ["--help"],
            "discover_simulate": ["--root", str(tmp / "sandbox"), "discover", "--simulate", "dgx-h100"],
            "runtime_show": ["--root", str(root), "runtime", "show"],
            "runtime_configure_dry_run": ["--root", str(root), "runtime", "configure", "--dry-run"],
        }
        results: dict[str, Any] = {}
        for name, argv in commands.items():
            _timed(NODEAGENT + argv, env)  # warm-up: bytecode caches, page cache
            ours: list[float] = []
            ratios: list[float] = []
            for _ in range(args.rounds):
                ours.append(_timed(NODEAGENT + argv, env))
                if yardstick is not None:
                    ratios.append(ours[-1] / _timed(yardstick, env))
            results[name] = {
                "median_ms": round(statistics.median(ours), 1),
                "min_ms": round(min(ours), 1),
                "ratio_to_ctk_version": round(statistics.median(ratios), 1) if ratios else None,
                "modules_imported": _modules(argv, env),
            }
        (tmp / "no-pycache").mkdir()
        uncached = {**env, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp / "no-pycache")}
        argv = commands["discover_simulate"]
        cold = [_timed(NODEAGENT + argv, uncached) for _ in range(args.rounds)]
        results["discover_simulate_without_bytecode_cache"] = {
            "median_ms": round(statistics.median(cold), 1), "min_ms": round(min(cold), 1),
            "ratio_to_ctk_version": None, "modules_imported": results["discover_simulate"]["modules_imported"]}
        base = [_timed([sys.executable, "-c", "pass"], env) for _ in range(args.rounds)]
        results["python_startup_ms"] = round(statistics.median(base), 1)
        if yardstick is not None:
            results["ctk_version_ms"] = round(
                statistics.median(_timed(yardstick, env) for _ in range(args.rounds)), 1
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, r in results.items():
        if isinstance(r, dict):
            ratio = (
                f", {r['ratio_to_ctk_version']}x nvidia-ctk --version" if r["ratio_to_ctk_version"] else ""
            )
            print(
                f"{name:40s} median {r['median_ms']:7.1f} ms (min {r['min_ms']:.1f}){ratio}, "
                f"{r['modules_imported']} modules"
            )
    print(
        f"python -c pass: {results['python_startup_ms']} ms; nvidia-ctk --version: "
        f"{results.get('ctk_version_ms', 'n/a')} ms"
    )
    print(json.dumps({"bench": "cli", "rounds": args.rounds, **results}))


if __name__ == "__main__":
    main()
