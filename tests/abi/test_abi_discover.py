"""The same simulated machine through three doors: the Python-level simulator, nodeagent on the REAL pynvml
over the stand-in libnvidia-ml.so.1 (ABI mode), and NVIDIA's go-nvml + go-nvlib (nvml-view) on the same
library. Every machine, and MIG layouts made by nodeagent's simulator, by ``nodeagent mig apply`` through
the C ABI and by the Go program through the C API."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.abi._abi import (
    ALL_MACHINES,
    MIG_MACHINES,
    abi_env,
    compare_with_go,
    discover,
    nodeagent,
    nvml_view,
)


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


# a mixed layout per machine: one big and one small GPU instance on its first MIG-capable GPU (GPU 0)
LAYOUTS = {
    "a30x4": ["2g.12gb", "1g.6gb"],
    "dgx-a100-40gb": ["3g.20gb", "1g.5gb"],
    "dgx-a100-80gb": ["3g.40gb", "1g.10gb"],
    "dgx-h100": ["3g.40gb", "1g.10gb"],
    "hgx-h200": ["3g.71gb", "1g.18gb"],
    "mixed": ["3g.40gb", "1g.10gb"],
}


@pytest.mark.parametrize("machine", MIG_MACHINES)
def test_layout_written_by_the_simulator(tmp_path: Path, machine: str) -> None:
    state = tmp_path / "state.json"
    discover(state, machine, abi=False)
    nodeagent("sim", "mig", "--sim-state", str(state), "--gpu", "0", *LAYOUTS[machine], env=abi_env(state))
    node = _three_way(state)
    devices = node["gpus"][0]["mig_devices"]  # type: ignore[index]
    assert sorted(d["profile"] for d in devices) == sorted(LAYOUTS[machine])


@pytest.mark.parametrize("machine", ["a30x4", "dgx-a100-80gb", "dgx-h100"])
def test_layout_applied_by_nodeagent_through_the_c_abi(tmp_path: Path, machine: str) -> None:
    """``nodeagent mig apply`` on the real pynvml: MIG mode (with a GPU reset on Ampere, via the nvidia-smi
    stand-in), GPU and compute instances, all through ctypes and the C library."""
    state = tmp_path / "state.json"
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


def test_mig_mode_on_ampere_stays_pending_until_reset_for_go_too(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    discover(state, "dgx-a100-80gb", abi=False)
    assert nvml_view(state, "mig-mode", "2", "on") == {"activation_status": 0}
    node = _three_way(state)
    gpu = node["gpus"][2]  # type: ignore[index]
    assert (gpu["mig_current"], gpu["mig_pending"]) == (False, True)
