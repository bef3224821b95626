"""The same simulated machine through three doors: the Python-level simulator, nodeagent on the REAL pynvml
over the stand-in libnvidia-ml.so.1 (ABI mode), and NVIDIA's go-nvml + go-nvlib (nvml-view) on the same
library. Every machine, and MIG layouts made by nodeagent's simulator, by ``nodeagent mig apply`` through
the C ABI and by the Go program through the C API."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nodeagent.simulator.inject import hold_device
from nodeagent.simulator.machine import load_machine, machine_names
from nodeagent.simulator.state import SimStore
from tests.abi._abi import (
    ALL_MACHINES,
    MIG_LAYOUTS,
    MIG_MACHINES,
    abi_env,
    built,
    compare_with_go,
    discover,
    nodeagent,
    nvml_view,
    plain_env,
    run,
)

NVML_SUCCESS, NVML_ERROR_RESET_REQUIRED, NVML_ERROR_IN_USE = 0, 16, 19  # nvml.h


def _three_way(state: Path, machine: str | None = None) -> dict[str, object]:
    python_level = discover(state, machine, abi=False)
    abi = discover(state, machine, abi=True)
    assert abi == python_level, "nodeagent over the real pynvml + stand-in differs from the Python simulator"
    view = nvml_view(state)
    assert compare_with_go(abi, view) == []
    return abi


@pytest.mark.parametrize("machine", ALL_MACHINES)
def test_fresh_machine_same_through_python_abi_and_go(tmp_path: Path, machine: str) -> None:
    state = tmp_path / "state.json"
    node = _three_way(state, machine)
    gpus = node["gpus"]
    assert isinstance(gpus, list) and gpus and all(not g["mig_devices"] for g in gpus)
    mig_gpus = [g["index"] for g in gpus if g["mig_capable"]]
    assert bool(mig_gpus) == (machine in MIG_MACHINES)
    if not mig_gpus:
        return
    # with MIG on, go-nvlib reads every profile and placement through NVML: same as nodeagent's
    nodeagent(
        "sim", "mig", "--sim-state", str(state), "--gpu", ",".join(map(str, mig_gpus)), env=abi_env(state)
    )
    node = _three_way(state)
    view = nvml_view(state)
    for index in mig_gpus:
        assert node["gpus"][index]["mig_current"]  # type: ignore[index]
        assert view["gpus"][index]["mig_profiles"], (
            f"GPU {index}: NVIDIA Go lists no MIG profiles with MIG on"
        )


LAYOUTS = MIG_LAYOUTS


def test_every_mig_machine_has_a_layout() -> None:
    assert sorted(LAYOUTS) == sorted(MIG_MACHINES)


@pytest.mark.parametrize("machine", MIG_MACHINES)
def test_layout_written_by_the_simulator(tmp_path: Path, machine: str) -> None:
    state = tmp_path / "state.json"
    discover(state, machine, abi=False)
    nodeagent("sim", "mig", "--sim-state", str(state), "--gpu", "0", *LAYOUTS[machine], env=abi_env(state))
    node = _three_way(state)
    devices = node["gpus"][0]["mig_devices"]  # type: ignore[index]
    assert sorted(d["profile"] for d in devices) == sorted(LAYOUTS[machine])


@pytest.mark.parametrize("machine", ["a30x4", "dgx-a100-80gb", "dgx-h100", "dgx-b200", "rtx-pro-6000"])
def test_layout_applied_by_nodeagent_through_the_c_abi(tmp_path: Path, machine: str) -> None:
    """``nodeagent mig apply`` on the real pynvml: MIG mode (with a GPU reset on Ampere, via the nvidia-smi
    stand-in), GPU and compute instances, all through ctypes and the C library."""
    (tmp_path / "root").mkdir()
    state = tmp_path / "root/state.json"  # the simulated node's state, inside its root
    sim = ["--simulate", machine, "--sim-state", str(state)]
    root = ["--root", str(tmp_path / "root")]
    env = abi_env(state, machine)
    assert nodeagent(*root, "mig", "assert", *sim, "-c", "all-balanced", env=env, check=False).returncode == 1
    out = nodeagent(*root, "mig", "apply", *sim, "-c", "all-balanced", env=env).stdout
    assert "applied all-balanced" in out
    assert nodeagent(*root, "mig", "assert", *sim, "-c", "all-balanced", env=env).returncode == 0
    node = _three_way(state)
    gpus = node["gpus"]
    assert isinstance(gpus, list) and all(g["mig_current"] and g["mig_devices"] for g in gpus)
    exported = nodeagent(*root, "mig", "export", *sim, env=env).stdout
    plain = nodeagent(*root, "mig", "export", *sim, env={**env, "NODEAGENT_SIM_ABI": "0"}).stdout
    assert exported == plain and exported.strip()


def test_layout_made_by_nvidias_go_code_is_seen_by_nodeagent(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    discover(state, "dgx-h100", abi=False)  # creates the state file for the machine
    assert nvml_view(state, "mig-mode", "1", "on") == {"activation_status": 0}
    made = [
        nvml_view(state, "create", "1", "3g.40gb", "4"),
        nvml_view(state, "create", "1", "2g.20gb", "0"),
        nvml_view(state, "create", "1", "1g.10gb"),
    ]
    assert [m["placement_start"] for m in made[:2]] == [4, 0]
    node = _three_way(state)
    devices = node["gpus"][1]["mig_devices"]  # type: ignore[index]
    assert [(d["profile"], d["placement_start"], d["gi_id"], d["ci_id"]) for d in devices] == sorted(
        [("2g.20gb", 0, made[1]["gi_id"], 0), ("1g.10gb", made[2]["placement_start"], made[2]["gi_id"], 0),
         ("3g.40gb", 4, made[0]["gi_id"], 0)],
        key=lambda t: t[1],
    )  # fmt: skip
    # a placement that overlaps fails in Go with NVML's answer, and nothing changes
    refused = nvml_view(state, "create", "1", "3g.40gb", "4", check=False)
    assert refused.returncode == 1 and "Insufficient resources" in refused.stderr
    nvml_view(state, "destroy", "1", str(made[0]["gi_id"]))
    after = discover(state, None, abi=True)
    assert [d["profile"] for d in after["gpus"][1]["mig_devices"]] == ["2g.20gb", "1g.10gb"]
    assert compare_with_go(after, nvml_view(state)) == []


def _mig_mode(state: Path, gpu: int) -> tuple[bool, bool]:
    node = _three_way(state)
    g = node["gpus"][gpu]  # type: ignore[index]
    return g["mig_current"], g["mig_pending"]


def test_mig_mode_on_an_idle_ampere_gpu_is_current_at_once_for_go_too(tmp_path: Path) -> None:
    """Bare metal, nothing holds the GPU: the driver resets it and the mode is current at once."""
    state = tmp_path / "state.json"
    discover(state, "dgx-a100-80gb", abi=False)
    assert nvml_view(state, "mig-mode", "2", "on") == {"activation_status": NVML_SUCCESS}
    assert _mig_mode(state, 2) == (True, True)


def test_mig_mode_on_a_held_ampere_gpu_stays_pending_until_reset_for_go_too(tmp_path: Path) -> None:
    """Another client holds the device (nvidia-persistenced): pending set, status IN_USE, current after the
    next reset/reboot."""
    state = tmp_path / "state.json"
    discover(state, "dgx-a100-80gb", abi=False)
    hold_device(SimStore(load_machine("dgx-a100-80gb"), state), 2, "nvidia-persistenced")
    assert nvml_view(state, "mig-mode", "2", "on") == {"activation_status": NVML_ERROR_IN_USE}
    assert _mig_mode(state, 2) == (False, True)
    nodeagent("sim", "reboot", "--sim-state", str(state), env=abi_env(state))
    assert _mig_mode(state, 2) == (True, True)


def test_mig_mode_in_a_passthrough_vm_needs_a_reset_for_go_too(tmp_path: Path) -> None:
    """A passthrough VM cannot reset the GPU: pending set, status RESET_REQUIRED, current after a reboot."""
    state = tmp_path / "state.json"
    discover(state, "vm-a100-passthrough", abi=False)
    assert nvml_view(state, "mig-mode", "0", "on") == {"activation_status": NVML_ERROR_RESET_REQUIRED}
    assert _mig_mode(state, 0) == (False, True)
    nodeagent("sim", "reboot", "--sim-state", str(state), env=abi_env(state))
    assert _mig_mode(state, 0) == (True, True)


def test_unprivileged_caller_gets_no_permission_through_the_c_abi_and_go(tmp_path: Path) -> None:
    """NODEAGENT_SIM_UNPRIVILEGED=1 (NVML as a non-root user): nodeagent's discover over the real pynvml
    shows what the Python simulator shows and names the facts that need root; ``mig apply`` fails with one
    line on both paths and changes nothing; go-nvml gets NVML's NO_PERMISSION."""
    (tmp_path / "root").mkdir()
    state = tmp_path / "root/state.json"  # the simulated node's state, inside its root
    discover(state, "dgx-h100", abi=False)
    nodeagent("sim", "mig", "--sim-state", str(state), "--gpu", "0", "3g.40gb", env=abi_env(state))
    before = discover(state, None, abi=True)
    unprivileged = {"NODEAGENT_SIM_UNPRIVILEGED": "1"}
    sim = ["--sim-state", str(state)]
    abi_env_u, plain_env_u = abi_env(state, **unprivileged), {**plain_env(), **unprivileged}
    abi = json.loads(nodeagent("discover", *sim, "--json", env=abi_env_u).stdout)
    assert abi == json.loads(nodeagent("discover", *sim, "--json", env=plain_env_u).stdout)
    assert any("GPU instances" in fact for fact in abi["needs_root"])
    assert [(d["profile"], d["placement_start"]) for d in abi["gpus"][0]["mig_devices"]] == [("3g.40gb", -1)]
    root = ["--root", str(tmp_path / "root")]
    refusals = []
    for env in (abi_env_u, plain_env_u):
        proc = nodeagent(*root, "mig", "apply", *sim, "-c", "all-1g.10gb", env=env, check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        refusals.append([line for line in proc.stderr.splitlines() if "root" in line])
        assert "not inside --root" not in proc.stderr, proc.stderr
    assert refusals[0] == refusals[1] and len(refusals[0]) == 1, refusals
    assert discover(state, None, abi=True) == before
    for go_args in (["create", "0", "1g.10gb"], ["mig-mode", "1", "on"]):
        go = run([str(built("NODEAGENT_NVML_VIEW")), *go_args], abi_env_u, check=False)
        assert go.returncode == 1 and "Insufficient Permissions" in go.stderr, go.stderr
    assert discover(state, None, abi=True) == before


def test_machine_lists_are_every_simulated_machine() -> None:
    names = machine_names()
    assert sorted(ALL_MACHINES) == names
    assert sorted(MIG_MACHINES) == [n for n in names if any(g.mig_product for g in load_machine(n).gpus)]


# A child process on the real pynvml over the stand-in: MIG device handles by index and back by MIG UUID.
HANDLES = """
import json, pynvml
pynvml.nvmlInit()
gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
seen = []
for i in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
    try:
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, i)
    except pynvml.NVMLError_NotFound:
        continue
    back = pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(mig))
    seen.append([pynvml.nvmlDeviceGetUUID(back), pynvml.nvmlDeviceIsMigDeviceHandle(back).value,  # a c_uint, as pynvml returns it
                 pynvml.nvmlDeviceGetGpuInstanceId(back), pynvml.nvmlDeviceGetComputeInstanceId(back)])
codes = []
for index in (1, 2):  # an A100 with MIG off, an L4 without MIG
    try:
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(pynvml.nvmlDeviceGetHandleByIndex(index), 0)
    except pynvml.NVMLError as e:
        codes.append(e.value)
print(json.dumps({"seen": seen, "max_mig_off": pynvml.nvmlDeviceGetMaxMigDeviceCount(
    pynvml.nvmlDeviceGetHandleByIndex(1)), "codes": codes}))
"""


def test_mig_device_handles_by_index_and_by_mig_uuid_through_the_c_abi(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    discover(state, "mixed", abi=False)
    nodeagent("sim", "mig", "--sim-state", str(state), "--gpu", "0", "3g.40gb", "1g.10gb", env=abi_env(state))
    node = discover(state, None, abi=True)
    out = json.loads(run([sys.executable, "-c", HANDLES], abi_env(state)).stdout)
    devices = node["gpus"][0]["mig_devices"]
    assert sorted(out["seen"]) == sorted([d["uuid"], 1, d["gi_id"], d["ci_id"]] for d in devices)
    assert len(out["seen"]) == 2
    assert out["max_mig_off"] == 0 and out["codes"] == [6, 3]  # NOT_FOUND (MIG off), NOT_SUPPORTED (no MIG)
