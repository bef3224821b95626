"""NVIDIA's nvidia-ctk v1.20.1 (``cdi generate --mode nvml``) on the stand-in library, side by side with the
spec file nodeagent itself writes (``nodeagent cdi generate``), on every simulated machine (fresh) and on a
MIG layout of every MIG-capable machine (plus layouts on several GPUs at once).

One host under the test's root serves both: ``nodeagent cdi generate --sim-host-files`` lays out the
simulator's /proc and /dev facts and a fake driver root (/driver), and writes /var/run/cdi/nvidia.yaml.
The test then makes that host look like a driver's to nvidia-ctk: the /dev stand-ins become character
device nodes with the numbers nodeagent's spec gave them, and the driver root's
libnvidia-ml.so.<version> becomes a copy of the stand-in (nvidia-ctk loads NVML from its driver root).
nodeagent regenerates its spec on that host (its own file, read back from disk, is what is compared), and
nvidia-ctk generates from the same driver root and /dev. nvidia-ctk v1.20.1 reads mig-minors from the
host's /proc (not under --driver-root), so it runs in a private mount namespace with a tmpfs over
/proc/driver holding the file nodeagent laid out.

Compared: the device names (nodeagent also names a MIG-mode GPU as a whole, for the device plugin's
migStrategy 'none'; nvidia-ctk does not: asserted exactly), each device's device nodes, the common device nodes, the env and the driver
mounts (host and container paths). Not compared: hooks (nvidia-ctk runs with ``--disable-hook all``; the
fake driver root's nvidia-cdi-hook does nothing), mount options, and nvidia-ctk's NVIDIA_CTK_LIBCUDA_DIR
(read by its hooks only; asserted to be its one extra variable).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.abi._abi import (
    ALL_MACHINES,
    MIG_LAYOUTS,
    MIG_MACHINES,
    abi_env,
    built,
    discover,
    library,
    nodeagent,
)

DRIVER_ROOT = "/driver"
LIB_DIR = "usr/lib/x86_64-linux-gnu"

# (machine, {GPU index: profiles}): every machine fresh, every MIG machine with a layout on GPU 0, and
# layouts over several GPUs
CASES: list[tuple[str, dict[int, list[str]]]] = [
    *((m, {}) for m in ALL_MACHINES),
    *((m, {0: MIG_LAYOUTS[m]}) for m in MIG_MACHINES),
    ("dgx-h100", {0: ["3g.40gb", "1g.10gb", "1g.10gb"], 3: ["7g.80gb"], 7: ["1g.10gb"] * 7}),
    ("mixed", {1: ["2g.20gb", "2g.20gb", "1g.10gb"]}),
]
IDS = [f"{m}-{'+'.join(f'{g}:{len(p)}' for g, p in layout.items()) or 'fresh'}" for m, layout in CASES]


def nodeagent_spec(root: Path, state: Path, *extra: str) -> dict[str, Any]:
    out = nodeagent("--root", str(root), "cdi", "generate", "--sim-state", str(state), "--driver-root",
                    DRIVER_ROOT, *extra, env=abi_env(state)).stdout  # fmt: skip
    assert "wrote" in out or "up to date" in out, out
    spec: dict[str, Any] = yaml.safe_load((root / "var/run/cdi/nvidia.yaml").read_text())
    return spec


def as_driver_host(root: Path, spec: dict[str, Any], driver_version: str) -> None:
    """Device nodes where nodeagent's simulator put stand-in files; the stand-in NVML in the driver root."""
    for edits in [d["containerEdits"] for d in spec["devices"]] + [spec["containerEdits"]]:
        for node in edits.get("deviceNodes", []):
            host = Path(node["hostPath"])
            if not host.is_char_device():
                host.unlink()
                os.mknod(host, 0o020666, os.makedev(node["major"], node["minor"]))
    lib = root / DRIVER_ROOT.lstrip("/") / LIB_DIR / f"libnvidia-ml.so.{driver_version}"
    lib.unlink()
    shutil.copyfile(library(), lib)


def ctk_cdi(root: Path, state: Path) -> tuple[dict[str, Any], float]:
    if shutil.which("unshare") is None:
        pytest.fail(
            "unshare (util-linux) is needed to give nvidia-ctk its /proc/driver/nvidia-caps", pytrace=False
        )
    script = (
        'mount -t tmpfs nodeagent-test /proc/driver && cp -r "$1/proc/driver/nvidia-caps" /proc/driver/ && '
        'exec "$2" cdi generate --driver-root "$1/driver" --dev-root "$1" --mode nvml --format json '
        "--disable-hook all"
    )
    env = abi_env(state)
    env.pop("LD_LIBRARY_PATH")  # nvidia-ctk must find libnvidia-ml.so.1 under its driver root
    start = time.perf_counter()
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", str(root), str(built("NODEAGENT_NVIDIA_CTK"))],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec: dict[str, Any] = json.loads(proc.stdout)
    return spec, elapsed


def _devices(spec: dict[str, Any]) -> dict[str, set[str]]:
    """CDI device name -> the container paths of its device nodes."""
    return {
        d["name"]: {n["path"] for n in d["containerEdits"].get("deviceNodes", [])} for d in spec["devices"]
    }


def _common(spec: dict[str, Any]) -> dict[str, Any]:
    edits = spec["containerEdits"]
    return {
        "deviceNodes": {n["path"] for n in edits.get("deviceNodes", [])},
        "env": set(edits.get("env", [])),
        "mounts": {(m["hostPath"], m["containerPath"]) for m in edits.get("mounts", [])},
    }


@pytest.mark.parametrize(("machine", "layout"), CASES, ids=IDS)
def test_cdi_generate_matches_nodeagents_spec_file(
    tmp_path: Path, machine: str, layout: dict[int, list[str]]
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    state = root / "state.json"  # the simulated node's state, inside its root
    node = discover(state, machine, abi=False)
    for gpu, profiles in layout.items():
        nodeagent("sim", "mig", "--sim-state", str(state), "--gpu", str(gpu), *profiles, env=abi_env(state))
    first = nodeagent_spec(root, state, "--sim-host-files")
    as_driver_host(root, first, node["driver_version"])
    mine = nodeagent_spec(root, state)
    theirs, elapsed = ctk_cdi(root, state)

    assert mine["kind"] == theirs["kind"] == "nvidia.com/gpu"
    ours_devices, ctk_devices = _devices(mine), _devices(theirs)
    # nodeagent also names a MIG-mode GPU as a whole (index and UUID), as the device plugin with migStrategy
    # "none" advertises it; nvidia-ctk leaves such GPUs out. Everything else is the same.
    whole_mig_gpus = {
        name: {f"/dev/nvidia{g['minor_number']}"}
        for g in discover(state, None, abi=True)["gpus"]
        if g["mig_current"]
        for name in (str(g["index"]), g["uuid"])
    }
    assert {n: ours_devices.pop(n, None) for n in whole_mig_gpus} == whole_mig_gpus
    assert ours_devices == ctk_devices
    ours_common, ctk_common = _common(mine), _common(theirs)
    # nvidia-ctk also tells its own hooks where libcuda is; nodeagent's hooks do not read that variable
    assert ctk_common["env"] - ours_common["env"] == {f"NVIDIA_CTK_LIBCUDA_DIR=/{LIB_DIR}"}
    ctk_common["env"] = ours_common["env"] & ctk_common["env"]
    assert ours_common == ctk_common
    expected_migs = sum(len(p) for p in layout.values())
    assert sum(":" in name for name in _devices(mine)) == expected_migs
    print(f"nvidia-ctk cdi generate on {machine}: {elapsed * 1000:.0f} ms, {len(mine['devices'])} devices")
