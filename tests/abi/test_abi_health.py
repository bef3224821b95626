"""Health through the C ABI: XIDs injected with ``nodeagent sim inject`` reach nodeagent's adapter on the
real pynvml (nvmlEventSetWait_v2, documented nvmlEventData_t layout) and go-nvml's EventSet.Wait alike;
a lost GPU and its recovery look the same on both NVML paths; metrics agree."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nodeagent.simulator.inject import inject_xid
from nodeagent.simulator.machine import load_machine
from nodeagent.simulator.state import SimStore
from tests.abi._abi import abi_env, built, discover, nodeagent, nvml_view, plain_env, run

NO_ID = 0xFFFFFFFF

# A child process: an adapter from open_nvml (ABI mode or not, by environment) waits for events.
WAITER = """
import dataclasses, json, sys
from pathlib import Path
from nodeagent.nvmlsource import open_nvml
adapter = open_nvml(None, Path(sys.argv[1]))
assert adapter.wait_events(0) == []
print("ready", flush=True)
events = []
for _ in range(50):
    events += adapter.wait_events(200)
    if len(events) >= int(sys.argv[2]):
        break
print(json.dumps([e.__dict__ for e in events]), flush=True)
print(json.dumps([dataclasses.asdict(adapter.metrics(i)) for i in range(adapter.device_count())]), flush=True)
print(type(adapter.nvml).__name__, adapter.nvml.__name__ if hasattr(adapter.nvml, "__name__") else "", flush=True)
adapter.close()
"""


def _events_seen(tmp_path: Path, abi: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    state = tmp_path / ("abi" if abi else "sim") / "state.json"
    state.parent.mkdir()
    discover(state, "dgx-h100", abi=False)
    env = abi_env(state) if abi else plain_env()
    nodeagent("sim", "mig", "--sim-state", str(state), "--gpu", "3", "3g.40gb", "3g.40gb", env=env)
    child = subprocess.Popen(
        [sys.executable, "-c", WAITER, str(state), "3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        sim = ["--sim-state", str(state)]
        nodeagent("sim", "inject", "xid", *sim, "--gpu", "1", "--code", "48", env=env)
        nodeagent("sim", "inject", "xid", *sim, "--gpu", "3", "--code", "94", "--gi", "2", env=env)
        nodeagent("sim", "inject", "xid", *sim, "--gpu", "6", "--code", "31", env=env)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, err
    events, metrics, kind = out.strip().splitlines()
    return json.loads(events), json.loads(metrics), kind


def test_injected_xids_reach_nodeagent_on_the_real_pynvml_like_on_the_simulator(tmp_path: Path) -> None:
    abi_events, abi_metrics, abi_kind = _events_seen(tmp_path, abi=True)
    sim_events, sim_metrics, sim_kind = _events_seen(tmp_path, abi=False)
    assert abi_kind == "module pynvml" and sim_kind.startswith("SimulatedNvml")
    assert [(e["gpu_index"], e["kind"], e["xid"], e["gi_id"]) for e in abi_events] == [
        (1, "xid", 48, None),
        (3, "xid", 94, 2),
        (6, "xid", 31, None),
    ]
    assert abi_events == sim_events
    # idle GPUs: no time-dependent load in the readings but the energy counter, which grows between the runs
    assert [dict(m, energy_mj=0) for m in abi_metrics] == [dict(m, energy_mj=0) for m in sim_metrics]
    assert all(m["energy_mj"] > 0 for m in abi_metrics)


def test_go_nvml_event_wait_gets_the_injected_xids(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    discover(state, "a30x4", abi=False)
    env = abi_env(state)
    waiter = subprocess.Popen(
        [str(built("NODEAGENT_NVML_VIEW")), "events", "3000", "2"], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        time.sleep(1.5)  # the Go process starts its interpreter and registers before the first XID
        nodeagent("sim", "inject", "xid", "--sim-state", str(state), "--gpu", "2", "--code", "79", env=env)
        nodeagent("sim", "inject", "xid", "--sim-state", str(state), "--gpu", "0", "--code", "13", env=env)
        out, err = waiter.communicate(timeout=60)
    finally:
        waiter.kill()
    assert waiter.returncode == 0, err
    assert json.loads(out) == [
        {"gpu": 2, "event_type": 8, "event_data": 79, "gpu_instance_id": NO_ID, "compute_instance_id": NO_ID},
        {"gpu": 0, "event_type": 8, "event_data": 13, "gpu_instance_id": NO_ID, "compute_instance_id": NO_ID},
    ]


def test_lost_gpu_and_recovery_look_the_same_on_both_paths(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    before = discover(state, "dgx-a100-80gb", abi=True)
    env = abi_env(state)
    nodeagent("sim", "inject", "lost", "--sim-state", str(state), "--gpu", "5", env=env)
    abi = discover(state, None, abi=True)
    assert abi == discover(state, None, abi=False)
    lost = [g["index"] for g in abi["gpus"] if g["lost"]]
    assert lost == [5]
    # go-nvml stops at the lost GPU with NVML's own error
    view = subprocess.run(
        [str(built("NODEAGENT_NVML_VIEW"))], env=env, capture_output=True, text=True, check=False
    )
    assert view.returncode == 1 and "GPU is lost" in view.stderr
    nodeagent("sim", "inject", "recover", "--sim-state", str(state), "--gpu", "5", env=env)
    assert discover(state, None, abi=True) == discover(state, None, abi=False) == before


# A child process: the recovery action of every GPU as nodeagent's adapter reads it (field 230), compared
# with NVIDIA's go-nvml reading the same field (nvml-view fields), and in
# ABI mode the raw answer of the real pynvml's nvmlDeviceGetFieldValues for GPU 1 (one served field with
# a scope, one field the simulator lacks).
RECOVERY = """
import json, sys
from pathlib import Path
from nodeagent.nvmlsource import open_nvml
adapter = open_nvml(None, Path(sys.argv[1]))
actions = [adapter.recovery_action(i) for i in range(adapter.device_count())]
raw = None
if type(adapter.nvml).__name__ == "module":
    nvml = adapter.nvml
    values = nvml.nvmlDeviceGetFieldValues(nvml.nvmlDeviceGetHandleByIndex(1), [(230, 0), 1])
    raw = [(v.fieldId, v.scopeId, v.nvmlReturn, v.valueType, v.value.uiVal) for v in values]
print(json.dumps({"actions": actions, "raw": raw, "nvml": type(adapter.nvml).__name__}))
adapter.close()
"""


def test_recovery_action_after_an_xid_reads_the_same_through_the_c_abi(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    discover(state, "dgx-h100", abi=False)
    inject_xid(SimStore(load_machine("dgx-h100"), state), 1, 79, recovery_action=2)  # node reboot
    abi = json.loads(run([sys.executable, "-c", RECOVERY, str(state)], abi_env(state)).stdout)
    sim = json.loads(run([sys.executable, "-c", RECOVERY, str(state)], plain_env()).stdout)
    assert (abi["nvml"], sim["nvml"]) == ("module", "SimulatedNvml")
    assert abi["actions"] == sim["actions"] == [0, 2, 0, 0, 0, 0, 0, 0]
    # NVML_VALUE_TYPE_UNSIGNED_INT 1; the unserved field answers its own NOT_SUPPORTED (3), the call SUCCESS
    assert abi["raw"] == [[230, 0, 0, 1, 2], [1, 0, 3, 0, 0]]
    # go-nvml's Device.GetFieldValues (nvml-view fields) reads the same: every GPU's recovery action, and the
    # same per-field answers for GPU 1
    go = [nvml_view(state, "fields", str(i), "230") for i in range(len(abi["actions"]))]
    assert [v[0]["value"] for v in go] == abi["actions"]
    assert all((v[0]["nvml_return"], v[0]["value_type"]) == (0, 1) for v in go)
    raw = nvml_view(state, "fields", "1", "230:0", "1")
    assert [
        [v["field_id"], v["scope_id"], v["nvml_return"], v["value_type"], v["value"] or 0] for v in raw
    ] == abi["raw"]


# A child process: NVML's drain calls as the remediation makes them (nodeagent's adapter, by UUID), on GPU 2.
DRAIN = """
import json, sys
from pathlib import Path
from nodeagent.errors import NvmlError
from nodeagent.nvmlsource import open_nvml
adapter = open_nvml(None, Path(sys.argv[1]))
uuid = adapter.gpu_uuid(2)
adapter.set_persistence_mode_of(uuid, True)
try:
    adapter.set_drain(uuid, True)
    refused = ""
except NvmlError as e:
    refused = type(e).__name__
adapter.set_persistence_mode_of(uuid, False)
adapter.set_drain(uuid, True)
drained = adapter.drain_state(uuid)
adapter.set_drain(uuid, False)
print(json.dumps({"refused": refused, "drained": drained, "after": adapter.drain_state(uuid),
                  "nvml": type(adapter.nvml).__name__}))
adapter.close()
"""


def test_drain_state_is_refused_with_persistence_on_the_same_through_the_c_abi(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    discover(state, "dgx-h100", abi=False)
    abi = json.loads(run([sys.executable, "-c", DRAIN, str(state)], abi_env(state)).stdout)
    sim = json.loads(run([sys.executable, "-c", DRAIN, str(state)], plain_env()).stdout)
    assert (abi.pop("nvml"), sim.pop("nvml")) == ("module", "SimulatedNvml")
    assert abi == sim and abi["refused"] and abi["drained"] is True and abi["after"] is False
