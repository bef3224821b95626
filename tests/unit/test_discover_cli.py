"""``nodeagent discover`` and ``nodeagent sim`` as a user runs them (separate processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.peers.hostlock import host_owned


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("NODEAGENT_")}
    return subprocess.run(
        [sys.executable, "-m", "nodeagent", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
        check=False,
    )


def test_no_driver_is_one_line_exit_1() -> None:
    # the whole-node cluster installs a driver library on this host while it runs: wait until no test does
    with host_owned("a host without an NVIDIA driver"):
        r = _run("discover")
    assert r.returncode == 1
    assert r.stderr == (
        "error: NVML library not found (libnvidia-ml.so.1); is the NVIDIA driver installed? "
        "Try --simulate dgx-h100\n"
    )
    assert "Traceback" not in r.stdout + r.stderr


def test_unknown_machine_is_bad_input() -> None:
    r = _run("discover", "--simulate", "dgx-z9")
    assert r.returncode == 2 and r.stderr.startswith("error: unknown simulated machine 'dgx-z9'")


def test_sim_state_in_missing_directory_is_bad_input(tmp_path: Path) -> None:
    r = _run("discover", "--simulate", "dgx-h100", "--sim-state", str(tmp_path / "nope" / "s.json"))
    assert r.returncode == 2
    assert r.stderr == f"error: sim-state file {tmp_path}/nope/s.json: directory {tmp_path}/nope does not exist\n"
    (tmp_path / "bad.json").write_text("{not json")
    r = _run("discover", "--sim-state", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and r.stderr.startswith(f"error: sim-state file {tmp_path}/bad.json is unreadable")
    assert r.stderr.count("\n") == 1


def test_discover_json_dgx_h100_with_mig_layout(tmp_path: Path) -> None:
    state = str(tmp_path / "sim.json")
    r = _run("discover", "--simulate", "dgx-h100", "--sim-state", state, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["driver_version"] == "550.54.15" and doc["cuda_version"] == "12.4"
    assert len(doc["gpus"]) == 8
    for i, g in enumerate(doc["gpus"]):
        assert g["index"] == i
        for key in (
            "uuid", "name", "pci_bus_id", "pci_device_id", "memory_mib", "numa_node", "compute_major",
            "compute_minor", "mig_capable", "mig_current", "mig_pending", "mig_profiles", "mig_devices", "processes",
        ):  # fmt: skip
            assert key in g
        assert g["pci_device_id"] == "0x233010DE" and g["mig_capable"] and g["mig_devices"] == []
    assert len(doc["links"]) == 28
    assert {(lk["kind"], lk["nvlinks"]) for lk in doc["links"]} == {("nvlink", 18)}

    r = _run("sim", "mig", "--sim-state", state, "--gpu", "0,7", "3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")
    assert r.returncode == 0, r.stderr
    doc = json.loads(_run("discover", "--sim-state", state, "--json").stdout)
    for i in (0, 7):
        devs = doc["gpus"][i]["mig_devices"]
        assert sorted(d["profile"] for d in devs) == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
        assert all(d["uuid"].startswith("MIG-") and d["ci_id"] == 0 for d in devs)
        assert doc["gpus"][i]["mig_current"] is True
    assert doc["gpus"][3]["mig_devices"] == []
    # the readable table lists the MIG devices and the matrix
    text = _run("discover", "--sim-state", state, "--topology").stdout
    assert "MIG devices:" in text and "3g.40gb" in text and "NV18" in text

    # reboot: instances gone, Hopper comes back with MIG off
    assert _run("sim", "reboot", "--sim-state", state).returncode == 0
    doc = json.loads(_run("discover", "--sim-state", state, "--json").stdout)
    assert doc["gpus"][0]["mig_devices"] == [] and doc["gpus"][0]["mig_current"] is False


def test_sim_inject_commands(tmp_path: Path) -> None:
    state = str(tmp_path / "sim.json")
    assert _run("sim", "inject", "lost", "--sim-state", state, "--gpu", "0").returncode == 2  # machine unknown
    ok = [
        ("sim", "inject", "process", "--simulate", "a30x4", "--sim-state", state, "--gpu", "1", "--pid", "99", "--name", "jupyter"),
        ("sim", "inject", "xid", "--sim-state", state, "--gpu", "2", "--code", "48"),
        ("sim", "inject", "lost", "--sim-state", state, "--gpu", "3"),
        ("sim", "inject", "fail-next", "--sim-state", state, "--function", "nvmlDeviceCreateGpuInstance", "--code", "INSUFFICIENT_RESOURCES"),
    ]  # fmt: skip
    for args in ok:
        r = _run(*args)
        assert r.returncode == 0, (args, r.stderr)
    raw = json.loads(_run("sim", "show", "--sim-state", state).stdout)
    assert raw["gpus"][1]["processes"][0]["name"] == "jupyter" and raw["gpus"][3]["lost"]
    assert raw["fail_next"][0]["code"] == 23 and [e["data"] for e in raw["events"]] == [48, 79]
    doc = json.loads(_run("discover", "--sim-state", state, "--json").stdout)
    assert doc["gpus"][3]["lost"] and doc["gpus"][1]["processes"][0]["pid"] == 99
    assert _run("sim", "inject", "recover", "--sim-state", state).returncode == 0
    doc = json.loads(_run("discover", "--sim-state", state, "--json").stdout)
    assert not doc["gpus"][3]["lost"] and doc["gpus"][1]["processes"] == []
    bad = _run("sim", "inject", "xid", "--sim-state", state, "--gpu", "9", "--code", "48")
    assert bad.returncode == 2 and "GPU 9 does not exist" in bad.stderr


@pytest.mark.parametrize("machine", ["t4x1", "mixed"])
def test_discover_table_small_machines(machine: str) -> None:
    r = _run("discover", "--simulate", machine, "--topology")
    assert r.returncode == 0 and "GPU" in r.stdout and "Traceback" not in r.stderr


def test_sim_machines_lists_all() -> None:
    r = _run("sim", "machines", "--json")
    rows = {m["name"]: m for m in json.loads(r.stdout)}
    assert sorted(rows) == [
        "a10-x2", "a30x4", "dgx-a100-40gb", "dgx-a100-80gb", "dgx-b200", "dgx-h100", "gb200-nvl", "gb300-nvl",
        "gh200", "gh200-144gb", "h100-nvl", "hgx-b300", "hgx-h20", "hgx-h200", "l40-x2", "l40s-x4", "l4x2",
        "mixed", "rtx-pro-6000", "t4x1", "vm-a100-passthrough",
    ]  # fmt: skip
    assert rows["gb200-nvl"]["gpus"] == 4 and rows["gb200-nvl"]["models"] == ["NVIDIA GB200"]
    assert rows["rtx-pro-6000"]["models"] == ["NVIDIA RTX PRO 6000 Blackwell Server Edition"]
    assert rows["l40s-x4"]["models"] == ["NVIDIA L40S"] and rows["a10-x2"]["models"] == ["NVIDIA A10"]


def test_discover_unprivileged_says_what_needs_root(tmp_path: Path) -> None:
    """A non-root discover shows what NVML gives it and names the facts that need root."""
    state = str(tmp_path / "s.json")
    made = _run("sim", "mig", "--simulate", "dgx-h100", "--sim-state", state, "--gpu", "0", "3g.40gb")
    assert made.returncode == 0, made.stderr
    r = _run("discover", "--simulate", "dgx-h100", "--sim-state", state, "--json",
             env={"NODEAGENT_SIM_UNPRIVILEGED": "1"})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert any("GPU instances" in f for f in doc["needs_root"])
    devs = doc["gpus"][0]["mig_devices"]
    assert [(d["profile"], d["placement_start"]) for d in devs] == [("3g.40gb", -1)]
    assert "not shown without root" in r.stderr and "Traceback" not in r.stderr
