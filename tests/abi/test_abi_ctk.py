"""NVIDIA's nvidia-ctk v1.20.1 (``cdi generate --mode nvml``) on the stand-in library, side by side with
nodeagent: the same CDI device names and the same device nodes per device.

The test lays out a fake driver root the way the driver would: /dev/nvidia<minor>, the control nodes,
/dev/nvidia-caps/nvidia-cap<N> with /proc/driver/nvidia-caps/mig-minors in the driver's documented
numbering, libcuda.so.<version>, and libnvidia-ml.so.<version> = the stand-in. nvidia-ctk v1.20.1 reads
mig-minors from the host's /proc (not under --driver-root), so it runs in a private mount namespace with
a tmpfs over /proc/driver holding the file.
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

from nodeagent.deviceplugin.allocate import CONTROL_DEVICES, mig_cap_minors
from tests.abi._abi import abi_env, built, discover, library, nodeagent

NVIDIA_MAJOR, UVM_MAJOR, CAPS_MAJOR = 195, 510, 511


def _mig_minors() -> list[tuple[str, int]]:
    """/proc/driver/nvidia-caps/mig-minors as the driver writes it (NVIDIA's MIG user guide): config 1,
    monitor 2, then for GPU g, GPU instance i: gpu<g>/gi<i>/access followed by its 8 compute instances."""
    lines = [("config", 1), ("monitor", 2)]
    minor = 3
    for gpu in range(8):
        for gi in range(15):
            lines.append((f"gpu{gpu}/gi{gi}/access", minor))
            lines += [(f"gpu{gpu}/gi{gi}/ci{ci}/access", minor + 1 + ci) for ci in range(8)]
            minor += 9
    return lines


def _driver_root(root: Path, node: dict[str, Any]) -> Path:
    dev = root / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for g in node["gpus"]:
        os.mknod(dev / f"nvidia{g['minor_number']}", 0o020644, os.makedev(NVIDIA_MAJOR, g["minor_number"]))
    os.mknod(dev / "nvidiactl", 0o020644, os.makedev(NVIDIA_MAJOR, 255))
    os.mknod(dev / "nvidia-modeset", 0o020644, os.makedev(NVIDIA_MAJOR, 254))
    os.mknod(dev / "nvidia-uvm", 0o020644, os.makedev(UVM_MAJOR, 0))
    os.mknod(dev / "nvidia-uvm-tools", 0o020644, os.makedev(UVM_MAJOR, 1))
    minors = _mig_minors()
    for _, minor in minors:
        os.mknod(dev / "nvidia-caps" / f"nvidia-cap{minor}", 0o020644, os.makedev(CAPS_MAJOR, minor))
    procdir = root / "proc-driver" / "nvidia-caps"
    procdir.mkdir(parents=True)
    (procdir / "mig-minors").write_text("".join(f"{name} {minor}\n" for name, minor in minors))
    libdir = root / "usr" / "lib" / "x86_64-linux-gnu"
    libdir.mkdir(parents=True)
    version = node["driver_version"]
    (libdir / f"libcuda.so.{version}").write_bytes(b"")
    (libdir / f"libnvidia-ml.so.{version}").symlink_to(library())
    for lib in ("libcuda", "libnvidia-ml"):
        (libdir / f"{lib}.so.1").symlink_to(f"{lib}.so.{version}")
    return root


def _ctk_cdi(root: Path, state: Path) -> tuple[dict[str, Any], float]:
    if shutil.which("unshare") is None:
        pytest.fail(
            "unshare (util-linux) is needed to give nvidia-ctk its /proc/driver/nvidia-caps", pytrace=False
        )
    script = (
        'mount -t tmpfs nodeagent-test /proc/driver && cp -r "$1/proc-driver/nvidia-caps" /proc/driver/ && '
        'exec "$2" cdi generate --driver-root "$1" --mode nvml --format json --disable-hook all'
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


def _nodeagent_devices(node: dict[str, Any]) -> dict[str, set[str]]:
    """CDI name -> device nodes, from nodeagent's inventory and its device-plugin device-node rules.
    Names follow NVIDIA's "index" and "uuid" strategies: GPU index and UUID; for a GPU in MIG mode its MIG
    devices as "<gpu>:<n>" (n in NVML's MIG handle order: GPU instance id, then compute instance id)."""
    out: dict[str, set[str]] = {}
    for g in node["gpus"]:
        gpu_node = f"/dev/nvidia{g['minor_number']}"
        if not g["mig_current"]:
            out[str(g["index"])] = out[g["uuid"]] = {gpu_node}
            continue
        migs = sorted(g["mig_devices"], key=lambda d: (d["gi_id"], d["ci_id"]))
        for n, d in enumerate(migs):
            caps = {
                f"/dev/nvidia-caps/nvidia-cap{m}"
                for m in mig_cap_minors(g["minor_number"], d["gi_id"], d["ci_id"])
            }
            out[f"{g['index']}:{n}"] = out[d["uuid"]] = {gpu_node, *caps}
    return out


LAYOUTS: dict[str, dict[int, list[str]]] = {
    "dgx-h100": {0: ["3g.40gb", "1g.10gb", "1g.10gb"], 3: ["7g.80gb"]},
    "a30x4": {},
    "mixed": {1: ["2g.20gb", "2g.20gb", "1g.10gb"]},
}


@pytest.mark.parametrize("machine", list(LAYOUTS))
def test_cdi_generate_names_and_device_nodes_match_nodeagent(tmp_path: Path, machine: str) -> None:
    state = tmp_path / "state.json"
    discover(state, machine, abi=False)
    for gpu, profiles in LAYOUTS[machine].items():
        nodeagent("sim", "mig", "--sim-state", str(state), "--gpu", str(gpu), *profiles, env=abi_env(state))
    node = discover(state, None, abi=True)
    spec, elapsed = _ctk_cdi(_driver_root(tmp_path / "driver", node), state)
    ctk = {d["name"]: {n["path"] for n in d["containerEdits"]["deviceNodes"]} for d in spec["devices"]}
    everything = ctk.pop("all")
    mine = _nodeagent_devices(node)
    assert ctk == mine
    assert everything == set().union(*mine.values())
    common = {n["path"] for n in spec["containerEdits"]["deviceNodes"]}
    # nodeagent's control nodes; nvidia-ctk adds /dev/nvidia-modeset (display), nodeagent does not
    assert common == {*CONTROL_DEVICES, "/dev/nvidia-modeset"}
    print(f"nvidia-ctk cdi generate on {machine}: {elapsed * 1000:.0f} ms")
