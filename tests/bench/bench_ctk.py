"""NVIDIA's nvidia-ctk (v1.20.1) and nodeagent timed on the same inputs, each as a whole process.

Run (after `source tests/testbin/setup.sh`): .venv/bin/python tests/bench/bench_ctk.py [--rounds N]
* runtime configure: ``nvidia-ctk runtime configure --runtime=containerd`` (drop-in) and
  ``nodeagent --root R runtime configure`` (drop-in, no restart, no leak guard) on fresh copies of the same
  corpus files (containerd 1.7 systemd version 2, containerd 2.4 default version 4, empty file);
* cdi generate: ``nvidia-ctk cdi generate --mode nvml`` on the stand-in libnvidia-ml.so.1 (driver root
  and /dev laid out as in tests/abi/test_abi_ctk.py) and ``nodeagent --root R cdi generate`` (real pynvml
  over the stand-in) on dgx-h100 with 7x 1g.10gb per GPU (56 MIG devices). nvidia-ctk's figure includes
  the ``unshare``+``mount`` wrapper that gives it its /proc/driver/nvidia-caps (a few ms).
Both tools pay their own start-up (a Go binary; a Python interpreter); ``..._in_process_ms`` is nodeagent's
configure call alone (what the daemon and ``bootstrap`` pay). Prints medians and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nodeagent.hostpaths import HostPaths
from nodeagent.runtime import configure as rc
from nodeagent.runtime.containerd import DEFAULT_BINARY
from tests.abi._abi import abi_env, built, discover, nodeagent
from tests.abi.test_abi_ctk import as_driver_host, ctk_cdi, nodeagent_spec

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "containerd"
FILES = ("containerd-1.7-systemd.toml", "v2/containerd-2.4-default.toml", "empty.toml")


def _timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=120)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return elapsed * 1000


def _fresh_root(tmp: Path, name: str) -> Path:
    root = Path(tempfile.mkdtemp(dir=tmp))
    etc = root / "etc" / "containerd"
    etc.mkdir(parents=True)
    (etc / "config.toml").write_text((CORPUS / name).read_text().replace("/etc/containerd/", f"{etc}/"))
    return root


def bench_runtime(tmp: Path, rounds: int) -> dict[str, Any]:
    ctk = str(built("NODEAGENT_NVIDIA_CTK"))
    out: dict[str, Any] = {}
    for name in FILES:
        ours, theirs, inproc = [], [], []
        for _ in range(rounds):
            root = _fresh_root(tmp, name)
            start = time.perf_counter()
            rc.configure(HostPaths(root), rc.Options(mode="drop-in", leak_guard=False))
            inproc.append((time.perf_counter() - start) * 1000)
            root = _fresh_root(tmp, name)
            theirs.append(_timed([ctk, "runtime", "configure", "--runtime=containerd",
                                  f"--config={root}/etc/containerd/config.toml",
                                  f"--drop-in-config={root}/etc/containerd/conf.d/99-nvidia.toml",
                                  f"--nvidia-runtime-path={DEFAULT_BINARY}"]))  # fmt: skip
            root = _fresh_root(tmp, name)
            ours.append(_timed([sys.executable, "-m", "nodeagent", "--root", str(root), "runtime", "configure",
                                "--restart", "none", "--no-leak-guard"]))  # fmt: skip
        key = Path(name).stem
        out[f"runtime_configure_{key}_nvidia_ctk_ms"] = round(statistics.median(theirs), 1)
        out[f"runtime_configure_{key}_nodeagent_ms"] = round(statistics.median(ours), 1)
        out[f"runtime_configure_{key}_nodeagent_in_process_ms"] = round(statistics.median(inproc), 1)
    return out


def bench_cdi(tmp: Path, rounds: int) -> dict[str, Any]:
    root = tmp / "cdi-root"
    root.mkdir()
    state = root / "state.json"  # the simulated node's state, inside its root
    node = discover(state, "dgx-h100", abi=False)
    nodeagent("sim", "mig", "--sim-state", str(state), "--gpu", "all", *["1g.10gb"] * 7, env=abi_env(state))
    as_driver_host(root, nodeagent_spec(root, state, "--sim-host-files"), node["driver_version"])
    ours, theirs = [], []
    spec = root / "var/run/cdi/nvidia.yaml"
    for _ in range(rounds):
        spec.unlink()  # both write the whole spec every round
        ours.append(_timed([sys.executable, "-m", "nodeagent", "--root", str(root), "cdi", "generate",
                            "--sim-state", str(state), "--driver-root", "/driver"], env=abi_env(state)))  # fmt: skip
        theirs.append(ctk_cdi(root, state)[1] * 1000)
    return {
        "cdi_generate_dgx_h100_56mig_nvidia_ctk_ms": round(statistics.median(theirs), 1),
        "cdi_generate_dgx_h100_56mig_nodeagent_ms": round(statistics.median(ours), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if shutil.which("unshare") is None:
        raise SystemExit("bench_ctk: unshare (util-linux) is needed for nvidia-ctk cdi generate")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        figures: dict[str, Any] = {"rounds": args.rounds}
        figures.update(bench_runtime(tmp, args.rounds))
        figures.update(bench_cdi(tmp, args.rounds))
    figures["loadavg"] = float(Path("/proc/loadavg").read_text().split()[0])
    print("nvidia-ctk v1.20.1 vs nodeagent, whole processes, same inputs (medians)")
    for k, v in figures.items():
        print(f"{k:55s} {v}")
    print(json.dumps({"bench": "ctk", **figures}))


if __name__ == "__main__":
    main()
