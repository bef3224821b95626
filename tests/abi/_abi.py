"""Helpers of the ABI tests: the stand-in libnvidia-ml.so.1, nodeagent on the real pynvml, NVIDIA's Go tools.

Everything that loads the stand-in runs in a child process: once pynvml has bound a libnvidia-ml.so.1 in
a process it keeps it, and the test process must keep seeing "no NVML" for the other tests. What needs no
stand-in (the Python-level simulator's discover, ``nodeagent sim``) runs in the test process.
Built by tests/testbin/setup.sh (nodeagent_peers_nvml_abi): NODEAGENT_NVML_LIBRARY, NODEAGENT_NVML_VIEW,
NODEAGENT_NVIDIA_CTK. A missing one FAILS the test with how to build it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# every machine of `nodeagent sim machines` (test_abi_discover checks that none is missing)
MIG_MACHINES = [
    "a30x4", "dgx-a100-40gb", "dgx-a100-80gb", "dgx-b200", "dgx-h100", "gb200-nvl", "gb300-nvl", "gh200",
    "gh200-144gb", "h100-nvl", "hgx-b300", "hgx-h20", "hgx-h200", "mixed", "rtx-pro-6000", "vm-a100-passthrough",
]  # fmt: skip
ALL_MACHINES = [*MIG_MACHINES, "a10-x2", "l40-x2", "l40s-x4", "l4x2", "t4x1"]

# a mixed layout per machine: one big and one small GPU instance on its first MIG-capable GPU (GPU 0)
MIG_LAYOUTS: dict[str, list[str]] = {
    "a30x4": ["2g.12gb", "1g.6gb"],
    "dgx-a100-40gb": ["3g.20gb", "1g.5gb"],
    "dgx-a100-80gb": ["3g.40gb", "1g.10gb"],
    "dgx-h100": ["3g.40gb", "1g.10gb"],
    "hgx-h200": ["3g.71gb", "1g.18gb"],
    "mixed": ["3g.40gb", "1g.10gb"],
    "dgx-b200": ["3g.90gb", "1g.23gb"],
    "gb200-nvl": ["3g.93gb", "1g.23gb"],
    "gb300-nvl": ["3g.139gb", "1g.35gb"],
    "gh200": ["3g.48gb", "1g.12gb"],
    "gh200-144gb": ["3g.72gb", "1g.18gb"],
    "h100-nvl": ["3g.47gb", "1g.12gb"],
    "hgx-b300": ["3g.135gb", "1g.34gb"],
    "hgx-h20": ["3g.48gb", "1g.12gb"],
    # the Blackwell RTX PRO variants: graphics, no media engine, all media engines
    "rtx-pro-6000": ["2g.48gb+gfx", "1g.24gb-me", "1g.24gb+me.all"],
    "vm-a100-passthrough": ["3g.40gb", "1g.10gb"],
}

# Profile names on which go-nvlib v0.13 and NVML (nodeagent takes NVML's own name) differ, each asserted:
# (GPU name, NVML's profile name) -> the name go-nvlib's NewMigProfile(...).String() gives. go-nvlib does
# not read the driver's name; it derives "<N>gb" from the profile's share of the GPU's memory rounded up
# to eighths, times the GPU's total memory rounded up to whole GiB.
GO_NVLIB_NAMES = {
    # 144384 of 146432 MiB rounds up to 8/8 of the 143 GiB total: "7g.143gb", while the driver says 7g.144gb
    ("NVIDIA GH200 144G HBM3e", "7g.144gb"): "7g.143gb",
    # B300, 276480 MiB = 270 GiB: a quarter of 270 is 67.5, which go-nvlib rounds to 68; 8/8 gives 270
    ("NVIDIA B300 SXM6 AC", "1g.67gb"): "1g.68gb",
    ("NVIDIA B300 SXM6 AC", "2g.67gb"): "2g.68gb",
    ("NVIDIA B300 SXM6 AC", "7g.269gb"): "7g.270gb",
}


def built(var: str) -> Path:
    value = os.environ.get(var, "")
    if not value or not Path(value).is_file():
        pytest.fail(
            f"{var} is not set to a built file: run `source tests/testbin/setup.sh` (or bash tests/run.sh), "
            "which builds the stand-in libnvidia-ml.so.1, nvml-view and nvidia-ctk",
            pytrace=False,
        )
    return Path(value)


def library() -> Path:
    return built("NODEAGENT_NVML_LIBRARY")


def abi_env(state: Path, machine: str | None = None, **extra: str) -> dict[str, str]:
    """Environment of a process that uses the stand-in: loader path, machine, state, nodeagent ABI mode."""
    env = dict(os.environ)
    lib = library()
    env["LD_LIBRARY_PATH"] = (
        f"{lib.parent}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else str(lib.parent)
    )
    env["NODEAGENT_SIM_STATE"] = str(state)
    if machine is not None:
        env["NODEAGENT_SIM_MACHINE"] = machine
    else:
        env.pop("NODEAGENT_SIM_MACHINE", None)
    env["NODEAGENT_SIM_ABI"] = "1"
    env.update(extra)
    return env


_SIM_VARS = ("NODEAGENT_SIM_ABI", "NODEAGENT_SIM_MACHINE", "NODEAGENT_SIM_STATE")


def plain_env() -> dict[str, str]:
    """Environment of a nodeagent process on the Python-level simulator (no ABI mode)."""
    return {k: v for k, v in os.environ.items() if k not in _SIM_VARS}


def run(
    cmd: list[str], env: dict[str, str], check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return _checked(proc) if check else proc


def _checked(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """``proc``, or an AssertionError with its command line, exit code and the ends of its output."""
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, proc.args))} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def nodeagent(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """``nodeagent ARGS`` in a child process with ``env``; ``nodeagent sim ...`` (which changes the state file
    and never loads NVML, whatever the environment says) in this process."""
    if args[:1] == ("sim",):
        proc = in_process(*args)
        return _checked(proc) if check else proc
    return run([sys.executable, "-m", "nodeagent", *args], env, check=check)


def in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """nodeagent on the Python-level simulator, run in this process (its output captured): for what needs no
    stand-in, where a child's start would cost more than the work. The simulator's variables are unset
    meanwhile, as in ``plain_env``."""
    from nodeagent.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.pop(k) for k in _SIM_VARS if k in os.environ}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.environ.update(saved)
    return subprocess.CompletedProcess(["nodeagent", *args], code, out.getvalue(), err.getvalue())


def discover(state: Path, machine: str | None, abi: bool) -> dict[str, Any]:
    """``nodeagent discover --json`` on the simulator, through the C ABI (real pynvml, in a child) or not (in
    this process)."""
    sim = (["--simulate", machine] if machine else []) + ["--sim-state", str(state)]
    if abi:
        proc = nodeagent("discover", *sim, "--json", env=abi_env(state, machine))
    else:
        proc = _checked(in_process("discover", *sim, "--json"))
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def nvml_view(state: Path, *args: str, check: bool = True) -> Any:
    """nvml-view (go-nvml + go-nvlib) on the stand-in; its JSON answer."""
    proc = run([str(built("NODEAGENT_NVML_VIEW")), *args], abi_env(state), check=check)
    if not check and proc.returncode != 0:
        return proc
    return json.loads(proc.stdout)


def compare_with_go(node: dict[str, Any], view: dict[str, Any]) -> list[str]:
    """Differences between nodeagent's discover JSON and nvml-view's, as readable lines (empty: same)."""
    diffs: list[str] = []

    def same(what: str, a: Any, b: Any) -> None:
        if a != b:
            diffs.append(f"{what}: nodeagent {a!r} != NVIDIA Go {b!r}")

    same("driver version", node["driver_version"], view["driver_version"])
    same("CUDA driver version", node["cuda_driver_version"], view["cuda_driver_version"])
    same("GPU count", len(node["gpus"]), len(view["gpus"]))
    for g, v in zip(node["gpus"], view["gpus"], strict=False):
        at = f"GPU {g['index']}"
        same(f"{at} index", g["index"], v["index"])
        same(f"{at} uuid", g["uuid"], v["uuid"])
        same(f"{at} name", g["name"], v["name"])
        same(f"{at} PCI bus id", g["pci_bus_id"][-12:].lower(), v["pci_bus_id"][-12:].lower())
        same(f"{at} minor", g["minor_number"], v["minor_number"])
        same(f"{at} memory", g["memory_mib"], v["memory_mib"])
        # go-nvlib spells out "Ada Lovelace"; nodeagent labels the family "ada"
        same(f"{at} architecture", g["architecture"], v["architecture"].lower().split()[0])
        same(
            f"{at} compute capability", f"{g['compute_major']}.{g['compute_minor']}", v["compute_capability"]
        )
        same(f"{at} MIG capable", g["mig_capable"], v["mig_capable"])
        same(f"{at} MIG current", g["mig_current"], v["mig_enabled"])
        same(f"{at} MIG pending", g["mig_pending"], v["mig_pending"])
        if not v["mig_enabled"]:
            # NVML answers NOT_SUPPORTED for GPU instance profile info while MIG is disabled, so go-nvlib
            # lists no profiles; nodeagent may still show those of its own tables. Compared once MIG is on.
            if v["mig_profiles"]:
                diffs.append(f"{at} MIG disabled, yet NVIDIA Go lists MIG profiles {v['mig_profiles']!r}")
        else:
            mine = [
                (p["name"], p["gi_profile_id"], p["id"], p["slice_count"], p["instance_count"], p["memory_mib"],
                 p["placement_starts"], p["placement_size"])
                for p in g["mig_profiles"]
            ]  # fmt: skip
            theirs = [
                (p["name"].removeprefix("MIG "), p["gi_profile_id"], p["id"], p["slice_count"], p["instance_count"],
                 p["memory_mib"], p["placement_starts"], p["placement_size"])
                for p in v["mig_profiles"]
            ]  # fmt: skip
            same(f"{at} MIG profiles", mine, theirs)
            parsed = [p["go_nvlib_name"] for p in v["mig_profiles"]]
            expected = [GO_NVLIB_NAMES.get((g["name"], p["name"]), p["name"]) for p in g["mig_profiles"]]
            same(f"{at} MIG profile names as go-nvlib parses them (GO_NVLIB_NAMES applied)", expected, parsed)
        # both sides name the MIG device fields alike
        keys = ("gi_id", "ci_id", "uuid", "profile", "placement_start", "placement_size", "memory_mib")
        mine_devs = [tuple(d[k] for k in keys) for d in g["mig_devices"]]
        theirs_devs = [tuple(d[k] for k in keys) for d in v["mig_devices"]]
        same(f"{at} MIG devices", mine_devs, theirs_devs)
    return diffs
